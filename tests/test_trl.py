"""TRL's trainers take a NeuroAdaConfig as `peft_config`, as they take a LoraConfig (real SmolLM2)."""

from __future__ import annotations

import datasets
import pytest
import torch
from peft import PeftModel, get_peft_model
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.train.models import load_default_model
from tests.conftest import named_neuroada_layers


def frozen_weights(model) -> dict[str, torch.Tensor]:
    return {n: layer.get_base_layer().weight.detach().clone() for n, layer in named_neuroada_layers(model).items()}


def deltas(model) -> list[torch.Tensor]:
    return [p.detach().clone() for n, p in model.named_parameters() if "neuroada_delta" in n]


def run_args(config_class, tmp_path, **overrides):
    # TRL's defaults: gradient checkpointing and bf16 autocast (accelerate wraps the model's forward in it).
    settings = {
        "per_device_train_batch_size": 4,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "report_to": [],
        "logging_steps": 1,
    }
    return config_class(output_dir=str(tmp_path), use_cpu=True, **(settings | overrides))


def completion_log_probs(model, batch) -> torch.Tensor:
    """Each sequence's summed log-probability of its completion tokens (what DPO compares), in the model's own dtype:
    no autocast unless the model's forward brings its own."""
    inputs = {key: value for key, value in batch.items() if key in ("input_ids", "attention_mask")}
    with torch.no_grad():
        log_probs = model(**inputs, use_cache=False).logits[:, :-1].float().log_softmax(-1)
    per_token = log_probs.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return (per_token * batch["completion_mask"][:, 1:]).sum(1)


def preference_pairs(count: int) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": f"What is {i} + {i}?", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"} for i in range(count)]
    )


def test_sft_trainer_trains_only_the_deltas_and_saves_an_adapter_that_reloads(tmp_path):
    model, tokenizer = load_default_model()
    turns = [(f"What is {i} + {i}?", f"{2 * i}") for i in range(12)]
    conversations = [
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        for question, answer in turns
    ]
    trainer = SFTTrainer(
        model=model,
        args=run_args(SFTConfig, tmp_path, max_length=48),
        train_dataset=datasets.Dataset.from_list(conversations),
        processing_class=tokenizer,
        peft_config=NeuroAdaConfig(k=1),
    )
    assert isinstance(trainer.model, PeftModel) and trainer.model.peft_type == "NEUROADA"
    before = frozen_weights(trainer.model)
    trainer.train()

    after = frozen_weights(trainer.model)
    assert all(torch.equal(after[name], weight) for name, weight in before.items())
    assert all(delta.abs().sum() > 0 for delta in deltas(trainer.model))
    trainer.save_model(str(tmp_path / "adapter"))
    batch = tokenizer(["What is 3 + 3?"], return_tensors="pt")
    trainer.model.eval()
    reloaded = PeftModel.from_pretrained(load_default_model()[0], tmp_path / "adapter")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = trainer.model(**batch).logits.float()
        assert torch.equal(reloaded(**batch).logits.float(), expected)


@pytest.mark.parametrize("precompute", [False, True], ids=["reference-per-step", "reference-precomputed"])
def test_dpo_trainer_reads_its_reference_from_the_disabled_adapter_unchanged_by_training(tmp_path, precompute):
    # With a peft model and no ref_model, DPO's reference is the policy with its adapter disabled: it must stay the
    # base model, bit for bit, while the deltas train.
    model, tokenizer = load_default_model()
    trainer = DPOTrainer(
        model=model,
        args=run_args(DPOConfig, tmp_path, max_length=32, precompute_ref_log_probs=precompute, learning_rate=1e-6),
        train_dataset=preference_pairs(16),
        processing_class=tokenizer,
        peft_config=NeuroAdaConfig(k=1),
    )
    assert trainer.ref_model is None
    batch = next(iter(trainer.get_train_dataloader()))
    reference_before = trainer.compute_ref_log_probs(trainer.model, batch)  # under TRL's bf16 autocast
    base = completion_log_probs(trainer.model, batch)  # float32: `train` has not wrapped the forward in autocast yet
    trainer.train()

    assert all(delta.abs().sum() > 0 for delta in deltas(trainer.model))
    reference_after = trainer.compute_ref_log_probs(trainer.model, batch)
    for before, after in zip(reference_before, reference_after, strict=True):
        assert torch.equal(before, after)
    # The policy moved away from that reference. At DPO's default learning rate (1e-6) the deltas' products lie far
    # below a bf16 step of the layers' outputs, so under TRL's bf16 autocast whether any of them survives the rounding
    # depends on the CPU's bf16 matmul: the rewards TRL logs are all 0 on a Xeon with AVX-512 but no native bf16, and
    # 0 at two of three steps on an AVX2 EPYC. In float32, the model's dtype, deltas of ~1e-6 move the outputs on
    # every CPU: both are measured there, with accelerate's autocast wrapper taken off the forward.
    float32_model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    policy = completion_log_probs(float32_model, batch)  # the merged copy: the deltas added into a copy of the weights
    with float32_model.disable_adapter():
        reference = completion_log_probs(float32_model, batch)
    assert torch.equal(reference, base)  # the weights restored bit for bit after the policy's visits
    # Far above float32's rounding of these sums (8 eps of the largest): the largest move is ~20 times that here.
    assert (policy - reference).abs().max() > 8 * torch.finfo(torch.float32).eps * reference.abs().max(), policy - base


def test_continuing_a_trained_adapter_with_dpo_its_reference_is_that_adapter_once_copied_as_documented(tmp_path):
    # Given a PeftModel and no peft_config, TRL adds a "ref" adapter and copies parameters named ".default.", a LoRA
    # naming NeuroAda's deltas do not follow: "ref" would stay zero (the base model). docs/guide.md's lines copy it.
    trained, tokenizer = load_default_model()
    get_peft_model(trained, NeuroAdaConfig(k=1, init_weights=False)).save_pretrained(tmp_path / "sft")
    model = PeftModel.from_pretrained(load_default_model()[0], tmp_path / "sft", is_trainable=True)
    trainer = DPOTrainer(
        model=model,
        args=run_args(DPOConfig, tmp_path / "dpo", max_length=32, max_steps=1),
        train_dataset=preference_pairs(4),
        processing_class=tokenizer,
    )
    trainer.model.delete_adapter("ref")
    trainer.model.add_weighted_adapter(["default"], [1.0], "ref")
    trainer.train()

    (first,) = [entry for entry in trainer.state.log_history if "rewards/chosen" in entry]
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0  # before any update, policy == reference
