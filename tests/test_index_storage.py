"""How layers keep their selected columns: one (n, k) int32 tensor per adapter, saved as held; adapters saved before
2026-12-05 (int16 columns packed in pairs into a flat int32 tensor) load with the columns they were trained on."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.guards import saved_columns
from peft_neuroada.tuner import forward
from tests.conftest import indices_by_layer, logits, tiny_llama


def packed(cols: torch.Tensor) -> torch.Tensor:
    """(n, k) columns in the layout saved before 2026-12-05: int16 pairs in a flat int32 tensor, the first column of a
    pair in the low half, a zero after an odd count."""
    flat = cols.reshape(-1).long()
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return (flat[0::2] | (flat[1::2] << 16)).to(torch.int32)


@pytest.mark.parametrize("shape", [(6, 3), (5, 3), (1, 1), (4, 20)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_saved_columns_are_read_from_an_older_packed_tensor_or_as_n_by_k_columns(shape):
    cols = torch.randint(0, 32768, shape)
    assert torch.equal(saved_columns(packed(cols), shape), cols)
    assert torch.equal(saved_columns(packed(cols).long(), shape), cols)
    assert torch.equal(saved_columns(cols.to(torch.int16), shape), cols)


def test_saved_columns_that_cannot_hold_the_layers_columns_are_refused():
    with pytest.raises(ValueError, match=r"not 8 int32 pairs of columns for \(5, 3\)"):
        saved_columns(torch.zeros(7, dtype=torch.int32), (5, 3))
    with pytest.raises(ValueError, match=r"shape \(5, 2\), not \(5, 3\)"):
        saved_columns(torch.zeros(5, 2, dtype=torch.int16), (5, 3))


@pytest.fixture
def packed_adapter(tmp_path, token_batch):
    """A trained-looking adapter, saved, then rewritten in the packed layout; and its logits."""
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, init_weights=False)).eval()
    model.save_pretrained(tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    tensors = load_file(weights)
    older = {key: packed(t) for key, t in tensors.items() if key.endswith("neuroada_indices")}
    save_file(tensors | older, weights)
    return tmp_path, logits(model, token_batch), indices_by_layer(model)


def test_an_adapter_saved_with_packed_columns_loads_them_as_n_by_k_int32(packed_adapter, token_batch):
    adapter_dir, expected_logits, expected_cols = packed_adapter
    loaded = PeftModel.from_pretrained(tiny_llama(), adapter_dir).eval()
    assert torch.equal(logits(loaded, token_batch), expected_logits)
    cols = indices_by_layer(loaded)
    assert cols.keys() == expected_cols.keys()
    assert all(cols[name].dtype == torch.int32 and torch.equal(cols[name], expected_cols[name]) for name in cols)


def test_transformers_loader_refuses_packed_columns_by_their_shape_and_loads_nothing_wrong(packed_adapter, tmp_path):
    """transformers assigns tensors by name after comparing shapes, without peft's conversion: a packed file is
    refused there, never loaded as other columns (load it with PeftModel, and save it again, to convert it)."""
    adapter_dir, _, _ = packed_adapter
    base_dir = tmp_path / "base"
    tiny_llama().save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with pytest.raises((RuntimeError, ValueError), match=r"(?i)size|shape"):
        model.load_adapter(adapter_dir)


@pytest.mark.parametrize("d_in", [32767, 32768, 32769], ids=lambda d: f"{d}-inputs")
def test_layers_around_the_former_int16_boundary_run_merge_and_reload(d_in, tmp_path):
    """Columns up to d_in - 1 are valid at every width (32,767 at 32,768 inputs was int16's last)."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(d_in, 3))
    with torch.no_grad():
        base[0].weight[:, d_in - 1] = 10.0  # every neuron's largest input is the last column
    model = get_peft_model(base, NeuroAdaConfig(target_modules=["0"], init_weights=False))
    layer = model.base_model.model[0]
    assert int(layer.placement("default").cols.max()) == d_in - 1
    x = torch.randn(2, d_in, requires_grad=True)
    expected = layer.base_layer(x) + x @ layer.get_delta_weight("default").T
    out = model(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert layer.neuroada_delta["default"].grad is not None
    model.save_pretrained(tmp_path)
    model.merge_adapter()
    torch.testing.assert_close(model(x), expected)
    model.unmerge_adapter()
    reloaded = PeftModel.from_pretrained(torch.nn.Sequential(layer.base_layer), tmp_path)
    torch.testing.assert_close(reloaded(x), expected)


def test_products_accept_the_last_column_and_refuse_the_one_past_it():
    d_in = 32768
    x, delta = torch.randn(2, d_in), torch.ones(3, 1)
    last = torch.full((3, 1), d_in - 1, dtype=torch.int32)
    out = forward.bypass_forward(x, last, None, delta, 3)
    torch.testing.assert_close(out, x[:, -1:].expand(2, 3))
    with pytest.raises((IndexError, RuntimeError), match="outside|out of range|out of DATA bounds"):
        forward.bypass_forward(x, last + 1, None, delta, 3)
