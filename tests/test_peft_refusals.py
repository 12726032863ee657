"""What peft itself refuses for NeuroAda adapters, with peft's exact error, and what to do instead.

peft's hotswapping (`peft.utils.hotswap`) and `PeftMixedModel` accept only the method types listed inside peft, so
NeuroAda cannot join them from outside. Swapping an adapter's values in place does what hotswapping is for, and
merging NeuroAda first lets another method train on top.
"""

from __future__ import annotations

import re

import pytest
import torch
from peft import LoraConfig, PeftMixedModel, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.utils import load_peft_weights
from peft.utils.hotswap import hotswap_adapter, prepare_model_for_compiled_hotswap

from peft_neuroada import NeuroAdaConfig
from tests.conftest import logits, named_neuroada_layers, neuroada_layers, tiny_llama

TOKENS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
MIXED_REFUSAL = re.escape("The provided `peft_type` 'NEUROADA' is not compatible with the `PeftMixedModel`.")


@pytest.fixture
def two_saved_adapters(tmp_path):
    """Two saved k=2 adapters for tiny_llama with different deltas and different indices (magnitude, random)."""
    paths = []
    for seed, selection in [(1, "magnitude"), (2, "random")]:
        torch.manual_seed(seed)
        config = NeuroAdaConfig(k=2, init_weights=False, selection=selection)
        get_peft_model(tiny_llama(), config).save_pretrained(tmp_path / selection)
        paths.append(tmp_path / selection)
    return paths


def test_peft_hotswap_refuses_neuroada_adapters(two_saved_adapters):
    first, second = two_saved_adapters
    model = PeftModel.from_pretrained(tiny_llama(), first)
    with pytest.raises(ValueError, match="Hotswapping only supports LORA but NEUROADA was passed."):
        hotswap_adapter(model, str(second), adapter_name="default", torch_device="cpu")
    with pytest.raises(ValueError, match="No adapter layers found on the model"):
        prepare_model_for_compiled_hotswap(model)


def test_loading_new_values_into_an_adapter_swaps_it_in_place_without_recompiling(two_saved_adapters):
    """What hotswapping does for LoRA: same adapter name and tensors, new values (and indices), no recompilation."""
    first, second = two_saved_adapters
    expected = logits(PeftModel.from_pretrained(tiny_llama(), second), TOKENS)
    model = PeftModel.from_pretrained(tiny_llama(), first)
    tensors = [id(layer.neuroada_delta["default"]) for layer in neuroada_layers(model)]
    compiled = torch.compile(model, backend="eager")
    before = logits(compiled, TOKENS)
    with torch._dynamo.config.patch(error_on_recompile=True):
        set_peft_model_state_dict(model, load_peft_weights(str(second)), adapter_name="default")
        after = logits(compiled, TOKENS)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, expected)
    assert [id(layer.neuroada_delta["default"]) for layer in neuroada_layers(model)] == tensors


def test_swapping_in_an_adapter_that_does_not_fit_is_refused_naming_the_layer(two_saved_adapters, tmp_path):
    get_peft_model(tiny_llama(), NeuroAdaConfig(k=3)).save_pretrained(tmp_path / "k3")
    model = PeftModel.from_pretrained(tiny_llama(), two_saved_adapters[0])
    before = logits(model, TOKENS)
    with pytest.raises(ValueError, match="tensors do not match its config at layer 'base_model.model.model.layers.0"):
        set_peft_model_state_dict(model, load_peft_weights(str(tmp_path / "k3")), adapter_name="default")
    assert torch.equal(logits(model, TOKENS), before)


def test_new_deltas_alone_for_a_merged_adapter_are_refused_before_anything_loads(two_saved_adapters):
    """Loaded while merged without the base weights, they would leave the merged weights serving the old adapter
    (and, with new indices, an unmerge that used them would restore the wrong entries): both ways of loading refuse,
    and nothing changes."""
    first, second = two_saved_adapters
    other = PeftModel.from_pretrained(tiny_llama(), second).state_dict()
    adapter_only = {key: value for key, value in other.items() if ".neuroada_" in key}
    model = PeftModel.from_pretrained(tiny_llama(), first)
    model.merge_adapter()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    loads = [
        lambda: set_peft_model_state_dict(model, load_peft_weights(str(second)), adapter_name="default"),
        lambda: model.load_state_dict(adapter_only, strict=False),
    ]
    for load in loads:
        with pytest.raises(ValueError, match=r"Cannot load new values into adapter 'default' .* it is merged"):
            load()
        assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())
    model.unmerge_adapter()
    with model.disable_adapter():
        assert torch.equal(logits(model, TOKENS), logits(tiny_llama(), TOKENS))


def full_state_loaded_while_merged(config) -> tuple[PeftModel, dict[str, torch.Tensor]]:
    """A model with `config`'s adapter, merged, into which a full state dict of other values (base weights included)
    was loaded, as peft's test_merge_layers_load_state_dict loads one; and that state dict."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), config)
    generator = torch.Generator().manual_seed(1)
    state = {
        key: value.clone() if not value.is_floating_point() else torch.randn(value.shape, generator=generator)
        for key, value in model.state_dict().items()
    }
    model.merge_adapter()
    model.load_state_dict(state)
    return model, state


@pytest.mark.parametrize(
    "config",
    [
        NeuroAdaConfig(k=2, init_weights=False),
        LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ],
    ids=["neuroada", "lora"],
)
def test_a_full_state_dict_loads_into_a_merged_model_as_given_and_unmerges_by_subtracting_its_deltas(config):
    """A merged model's full state (base weights included) loads as given and reads back; unmerging then subtracts
    the loaded adapter from the loaded weight, as LoRA's does: no mix of the loaded weight and the old entries."""
    model, state = full_state_loaded_while_merged(config)
    loaded = model.state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[key], value) for key, value in state.items())
    model.unmerge_adapter()
    for name, layer in model.named_modules():
        if hasattr(layer, "get_delta_weight") and hasattr(layer, "base_layer"):
            weight = layer.get_base_layer().weight
            expected = state[f"{name}.base_layer.weight"] - layer.get_delta_weight("default")
            torch.testing.assert_close(weight, expected, rtol=0, atol=1e-6)


def test_a_full_state_dict_may_repeat_a_column_of_a_merged_adapter_which_a_merge_then_refuses():
    """peft's test loads ones everywhere, indices included: unmerging subtracts each delta of a repeated column, and
    a later merge refuses the repeats before writing anything."""
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    name, layer = next(iter(named_neuroada_layers(model).items()))
    state = {key: value.clone() for key, value in model.state_dict().items()}
    state[f"{name}.neuroada_indices.default"].fill_(1)
    model.merge_adapter()
    model.load_state_dict(state)
    model.unmerge_adapter()
    weight, given = layer.get_base_layer().weight.detach().clone(), state[f"{name}.base_layer.weight"]
    torch.testing.assert_close(weight[:, 1], given[:, 1] - layer.neuroada_delta["default"].detach().sum(1))
    assert torch.equal(weight[:, 2:], given[:, 2:]) and torch.equal(weight[:, 0], given[:, 0])
    with pytest.raises(ValueError, match="name a column twice within a neuron's row.*Nothing was written"):
        model.merge_adapter()
    assert torch.equal(layer.get_base_layer().weight, weight)


def test_a_merged_adapter_may_be_loaded_again_with_its_own_values(two_saved_adapters):
    model = PeftModel.from_pretrained(tiny_llama(), two_saved_adapters[0])
    model.merge_adapter()
    merged = logits(model, TOKENS)
    set_peft_model_state_dict(model, load_peft_weights(str(two_saved_adapters[0])), adapter_name="default")
    model.load_state_dict(model.state_dict())
    assert torch.equal(logits(model, TOKENS), merged)


def test_unmerge_restores_the_entries_the_merge_changed_even_after_the_indices_are_overwritten(two_saved_adapters):
    first, second = two_saved_adapters
    other = [
        layer.neuroada_indices["default"] for layer in neuroada_layers(PeftModel.from_pretrained(tiny_llama(), second))
    ]
    model = PeftModel.from_pretrained(tiny_llama(), first)
    model.merge_adapter()
    for layer, indices in zip(neuroada_layers(model), other, strict=True):
        layer.neuroada_indices["default"].copy_(indices)
    model.unmerge_adapter()
    with model.disable_adapter():
        assert torch.equal(logits(model, TOKENS), logits(tiny_llama(), TOKENS))


def test_peft_mixed_model_refuses_neuroada_adapters(two_saved_adapters):
    with pytest.raises(ValueError, match=MIXED_REFUSAL):
        get_peft_model(tiny_llama(), NeuroAdaConfig(k=2), mixed=True)
    with pytest.raises(ValueError, match="Adapter of type PeftType.NEUROADA is not supported for mixed models"):
        PeftMixedModel.from_pretrained(tiny_llama(), two_saved_adapters[0])
    mixed = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"]), mixed=True)
    with pytest.raises(ValueError, match=MIXED_REFUSAL):
        mixed.add_adapter("neuroada", NeuroAdaConfig(k=2))


def test_instead_of_mixing_merge_neuroada_then_add_another_method(two_saved_adapters):
    neuroada = PeftModel.from_pretrained(tiny_llama(), two_saved_adapters[0])
    expected = logits(neuroada, TOKENS)
    merged = neuroada.merge_and_unload()
    with_lora = get_peft_model(merged, LoraConfig(target_modules=["q_proj", "v_proj"]))
    torch.testing.assert_close(logits(with_lora, TOKENS), expected)
    assert any("lora_" in name for name, p in with_lora.named_parameters() if p.requires_grad)


def test_trainable_token_indices_is_loras_alone_and_the_embedding_trains_through_modules_to_save():
    with pytest.raises(TypeError, match="trainable_token_indices"):
        NeuroAdaConfig(k=2, trainable_token_indices=[3, 5])
    config = NeuroAdaConfig(k=2)
    assert config.trainable_token_indices is None  # what tools reading it on any peft config find
    with pytest.raises(ValueError, match="modules_to_save"):
        config.trainable_token_indices = {"embed_tokens": [3, 5]}  # what TRL does when a chat template adds tokens
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, modules_to_save=["embed_tokens"]))
    embedding = model.base_model.model.model.embed_tokens.modules_to_save["default"].weight
    before = embedding.detach().clone()
    model.train()
    model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
    assert not torch.equal(embedding, before)
    trained = logits(model.eval(), TOKENS)
    torch.testing.assert_close(logits(model.merge_and_unload(), TOKENS), trained)
