"""Index buffers are checked whenever they can change, not only when an adapter loads: a state dict copied in
(accelerate, DeepSpeed and FSDP resumes call `load_state_dict`), a write into a buffer, a conversion of the whole
model. Each either keeps working exactly or is refused with a message that says what happened, before a kernel or a
merge reads a wrong index."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_neuroada import NeuroAdaConfig
from tests.conftest import logits, named_neuroada_layers, tiny_llama

LAYER = "base_model.model.model.layers.0.self_attn.q_proj"


def two_adapter_bf16_model():
    """The adversarial round's case: a bf16 model with two active adapters (the torch gather/scatter path)."""
    model = get_peft_model(tiny_llama().to(torch.bfloat16), NeuroAdaConfig(k=2, init_weights=False))
    model.add_adapter("other", NeuroAdaConfig(k=2, init_weights=False))
    model.base_model.set_adapter(["default", "other"])
    return model


def with_columns(model, adapter: str, change) -> dict[str, torch.Tensor]:
    """The model's state dict with `change(cols)` applied to one layer's (n, k) columns of `adapter`."""
    state = {key: value.clone() for key, value in model.state_dict().items()}
    layer = named_neuroada_layers(model)[LAYER]
    cols = layer.placement(adapter).cols.clone()
    change(cols)
    state[f"{LAYER}.neuroada_indices.{adapter}"] = cols
    return state


def outside_the_layer(cols: torch.Tensor) -> None:
    cols[0, 0] = 32  # the tiny Llama's layers have 32 inputs


INVALID_COLUMNS = {
    "outside-the-layer": (outside_the_layer, r"range over \[0, 32\] but the layer has only 32"),
    "twice-in-a-row": (lambda cols: cols[:, 1].copy_(cols[:, 0]), "a column twice within a neuron's row"),
}


@pytest.mark.parametrize("case", INVALID_COLUMNS, ids=list(INVALID_COLUMNS))
def test_load_state_dict_with_invalid_columns_is_refused_before_anything_loads(case, token_batch):
    change, message = INVALID_COLUMNS[case]
    model = two_adapter_bf16_model()
    before = copy.deepcopy(model.state_dict())
    expected = logits(model, token_batch)
    damaged = with_columns(model, "other", change)
    damaged[f"{LAYER}.neuroada_delta.default"] += 1  # would load first, before the damaged buffer, without the check
    with pytest.raises(ValueError, match=f"Refusing to load adapter 'other' at layer '{LAYER}': .*{message}.*Nothing"):
        model.load_state_dict(damaged)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    torch.testing.assert_close(logits(model, token_batch), expected, rtol=0, atol=0)


@pytest.mark.parametrize("case", INVALID_COLUMNS, ids=list(INVALID_COLUMNS))
def test_columns_written_in_place_are_checked_before_the_next_forward_or_merge(case, token_batch):
    change, message = INVALID_COLUMNS[case]
    model = two_adapter_bf16_model()
    logits(model, token_batch)  # the placements are made and kept
    layer = named_neuroada_layers(model)[LAYER]
    weight = layer.get_base_layer().weight.detach().clone()
    with torch.no_grad():
        change(layer.placement("other").cols)  # a view of the buffer: what a copy_ into it does
    what = f"adapter 'other' .*'{layer.layer_name}': its neuroada_indices .*{message}"
    with pytest.raises(ValueError, match=f"{what}.*changed after"):
        logits(model, token_batch)
    with pytest.raises(ValueError, match=f"{what}.*Nothing was written"):
        model.merge_adapter(["default", "other"])
    assert torch.equal(layer.get_base_layer().weight, weight) and not layer.merged


def test_valid_columns_loaded_by_load_state_dict_are_served(token_batch):
    """The other half of the same rule: a resume that copies another valid selection in is followed exactly."""
    source = two_adapter_bf16_model()
    target = two_adapter_bf16_model()
    moved = with_columns(source, "other", lambda cols: cols.copy_((cols + 1) % 32))
    source.load_state_dict(moved)
    logits(target, token_batch)  # target's placements are made before its buffers change
    target.load_state_dict(moved)
    torch.testing.assert_close(logits(target, token_batch), logits(source, token_batch), rtol=0, atol=0)


def test_buffers_loaded_under_inference_mode_are_still_checked_when_written(tmp_path, token_batch):
    get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False)).save_pretrained(tmp_path)
    with torch.inference_mode():
        model = PeftModel.from_pretrained(tiny_llama(), tmp_path)
        model(token_batch)
        layer = named_neuroada_layers(model)[LAYER]
        layer.placement("default").cols[0, 0] = 32
        with pytest.raises(ValueError, match="range over \\[0, 32\\]"):
            model(token_batch)


def float64_by_type(model):
    return model.type(torch.float64)


def float16_by_apply(model):
    return model._apply(lambda tensor: tensor.half())


def pickled(model):
    return pickle.loads(pickle.dumps(model))


# Conversions a user or a library applies to a whole model, and whether the indices survive them.
KEPT = {
    "to-bfloat16": lambda model: model.to(torch.bfloat16),
    "half": lambda model: model.half(),
    "double": lambda model: model.double(),
    "deepcopy": copy.deepcopy,
    "pickle": pickled,
    "share_memory": lambda model: model.share_memory(),
}
DESTROYED = {"type-float64": float64_by_type, "apply-half-to-every-tensor": float16_by_apply}


@pytest.mark.parametrize("convert", KEPT.values(), ids=list(KEPT))
def test_whole_model_conversions_that_keep_integer_tensors_keep_the_adapter_exact(convert, token_batch):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    columns = {name: layer.placement("default").cols.clone() for name, layer in named_neuroada_layers(model).items()}
    merged = convert(copy.deepcopy(model).merge_and_unload())
    converted = convert(model)
    for name, layer in named_neuroada_layers(converted).items():
        assert torch.equal(layer.placement("default").cols, columns[name]), name
    tolerance = {"rtol": 0.02, "atol": 0.02} if merged.dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(logits(converted, token_batch), logits(merged, token_batch), **tolerance)


@pytest.mark.parametrize("convert", DESTROYED.values(), ids=list(DESTROYED))
def test_conversions_of_every_tensor_that_cast_the_index_buffers_are_refused_saying_so(convert, token_batch):
    model = convert(get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False)))
    with pytest.raises(ValueError, match="neuroada_indices is a torch.float.* tensor.*conversion of every tensor"):
        model(token_batch)


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "torch-save"])
@pytest.mark.parametrize("convert", DESTROYED.values(), ids=list(DESTROYED))
def test_saving_cast_index_buffers_is_refused_before_the_folder_changes(convert, safe_serialization, tmp_path):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    model.save_pretrained(tmp_path, safe_serialization=safe_serialization)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="Refusing to save NeuroAda adapter 'default': .*indices.* is a torch.float"):
        convert(model).save_pretrained(tmp_path, safe_serialization=safe_serialization)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
