"""`neuroada estimate`: a run's memory per method from the model's config alone. What it counts from shapes
(trainable parameters, the adapter's tensors, gradients, AdamW's state) equals what a real run allocates, what it
traces (what backward keeps) equals what autograd saves, on MoE models in every dtype too, where its peak comes within
10% of a real step's, and the growth it adds over the weights comes within 12% of the peak growth measured by
benchmarks/train_cost.py (docs/study/memory-*.json)."""

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
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoConfig, AutoModelForCausalLM, BertConfig, PretrainedConfig

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.targets import targeted_modules, targeted_parameters
from peft_neuroada.train import cli
from peft_neuroada.train.estimate import ADAMW_IMPLEMENTATIONS, Estimate, Estimator, estimate, weight_bytes
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


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops allocate while it is on and that are still alive (none of `existing`), at
    their peak: a CPU step's peak growth as the estimate counts it, the allocator's caching aside."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.existing = {tensor.untyped_storage().data_ptr() for tensor in existing}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.existing:
                storage = tensor.untyped_storage()
                self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.live = {key: held for key, held in self.live.items() if not held[0].expired()}
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def _peak_growth_of_a_second_step(model, ids) -> int:
    """The peak growth of forward, backward and AdamW's step once AdamW's state exists (as the estimate's peak has
    it), over the weights, the adapter and that state."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.0)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    state = [tensor for held in optimizer.state.values() for tensor in held.values()]
    with LiveBytes([*model.parameters(), *model.buffers(), *state]) as live:
        step()
    return live.peak


MOE = {
    "mixtral": dict(num_local_experts=8),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=512, head_dim=32),
}


def moe_config(model_type: str) -> PretrainedConfig:
    """Two layers of 8 experts (2 per token) whose stacks (8 x 1024 x 128) outweigh what 16 tokens keep elsewhere."""
    sizes = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
    sizes |= dict(num_key_value_heads=2, num_experts_per_tok=2, vocab_size=256, pad_token_id=0)
    return AutoConfig.for_model(model_type, **sizes, **MOE[model_type])


def trained_as(method: str, config: PretrainedConfig, dtype: str, row: Estimate):
    """The model of `config` set up as the estimate's `row` trains it: NeuroAda k=4 and LoRA at its rank on the same
    targets (expert stacks included), or every targeted weight and stack dense (mask-based)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).train()
    layers = sorted({name.rpartition(".")[2] for name, _ in targeted_modules(base, NeuroAdaConfig())})
    stacks = targeted_parameters(base, NeuroAdaConfig())
    assert stacks, "the experts are among NeuroAda's targets"
    if method == "neuroada":
        return get_peft_model(base, NeuroAdaConfig(k=4))
    if method == "lora":
        rank = int(row.method.split("r=")[1].split()[0])
        names = [name for name, _ in stacks]
        return get_peft_model(
            base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=layers, target_parameters=names)
        )
    base.requires_grad_(False)
    for weight in [module.weight for _, module in targeted_modules(base, NeuroAdaConfig())] + [p for _, p in stacks]:
        weight.requires_grad_(True)
    return base


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("model_type", MOE)
@pytest.mark.parametrize("method", ["neuroada", "lora", "mask"])
def test_on_moe_models_in_every_dtype_the_estimate_is_a_real_steps_memory(method, model_type, dtype) -> None:
    """Experts included: NeuroAda's and LoRA's per-forward copy of each expert stack (kept for backward, its dense
    gradient formed there), LoRA on the experts too, mask-based tuning training them dense."""
    config = moe_config(model_type)
    (row,) = estimate(config, [4], [method], dtype, batch=1, seq=16, device="cpu")
    model = trained_as(method, config, dtype, row)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    counted = ("gradients", "optimizer") if method == "mask" else ("trainable", "gradients", "optimizer")
    measured = _one_step(model, ids)
    assert {name: getattr(row, name) for name in counted} == {name: measured[name] for name in counted}
    assert row.activations == pytest.approx(measured["activations"], rel=0.10)
    growth = row.total - row.weights - row.optimizer
    assert growth == pytest.approx(_peak_growth_of_a_second_step(model, ids), rel=0.10)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_command_estimates_a_moe_config_in_a_dtype_the_meta_grouped_matmul_refuses(
    dtype, tmp_path, capsys
) -> None:
    moe_config("mixtral").save_pretrained(tmp_path)
    arguments = [
        "estimate",
        str(tmp_path),
        "--dtype",
        dtype,
        "--k",
        "1",
        "--seq",
        "16",
        "--methods",
        "neuroada",
        "lora",
    ]
    assert cli.main(arguments) == 0
    table = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert "expert stack gradient" in table[0]
    assert [row[0] for row in table[1:]] == ["| NeuroAda k=1", "| LoRA r=1 (k=1's budget)"]


WRONG_ARGUMENTS = {
    "k-zero": (["--k", "0"], "argument --k: must be at least 1, not 0"),
    "k-negative": (["--k", "-3"], "argument --k: must be at least 1, not -3"),
    "k-not-a-number": (["--k", "1", "x"], "argument --k: must be a whole number, not 'x'"),
    "batch-negative": (["--batch", "-1"], "argument --batch: must be at least 1, not -1"),
    "batch-zero": (["--batch", "0"], "argument --batch: must be at least 1, not 0"),
    "seq-zero": (["--seq", "0"], "argument --seq: must be at least 1, not 0"),
}


@pytest.mark.parametrize(("arguments", "message"), WRONG_ARGUMENTS.values(), ids=WRONG_ARGUMENTS.keys())
def test_a_wrong_argument_gets_one_line_naming_it_and_exit_status_2(arguments, message, smollm2_path, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["estimate", str(smollm2_path), *arguments])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"neuroada estimate: error: {message}" and "Traceback" not in err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"ks": [0]}, "k must be whole numbers of at least 1, not 0"),
        ({"ks": []}, r"k must be whole numbers of at least 1, not \[\]"),
        ({"batch": 0}, "batch must be a whole number of at least 1, not 0"),
        ({"seq": -1}, "seq must be a whole number of at least 1, not -1"),
        ({"dtype": "int8"}, "dtype must be one of float32, bfloat16, float16, not 'int8'"),
    ],
    ids=["k-zero", "no-k", "batch-zero", "seq-negative", "dtype"],
)
def test_estimate_refuses_a_wrong_argument_by_name(arguments, message, smollm2_path) -> None:
    with pytest.raises(ValueError, match=message):
        estimate(str(smollm2_path), **{"ks": [1], "methods": ["neuroada"], **arguments})


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
