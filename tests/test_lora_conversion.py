"""peft's `convert_to_lora` / `save_as_lora` turn a NeuroAda adapter into a LoRA one (for LoRA-only servers and
diffusers): NeuroAda is additive, so at full rank the converted LoRA computes what the adapter computes; below it, the
truncated SVD keeps part of the delta (docs/guide.md#converting-to-lora). What peft cannot convert it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import convert_to_lora, save_as_lora

from peft_neuroada import NeuroAdaConfig
from tests.conftest import neuroada_layers, tiny_causal_lm, tiny_gpt2, tiny_llama

IDS = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))


def outputs(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["linear", "conv1d"])
def test_at_full_rank_the_converted_lora_computes_what_the_adapter_computes(build):
    model = get_peft_model(build(), NeuroAdaConfig(k=3, init_weights=False, neuron_fraction=0.5))
    assert model.supports_lora_conversion()
    lora_config, state_dict = convert_to_lora(model, rank=1.0)  # every singular value: the exact delta
    converted = get_peft_model(build(), lora_config)
    assert not set_peft_model_state_dict(converted, state_dict).unexpected_keys
    torch.testing.assert_close(outputs(converted), outputs(model), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outputs(model), outputs(build()))


def test_a_converted_real_smollm2_adapter_saves_and_loads_as_a_lora_adapter(smollm2, tmp_path):
    config = NeuroAdaConfig(k=1, init_weights=False, target_modules=["q_proj", "down_proj"], layers_to_transform=[0])
    model = get_peft_model(smollm2, config)
    save_as_lora(tmp_path, model, rank=1.0)
    expected = outputs(model)
    loaded = PeftModel.from_pretrained(model.unload(), tmp_path)
    assert loaded.peft_config["default"].peft_type == "LORA"
    torch.testing.assert_close(outputs(loaded), expected, rtol=1e-4, atol=1e-4)


def test_at_k_1_the_delta_s_singular_values_are_its_columns_norms():
    """Each row holds one delta, so the columns of the dense delta have disjoint rows and are orthogonal: its rank
    is the number of distinct inputs chosen, and a rank-r LoRA keeps exactly the r heaviest columns."""
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=1, init_weights=False))
    for layer in neuroada_layers(model):
        delta = layer.get_additive_delta("default")
        column_norms = delta.norm(dim=0).sort(descending=True).values
        singular_values = torch.linalg.svdvals(delta)
        torch.testing.assert_close(singular_values, column_norms[: len(singular_values)], rtol=1e-5, atol=1e-6)
        assert not column_norms[len(singular_values) :].any()


def test_a_merged_adapter_is_refused_as_peft_refuses_any():
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    model.merge_adapter()
    with pytest.raises(ValueError, match="currently merged into the base weights"):
        convert_to_lora(model, rank=4)


def test_moe_experts_are_refused_by_type_as_peft_refuses_layers_it_cannot_convert():
    model = get_peft_model(tiny_causal_lm("qwen3_moe"), NeuroAdaConfig(k=2))
    with pytest.raises(TypeError, match="do not support LoRA conversion: .*ParamWrapper"):
        convert_to_lora(model, rank=4)


def test_the_guide_reports_the_committed_conversion_measurements():
    """docs/guide.md's table is benchmarks/lora_conversion.py's committed data, rounded."""
    root = Path(__file__).resolve().parents[1]
    data = json.loads((root / "docs" / "study" / "lora-conversion.json").read_text())
    guide = " ".join((root / "docs" / "guide.md").read_text().split())
    for budget in data["budgets"]:
        ranks = {entry["rank"]: entry for entry in budget["ranks"]}
        kept = " / ".join(f"{ranks[rank]['energy_kept']:.0%}" for rank in (16, 64, 256))
        kl = " / ".join(f"{ranks[rank]['kl']:.2f}" for rank in (16, 64))
        assert f"k={budget['k']} ({budget['neuroada_parameters']:,} parameters)" in guide
        assert kept in guide and kl in guide, (kept, kl)
