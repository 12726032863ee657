"""Every peft method the plugin overrides or re-implements, called as a LoRA user calls it, with LoRA on the same call
as the control: the same state after it, the same refusals (type and peft's message), the same warnings. Where
NeuroAda differs on purpose, the spec names the difference. (Unloading: tests/test_unload_as_lora.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from peft_neuroada import NeuroAdaConfig
from tests.conftest import tiny_causal_lm, tiny_gpt2, tiny_llama

TARGETS = ["q_proj", "v_proj"]
IDS = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(0))


def neuroada(**options) -> NeuroAdaConfig:
    return NeuroAdaConfig(**{"k": 2, "init_weights": False, "target_modules": TARGETS} | options)


def lora(**options) -> LoraConfig:
    return LoraConfig(**{"r": 2, "init_lora_weights": False, "target_modules": TARGETS} | options)


METHODS = pytest.mark.parametrize("config", [neuroada, lora], ids=["neuroada", "lora"])


def two_adapters(config, build=tiny_llama, **options):
    model = get_peft_model(build(), config(**options), adapter_name="one")
    model.add_adapter("two", config(**options))
    return model


def tuner_layers(model) -> list[BaseTunerLayer]:
    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]


def outputs(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def warned(call) -> set[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return {str(w.message) for w in caught if "neuroada" not in str(w.message).lower()}


def both(case):
    """`case(config)` for NeuroAda and for LoRA."""
    return case(neuroada), case(lora)


def same(case):
    """`case(config)`'s result, the same for NeuroAda as for LoRA."""
    ours, control = both(case)
    assert ours == control
    return ours


def test_merging_a_named_inactive_adapter_merges_it_alone_and_unmerging_restores_the_outputs():
    def case(config):
        model = two_adapters(config)
        before = outputs(model)
        model.merge_adapter(adapter_names=["two"])
        state = [list(layer.merged_adapters) for layer in tuner_layers(model)]
        model.unmerge_adapter()
        torch.testing.assert_close(outputs(model), before, rtol=1e-5, atol=1e-6)
        return state, model.active_adapters

    assert same(case) == ([["two"]] * 4, ["one"])


def test_merging_twice_and_unmerging_twice_warn_as_lora_warns():
    def case(config):
        model = get_peft_model(tiny_llama(), config())
        model.merge_adapter()
        again = warned(model.merge_adapter)
        model.unmerge_adapter()
        return again, warned(model.unmerge_adapter)

    same(case)


def test_merging_an_adapter_no_layer_holds_changes_nothing_as_with_lora():
    def case(config):
        model = get_peft_model(tiny_llama(), config())
        model.merge_adapter(adapter_names=["absent"])
        return [layer.merged for layer in tuner_layers(model)]

    assert same(case) == [False] * 4


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_safe_merge_of_a_broken_adapter_is_refused_with_peft_s_message_and_leaves_the_weights(value):
    def case(config):
        model = get_peft_model(tiny_llama(), config())
        layer = tuner_layers(model)[0]
        with torch.no_grad():
            next(p for n, p in layer.named_parameters() if "default" in n).view(-1)[0] = value
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match="NaNs detected") as refused:
            model.merge_and_unload(safe_merge=True)
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter, weights[name], rtol=0, atol=0, equal_nan=True)
        return type(refused.value)

    same(case)


@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
def test_deleting_the_active_adapter_leaves_the_same_state_as_with_lora(merged):
    def case(config):
        model = two_adapters(config)
        if merged:
            model.merge_adapter()
        try:
            model.delete_adapter("one")
        except ValueError as error:
            return "refused", str(error).split(" ")[:4]
        return model.active_adapters, sorted(model.peft_config)

    same(case)


def test_several_active_adapters_train_together_as_with_lora():
    def case(config):
        model = two_adapters(config)
        model.base_model.set_adapter(["one", "two"])
        names = [name.split(".") for name, p in model.named_parameters() if p.requires_grad]
        return sorted({part for parts in names for part in parts if part in ("one", "two")})

    assert same(case) == ["one", "two"]


def test_a_second_adapter_with_trained_biases_is_refused_as_lora_refuses_it():
    def case(config):
        model = get_peft_model(tiny_llama(), config(bias="all"), adapter_name="one")
        with pytest.raises(ValueError) as refused:
            model.add_adapter("two", config(bias="all"))
        return str(refused.value).replace("NeuroAdaPluginModel", "LoraModel")

    same(case)


@pytest.mark.parametrize("autocast", [True, False])
def test_adapter_tensors_on_a_bf16_base_take_the_dtype_lora_s_take(autocast):
    def case(config):
        model = get_peft_model(tiny_llama().to(torch.bfloat16), config(), autocast_adapter_dtype=autocast)
        return {p.dtype for p in model.parameters() if p.requires_grad}

    assert same(case) == {torch.float32 if autocast else torch.bfloat16}


class Unknown(nn.Module):
    """An architecture peft has no default targets for: a linear layer and experts' stack of three (2, 4) weights."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.experts = nn.Linear(4, 4), nn.Module()
        self.experts.stack = nn.Parameter(torch.randn(3, 2, 4))
        self.experts.is_transposed = False  # (expert, out, in), as transformers marks its experts


def test_an_architecture_without_default_targets_is_refused_with_lora_s_message():
    def case(config):
        with pytest.raises(ValueError) as refused:
            get_peft_model(Unknown(), config(target_modules=None))
        return str(refused.value).replace("`in", "` in")  # (LoRA's message lacks the space)

    same(case)


def test_an_architecture_without_default_targets_takes_target_parameters_alone_as_lora_does():
    def case(config):
        model = get_peft_model(Unknown(), config(target_modules=None, target_parameters=["experts.stack"]))
        return sorted(name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer))

    assert same(case) == ["base_model.model.experts"]


def test_adapter_state_dicts_and_saved_folders_are_laid_out_as_lora_s(tmp_path):
    """The keys lose the adapter's name; the second adapter saves in its own folder. NeuroAda saves its index
    buffers beside the deltas, where LoRA saves A and B."""

    def case(config):
        model = two_adapters(config)
        keys = {
            name: {
                part
                for key in get_peft_model_state_dict(model, adapter_name=name)
                for part in key.split(".")
                if part.startswith(("neuroada_", "lora_"))
            }
            for name in ("one", "two")
        }
        folder = tmp_path / config.__name__
        model.save_pretrained(folder)
        return keys, sorted(path.relative_to(folder).as_posix() for path in folder.rglob("adapter_*"))

    (neuroada_keys, neuroada_files), (lora_keys, lora_files) = both(case)
    assert neuroada_files == lora_files
    assert neuroada_keys["one"] == neuroada_keys["two"] == {"neuroada_delta", "neuroada_indices"}
    assert lora_keys["one"] == lora_keys["two"] == {"lora_A", "lora_B"}


def test_an_adapter_loaded_for_inference_trains_nothing_and_one_loaded_trainable_trains_its_tensors(tmp_path):
    def case(config):
        folder = tmp_path / config.__name__
        get_peft_model(tiny_llama(), config()).save_pretrained(folder)
        counts = []
        for trainable in (False, True):
            model = PeftModel.from_pretrained(tiny_llama(), folder, is_trainable=trainable)
            counts.append(sum(p.requires_grad for p in model.parameters()))
        return counts

    (neuroada_counts, lora_counts) = both(case)
    assert neuroada_counts[0] == lora_counts[0] == 0
    assert neuroada_counts[1] == 4 and lora_counts[1] == 8  # a delta per layer; LoRA's A and B


def test_disabling_a_merged_model_unmerges_it_for_good_as_lora_does():
    def case(config):
        model = get_peft_model(tiny_llama(), config())
        model.merge_adapter()
        with model.disable_adapter():
            disabled = outputs(model)
        torch.testing.assert_close(disabled, outputs(tiny_llama()), rtol=1e-5, atol=1e-6)
        return [layer.merged for layer in tuner_layers(model)]

    same(case)


def test_a_conv1d_layer_s_delta_weight_has_the_base_weight_s_layout_as_lora_s():
    def case(config):
        model = get_peft_model(tiny_gpt2(), config(target_modules=["c_attn"]))
        layer = tuner_layers(model)[0]
        return layer.get_delta_weight("default").shape, layer.get_base_layer().weight.shape

    delta_shape, weight_shape = same(case)
    assert delta_shape == weight_shape


def test_unloading_moe_experts_gives_back_the_experts_module_as_lora_does():
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

    def case(config):
        model = get_peft_model(tiny_causal_lm("qwen3_moe"), config(target_modules=[], target_parameters=experts))
        unloaded = model.unload()
        torch.testing.assert_close(outputs(unloaded), outputs(tiny_causal_lm("qwen3_moe")), rtol=0, atol=0)
        return type(unloaded.model.layers[0].mlp.experts)

    same(case)
