"""`neuroada estimate`: a run's memory per method from the model's config alone. What it counts from shapes
(trainable parameters, the adapter's tensors, gradients, AdamW's state) equals what a real run allocates, what it
traces (what backward keeps) equals what autograd saves, and the growth it adds over the weights comes within 12% of
the peak growth measured by benchmarks/train_cost.py (docs/study/memory-*.json)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, BertConfig

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.train.estimate import ADAMW_IMPLEMENTATIONS, Estimator, estimate, weight_bytes
from peft_neuroada.train.models import load_default_model
from tests.conftest import tiny_llama

REPO = Path(__file__).resolve().parents[1]
MEASURED = sorted((REPO / "docs" / "study").glob("memory-*.json"))


def _saved_by_autograd(model, ids) -> int:
    """Bytes autograd keeps over one real forward pass (each storage once, parameters and buffers excluded)."""
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    return loss, sum(kept.values())


def _one_step(model, ids) -> dict[str, int]:
    """What a real AdamW step allocates: the trained parameters' gradients and optimizer state, in bytes."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.0)
    loss, saved = _saved_by_autograd(model, ids)
    loss.backward()
    gradients = sum(p.grad.numel() * p.grad.element_size() for p in trained)
    optimizer.step()
    states = [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
    return {
        "trainable": sum(p.numel() for p in trained),
        "gradients": gradients,
        "optimizer": sum(t.numel() * t.element_size() for t in states),
        "activations": saved,
    }


@pytest.mark.parametrize("method", ["neuroada", "lora"])
def test_on_smollm2_in_bfloat16_every_counted_figure_is_what_a_real_step_allocates(method, tmp_path) -> None:
    base, _ = load_default_model(dtype="bfloat16")
    base.config.save_pretrained(tmp_path)
    (expected,) = estimate(str(tmp_path), [20], [method], "bfloat16", batch=2, seq=48)
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    if method == "neuroada":
        model = get_peft_model(base, NeuroAdaConfig(k=20))
    else:
        rank = int(expected.method.split("r=")[1].split()[0])
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    adapter = [
        t for name, t in [*model.named_parameters(), *model.named_buffers()] if "neuroada_" in name or "lora_" in name
    ]
    ids = torch.randint(0, base.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    measured = _one_step(model.train(), ids)
    assert expected.weights - base_bytes == sum(t.numel() * t.element_size() for t in adapter)
    assert {name: getattr(expected, name) for name in measured} == measured


def test_mask_based_and_full_fine_tuning_count_dense_gradients_and_state_in_the_models_dtype() -> None:
    config = tiny_llama().config
    mask, full = estimate(config, [2], ["mask", "full"], "bfloat16", batch=1, seq=16)
    estimator = Estimator(config, torch.bfloat16, 1, 16, None)
    targeted = sum(w.numel() for w in estimator.targets)
    assert (mask.gradients, mask.optimizer) == (2 * targeted, 2 * 2 * targeted)
    assert mask.weights == weight_bytes(estimator.model, None) + targeted  # one bool mask entry per weight
    everything = sum(p.numel() for p in estimator.model.parameters())
    assert (full.trainable, full.gradients, full.optimizer) == (everything, 2 * everything, 4 * everything)


def test_the_mask_baseline_moves_with_its_mask_storage_its_moments_dtype_and_the_adamw_implementation() -> None:
    """The choices the paper does not state, each by exactly what it stores: the mask's bytes per entry, AdamW's two
    moments per trained entry, and the step's temporaries (foreach: a copy of every second moment; for-loop: two of
    the largest; fused: none)."""
    config = tiny_llama().config
    per_adamw = {
        adamw: Estimator(config, torch.bfloat16, 1, 16, None, "cuda", adamw) for adamw in ADAMW_IMPLEMENTATIONS
    }
    targets = per_adamw["foreach"].targets
    entries, largest = sum(w.numel() for w in targets), max(w.numel() for w in targets)
    bools = per_adamw["foreach"].mask(2)
    assert per_adamw["foreach"].mask(2, "bfloat16").total - bools.total == entries
    assert bools.total - per_adamw["foreach"].mask(2, "bit").total == round(entries * 7 / 8)
    wide = per_adamw["foreach"].mask(2, "bool", torch.float32)
    assert (wide.optimizer, wide.step_temporaries, wide.gradients) == (8 * entries, 4 * entries, bools.gradients)
    temporaries = {adamw: estimator.mask(2).step_temporaries for adamw, estimator in per_adamw.items()}
    assert temporaries == {"foreach": 2 * entries, "for-loop": 2 * 2 * largest, "fused": 0}
    assert Estimator(config, torch.bfloat16, 1, 16, None, "cpu").adamw == "for-loop"  # torch's default there
    with pytest.raises(ValueError, match="adamw must be one of"):
        Estimator(config, torch.bfloat16, 1, 16, None, "cuda", "sgd")


def test_on_a_4_bit_base_the_methods_that_train_base_weights_are_refused_and_the_weights_shrink() -> None:
    config = tiny_llama().config
    rows = estimate(config, [1], ["neuroada", "mask", "full"], "bfloat16", quantize="nf4")
    neuroada, *refused = rows
    assert [method for method, _ in refused] == ["mask", "full"]
    assert all("nf4 model keeps frozen" in reason for _, reason in refused)
    (unquantized,) = estimate(config, [1], ["neuroada"], "bfloat16")
    assert neuroada.weights < unquantized.weights and neuroada.activations == unquantized.activations


@pytest.mark.skipif(not MEASURED, reason="no committed memory measurements")
@pytest.mark.parametrize("measured_file", MEASURED, ids=[path.stem for path in MEASURED])
def test_the_estimate_comes_within_twelve_percent_of_every_measured_growth(measured_file: Path) -> None:
    """What is measured is the peak growth over the loaded weights train_cost.py saw in RSS (CPU) or
    max_memory_allocated (CUDA); the weights are counted, not measured, so the estimate is held to the growth alone
    (its total less the base weights), for the same model, dtype, batch and device, as memory_figures.py tabulates
    them in docs/results.md."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        memory_figures = importlib.import_module("memory_figures")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    rows = [row for row in memory_figures.rows_of(json.loads(measured_file.read_text())) if row["estimate"]]
    assert len(rows) == 6, "the frozen floor, NeuroAda k=1 and k=20, mask-based, LoRA and full fine-tuning"
    for row in rows:
        estimated_growth = row["estimate"] - row["base"]
        assert abs(estimated_growth - row["growth"]) <= 0.12 * row["growth"], (
            row["variant"],
            estimated_growth / row["growth"],
        )


def test_the_command_prints_a_table_from_a_config_alone_offline(tmp_path) -> None:
    tiny_llama().config.save_pretrained(tmp_path)
    command = [str(Path(sys.executable).with_name("neuroada")), "estimate", str(tmp_path / "config.json")]
    command += ["--k", "1", "2", "--batch", "4", "--seq", "64", "--methods", "neuroada", "lora", "mask", "full"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [line.split("|")[1].strip() for line in completed.stdout.splitlines() if line.startswith("| ")][1:]
    assert rows[:2] == ["NeuroAda k=1", "NeuroAda k=2"] and all(row.startswith("LoRA r=") for row in rows[2:4])
    assert rows[4:] == ["mask-based k=1", "mask-based k=2", "full fine-tuning"]
    assert "Not counted: the allocator" in completed.stdout


def test_an_encoder_config_is_refused_with_what_the_command_covers(tmp_path) -> None:
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="causal language models"):
        estimate(str(tmp_path), [1], ["neuroada"])
    assert AutoConfig.from_pretrained(tmp_path).model_type == "bert"
