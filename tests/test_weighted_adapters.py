"""Adapter arithmetic: `add_weighted_adapter` makes a NeuroAda adapter whose deltas are Σ w_i · Θ_i, which is exact
when the sources tune the same input connections (one k and selection on one base). Anything it cannot do exactly is
refused with a clear error before the model changes."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn

from peft_neuroada import NeuroAdaConfig, weighted_adapters
from peft_neuroada.train.models import load_default_model
from peft_neuroada.tuner.experts import ParamWrapper
from tests.conftest import (
    logits,
    named_neuroada_layers,
    neuroada_layers,
    tiny_bert,
    tiny_causal_lm,
    tiny_llama,
)


def two_adapters(make_model=tiny_llama, second: dict | None = None, **first):
    """A model with adapters "one" and "two" (small random deltas, magnitude selection unless told otherwise)."""
    torch.manual_seed(0)
    model = get_peft_model(make_model(), NeuroAdaConfig(**{"k": 2, "init_weights": False, **first}), "one")
    model.add_adapter("two", NeuroAdaConfig(**{"k": 2, "init_weights": False, **(second or {})}))
    return model


def dense_reference(model, make_base, weights: dict[str, float]) -> nn.Module:
    """A fresh base model whose adapted weights (layers' and expert stacks') hold base + Σ w · dense delta of each
    adapter."""
    reference = make_base()
    with torch.no_grad():
        for name, layer in named_neuroada_layers(model).items():
            base = reference.get_submodule(name.removeprefix("base_model.model.").replace(".base_layer", ""))
            adapted = getattr(base, layer.parameter_name) if isinstance(layer, ParamWrapper) else base.weight
            for adapter, weight in weights.items():
                if adapter in layer.neuroada_delta:
                    adapted += weight * layer.get_delta_weight(adapter)
    return reference


def adapter_state(model) -> dict:
    """Everything add_weighted_adapter could touch: configs, each layer's adapters, what trains, what is active."""
    return {
        "configs": sorted(model.peft_config),
        "layers": [sorted(layer.neuroada_delta) for layer in neuroada_layers(model)],
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "active": list(model.active_adapters),
    }


TOKENS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))


SAME_PLACEMENTS = {"magnitude": {}, "half-the-neurons": {"neuron_fraction": 0.5}, "random": {"selection": "random"}}


@pytest.mark.parametrize("config", SAME_PLACEMENTS.values(), ids=SAME_PLACEMENTS.keys())
def test_weighted_adapter_equals_the_base_plus_the_weighted_dense_deltas(config):
    model = two_adapters(second=config, **config)
    model.add_weighted_adapter(["one", "two"], [0.5, -2.0], "mix")
    model.set_adapter("mix")
    expected = logits(dense_reference(model, tiny_llama, {"one": 0.5, "two": -2.0}), TOKENS)
    torch.testing.assert_close(logits(model, TOKENS), expected)
    model.merge_adapter()
    torch.testing.assert_close(logits(model, TOKENS), expected)


def test_weighted_adapter_shares_the_sources_indices_and_sums_their_deltas():
    model = two_adapters()
    model.add_weighted_adapter(["one", "two"], [0.5, -2.0], "mix")
    assert model.peft_config["mix"].target_modules == model.peft_config["one"].target_modules
    for layer in neuroada_layers(model):
        assert torch.equal(layer.placement("mix").cols, layer.placement("one").cols)
        expected = 0.5 * layer.neuroada_delta["one"] - 2.0 * layer.neuroada_delta["two"]
        torch.testing.assert_close(layer.neuroada_delta["mix"], expected)


def test_expert_adapters_combine_in_every_layer_and_every_expert_weight():
    model = two_adapters(lambda: tiny_causal_lm("mixtral"))
    experts = [layer for layer in neuroada_layers(model) if isinstance(layer, ParamWrapper)]
    assert experts
    model.add_weighted_adapter(["one", "two"], [0.5, -2.0], "mix")
    assert model.peft_config["mix"].target_parameters == model.peft_config["one"].target_parameters
    for layer in neuroada_layers(model):
        assert torch.equal(layer.placement("mix").cols, layer.placement("one").cols)
        expected = 0.5 * layer.neuroada_delta["one"] - 2.0 * layer.neuroada_delta["two"]
        torch.testing.assert_close(layer.neuroada_delta["mix"], expected)


def deltas_of(model, adapter: str) -> dict[str, torch.Tensor]:
    return {name: layer.neuroada_delta[adapter] for name, layer in named_neuroada_layers(model).items()}


def mixed_both_ways(model, first: str, second: str, weights: tuple[float, float]) -> tuple[dict, dict]:
    """The weighted adapter of `first` and `second` added in one order, then in the other: its deltas each time."""
    model.add_weighted_adapter([first, second], list(weights), "ab")
    model.add_weighted_adapter([second, first], list(weights[::-1]), "ba")
    return deltas_of(model, "ab"), deltas_of(model, "ba")


def test_an_adapter_without_experts_combines_with_an_expert_adapter_in_either_order():
    """The first source naming no expert (`target_parameters=[]`) still gets the other's experts in the sum."""
    model = two_adapters(lambda: tiny_causal_lm("mixtral"), second={"target_parameters": []})
    forward, reverse = mixed_both_ways(model, "two", "one", (-2.0, 0.5))
    assert forward.keys() == reverse.keys() == deltas_of(model, "one").keys()
    assert all(torch.equal(forward[name], reverse[name]) for name in forward)
    assert model.peft_config["ba"].target_parameters == model.peft_config["one"].target_parameters
    tokens = TOKENS % 100  # the MoE models' vocabulary
    expected = logits(dense_reference(model, lambda: tiny_causal_lm("mixtral"), {"one": 0.5, "two": -2.0}), tokens)
    for mix in ("ab", "ba"):
        model.set_adapter(mix)
        torch.testing.assert_close(logits(model, tokens), expected)


def test_sources_of_different_delta_dtypes_combine_in_the_widest_in_either_order():
    model = two_adapters(delta_dtype="bfloat16")
    forward, reverse = mixed_both_ways(model, "one", "two", (0.3, 0.7))
    assert all(torch.equal(forward[name], reverse[name]) for name in forward)
    assert {delta.dtype for delta in forward.values()} == {torch.float32}
    assert model.peft_config["ab"].delta_dtype == model.peft_config["ba"].delta_dtype == "float32"
    for name, layer in named_neuroada_layers(model).items():
        expected = 0.3 * layer.neuroada_delta["one"].float() + 0.7 * layer.neuroada_delta["two"]
        torch.testing.assert_close(forward[name], expected)


def test_on_a_bf16_base_the_float32_sources_combine_in_float32_not_in_the_base_dtype():
    model = two_adapters(lambda: tiny_llama().to(torch.bfloat16))
    model.add_weighted_adapter(["one", "two"], [0.3, -1.3], "mix")
    for layer in neuroada_layers(model):
        one, two = (layer.neuroada_delta[name].detach() for name in ("one", "two"))
        assert one.dtype == two.dtype == layer.neuroada_delta["mix"].dtype == torch.float32
        torch.testing.assert_close(layer.neuroada_delta["mix"].detach(), 0.3 * one - 1.3 * two, rtol=1e-6, atol=1e-7)


def test_smollm2_adapters_on_a_layer_and_on_a_parameter_combine_in_either_order(smollm2):
    torch.manual_seed(0)
    attention = NeuroAdaConfig(k=1, init_weights=False, target_modules=["q_proj"], target_parameters=[])
    model = get_peft_model(smollm2, attention, "attention")
    mlp = NeuroAdaConfig(k=1, init_weights=False, target_modules=[], target_parameters=["mlp.down_proj.weight"])
    model.add_adapter("mlp", mlp)
    forward, reverse = mixed_both_ways(model, "attention", "mlp", (0.7, 0.3))
    assert len(forward) == len(reverse) == 2 * 30
    assert all(torch.equal(forward[name], reverse[name]) for name in forward)
    tokens = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(0))
    model.set_adapter("ab")
    by_forward = logits(model, tokens)
    model.set_adapter("ba")
    assert torch.equal(logits(model, tokens), by_forward)


def test_weight_one_for_both_equals_the_two_adapters_active_together():
    model = two_adapters()
    model.base_model.set_adapter(["one", "two"])
    together = logits(model, TOKENS)
    model.add_weighted_adapter(["one", "two"], [1.0, 1.0], "sum")
    model.set_adapter("sum")
    torch.testing.assert_close(logits(model, TOKENS), together)


@pytest.mark.parametrize(
    "lora_option", [{"combination_type": "svd"}, {"combination_type": "linear"}, {"density": 0.5}], ids=str
)
def test_loras_combination_options_do_not_exist_here(lora_option):
    """NeuroAda adapters combine linearly only: LoRA's svd, cat, ties and dare options work on low-rank factors."""
    model = two_adapters()
    before = adapter_state(model)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        model.add_weighted_adapter(["one", "two"], [1.0, 1.0], "mix", **lora_option)
    assert adapter_state(model) == before


def test_negative_weights_negate_and_cancel():
    model = two_adapters()
    model.add_weighted_adapter(["one"], [-1.0], "negated")
    model.add_weighted_adapter(["one", "one"], [1.0, -1.0], "cancelled")
    for layer in neuroada_layers(model):
        assert torch.equal(layer.get_delta_weight("negated"), -layer.get_delta_weight("one"))
        assert not layer.neuroada_delta["cancelled"].any()


def test_the_new_adapter_starts_inactive_and_frozen_and_trains_once_set():
    model = two_adapters()
    model.add_weighted_adapter(["one", "two"], [0.5, 0.5], "mix")
    assert model.active_adapters == ["one"]
    assert all(not layer.neuroada_delta["mix"].requires_grad for layer in neuroada_layers(model))
    model.set_adapter("mix")
    assert all(layer.neuroada_delta["mix"].requires_grad for layer in neuroada_layers(model))


def test_adapters_on_different_layers_combine_and_the_result_saves_and_reloads(tmp_path):
    """Each layer gets the sources that adapt it; the saved config targets exactly those layers."""
    model = two_adapters(target_modules=["q_proj"], second={"target_modules": ["v_proj", "q_proj"]})
    model.add_weighted_adapter(["one", "two"], [2.0, 0.5], "mix")
    adapted = {name for name, layer in named_neuroada_layers(model).items() if "mix" in layer.neuroada_delta}
    assert {name.rsplit(".", 1)[-1] for name in adapted} == {"q_proj", "v_proj"}
    model.set_adapter("mix")
    expected = logits(dense_reference(model, tiny_llama, {"one": 2.0, "two": 0.5}), TOKENS)
    torch.testing.assert_close(logits(model, TOKENS), expected)
    model.save_pretrained(tmp_path, selected_adapters=["mix"])

    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "mix")
    assert set(named_neuroada_layers(reloaded)) == adapted
    torch.testing.assert_close(logits(reloaded, TOKENS), expected)


def test_weighted_smollm2_adapters_equal_the_dense_reference_and_reload(smollm2, tmp_path):
    """On the real model, k=1 magnitude selection gives two adapters the same indices, so any weights combine."""
    torch.manual_seed(0)
    config = NeuroAdaConfig(k=1, init_weights=False, target_modules=["q_proj", "down_proj"])
    model = get_peft_model(smollm2, config, "one")
    model.add_adapter("two", NeuroAdaConfig(k=1, init_weights=False, target_modules=["q_proj", "down_proj"]))
    model.add_weighted_adapter(["one", "two"], [0.7, 0.3], "mix")
    model.set_adapter("mix")
    tokens = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(0))
    actual = logits(model, tokens)
    expected = logits(dense_reference(model, lambda: load_default_model()[0].eval(), {"one": 0.7, "two": 0.3}), tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    model.save_pretrained(tmp_path, selected_adapters=["mix"])
    reloaded = PeftModel.from_pretrained(load_default_model()[0].eval(), tmp_path / "mix")
    assert torch.equal(logits(reloaded, tokens), actual)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin0 = nn.Linear(10, 20)
        self.lin1 = nn.Linear(20, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin1(self.lin0(x).relu())


def test_a_module_saved_by_one_source_is_copied_into_the_weighted_adapter():
    torch.manual_seed(0)
    model = get_peft_model(MLP(), NeuroAdaConfig(target_modules=["lin0"], modules_to_save=["lin1"]), "one")
    model.add_adapter("two", NeuroAdaConfig(target_modules=["lin0"]))
    head = model.base_model.model.lin1
    with torch.no_grad():  # stands in for training a's copy of the head
        head.modules_to_save["one"].weight.add_(1.0)
    model.add_weighted_adapter(["one", "two"], [0.5, 0.5], "mix")
    assert model.peft_config["mix"].modules_to_save == ["lin1"]
    assert torch.equal(head.modules_to_save["mix"].weight, head.modules_to_save["one"].weight)
    model.set_adapter("mix")
    model(torch.randn(3, 10))


def different_indices() -> tuple:
    return two_adapters(second={"selection": "reverse"}), ["one", "two"], [1.0, 1.0], "mix", {}


def different_k() -> tuple:
    return two_adapters(second={"k": 3}), ["one", "two"], [1.0, 1.0], "mix", {}


def unknown_adapter() -> tuple:
    return two_adapters(), ["one", "nope"], [1.0, 1.0], "mix", {}


def too_few_weights() -> tuple:
    return two_adapters(), ["one", "two"], [1.0], "mix", {}


def no_adapters() -> tuple:
    return two_adapters(), [], [], "mix", {}


def nan_weight() -> tuple:
    return two_adapters(), ["one", "two"], [float("nan"), 1.0], "mix", {}


def existing_name() -> tuple:
    return two_adapters(), ["one", "two"], [1.0, 1.0], "two", {}


def source_trains_biases() -> tuple:
    return two_adapters(tiny_bert, bias="all"), ["one", "two"], [1.0, 1.0], "mix", {}


def both_save_the_same_module() -> tuple:
    torch.manual_seed(0)
    model = get_peft_model(MLP(), NeuroAdaConfig(target_modules=["lin0"], modules_to_save=["lin1"]), "one")
    model.add_adapter("two", NeuroAdaConfig(target_modules=["lin0"], modules_to_save=["lin1"]))
    return model, ["one", "two"], [1.0, 1.0], "mix", {}


def one_as_a_layer_one_as_its_parameter(order: list[str]) -> tuple:
    """'one' adapts q_proj's weight as a parameter, 'two' q_proj as a layer (around 'one''s wrapper)."""
    torch.manual_seed(0)
    weight = NeuroAdaConfig(k=2, target_modules=[], target_parameters=["self_attn.q_proj.weight"])
    model = get_peft_model(tiny_llama(), weight, "one")
    model.add_adapter("two", NeuroAdaConfig(k=2, target_modules=["q_proj"], target_parameters=[]))
    return model, order, [1.0, 1.0], "mix", {}


A_LAYER_AND_ITS_PARAMETER = (
    r"at 'model\.layers\.0\.self_attn\.q_proj': adapter 'two' adapts it as a layer \(target_modules\) and adapter "
    r"'one' its parameter 'weight'"
)


REFUSALS = {
    "different-indices": (
        different_indices,
        r"at layer 'model\.layers\.0\.self_attn\.q_proj': adapters 'one' and 'two' tune different",
    ),
    "different-k": (different_k, r"different k or neuron_fraction \('one': k=2, neuron_fraction=1\.0, 'two': k=3"),
    "unknown-adapter": (unknown_adapter, "Adapter nope does not exist"),
    "too-few-weights": (too_few_weights, r"one weight per adapter \(got 2 adapters and 1 weights\)"),
    "no-adapters": (no_adapters, r"needs at least one adapter to combine \(got none\)"),
    "nan-weight": (nan_weight, r"needs finite weights \(got \[nan, 1\.0\]\)"),
    "existing-name": (existing_name, "Adapter with name 'two' already exists"),
    "source-trains-biases": (source_trains_biases, "Cannot weight adapter 'one': it trains biases"),
    "a-layer-and-its-parameter": (
        lambda: one_as_a_layer_one_as_its_parameter(["two", "one"]),
        A_LAYER_AND_ITS_PARAMETER,
    ),
    "a-parameter-and-its-layer": (
        lambda: one_as_a_layer_one_as_its_parameter(["one", "two"]),
        A_LAYER_AND_ITS_PARAMETER,
    ),
    "same-module-saved-twice": (
        both_save_the_same_module,
        r"Cannot add weighted adapters if they target the same module with modules_to_save, but found 1 such",
    ),
}


@pytest.mark.parametrize(("make_case", "message"), REFUSALS.values(), ids=REFUSALS.keys())
def test_a_combination_that_cannot_be_exact_is_refused_before_anything_changes(make_case, message):
    model, adapters, weights, name, kwargs = make_case()
    before = adapter_state(model)
    with pytest.raises(ValueError, match=message):
        model.add_weighted_adapter(adapters, weights, name, **kwargs)
    assert adapter_state(model) == before


def test_a_failure_while_filling_the_new_adapter_removes_it_again(monkeypatch):
    model = two_adapters()
    before = adapter_state(model)
    calls = []

    def fail_on_third_layer(layer, *args):
        calls.append(layer)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        original(layer, *args)

    original = weighted_adapters.set_weighted_sum
    monkeypatch.setattr(weighted_adapters, "set_weighted_sum", fail_on_third_layer)
    with pytest.raises(RuntimeError, match="injected failure"):
        model.add_weighted_adapter(["one", "two"], [1.0, 1.0], "mix")
    assert adapter_state(model) == before
