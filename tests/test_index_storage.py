"""How layers keep their selected columns: int16 pairs in an int32 buffer, read back as an (n, k) view, and saved as
held."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.tuner import products
from peft_neuroada.tuner.index_storage import from_buffer, index_dtype, to_buffer
from peft_neuroada.tuner.state_checks import saved_columns


@pytest.mark.parametrize("shape", [(6, 3), (5, 3), (1, 1), (4, 20)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_columns_of_a_layer_below_32768_inputs_round_trip_through_half_the_int32_bytes(shape):
    cols = torch.randint(0, 32768, shape, dtype=torch.int32)
    buffer = to_buffer(cols, d_in=32768)
    assert buffer.dtype == torch.int32 and buffer.numel() == (cols.numel() + 1) // 2
    view = from_buffer(buffer, shape)
    assert view.dtype == torch.int16 and view.shape == shape and torch.equal(view, cols)
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_columns_of_a_wider_layer_stay_int32_and_unpacked():
    cols = torch.tensor([[32768, 39999]], dtype=torch.int64)
    buffer = to_buffer(cols, d_in=40000)
    assert buffer.dtype == torch.int32 and buffer.shape == (1, 2)
    assert from_buffer(buffer, (1, 2)) is buffer and torch.equal(buffer, cols)


def test_columns_are_held_as_int16_when_every_column_fits_else_int32():
    assert index_dtype(32768) == torch.int16
    assert index_dtype(32769) == torch.int32


@pytest.mark.parametrize("shape", [(6, 3), (5, 3)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_saved_columns_are_read_from_a_packed_buffer_or_as_n_by_k_columns(shape):
    cols = torch.randint(0, 32768, shape)
    assert torch.equal(saved_columns(to_buffer(cols, d_in=32768), shape), cols)
    assert torch.equal(saved_columns(cols.to(torch.int16), shape), cols)


def test_saved_columns_that_cannot_hold_the_layers_columns_are_refused():
    with pytest.raises(ValueError, match=r"not 8 int32 pairs of columns for \(5, 3\)"):
        saved_columns(torch.zeros(7, dtype=torch.int32), (5, 3))
    with pytest.raises(ValueError, match=r"shape \(5, 2\), not \(5, 3\)"):
        saved_columns(torch.zeros(5, 2, dtype=torch.int16), (5, 3))


@pytest.mark.parametrize("d_in", [32767, 32768, 32769], ids=lambda d: f"{d}-inputs")
def test_layers_at_the_int16_boundary_run_merge_and_reload(d_in, tmp_path):
    """Columns up to d_in - 1 are valid at every width, the packed int16 ones included (32,767 at 32,768 inputs): no
    comparison of a narrow index with a size may wrap."""
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


def test_products_accept_the_last_int16_column_and_refuse_the_one_past_it():
    d_in = 32768
    x, delta = torch.randn(2, d_in), torch.ones(3, 1)
    last = torch.full((3, 1), d_in - 1, dtype=torch.int16)
    out = products.bypass_forward(x, last, None, delta, 3)
    torch.testing.assert_close(out, x[:, -1:].expand(2, 3))
    past = torch.full((3, 1), d_in - 1, dtype=torch.int32) + 1
    with pytest.raises((IndexError, RuntimeError), match="outside|out of range|out of DATA bounds"):
        products.bypass_forward(x, past, None, delta, 3)
