"""Properties that hold for any layer shape, dtype, k, coverage and forward path (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_math import PATHS, TOLERANCE, dense_reference, make_layer, positions

layers = st.fixed_dictionaries(
    {
        "d_in": st.integers(1, 40),
        "d_out": st.integers(1, 40),
        "k": st.integers(1, 45),
        "dtype": st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        "path": st.sampled_from(PATHS),
        "conv1d": st.booleans(),
        "neuron_fraction": st.sampled_from([1.0, 0.6, 0.2]),
    }
)
tokens = st.integers(1, 6)


def build(spec: dict):
    spec = {**spec, "k": min(spec["k"], spec["d_in"])}
    return make_layer(**spec)


@settings(max_examples=60, deadline=None)
@given(spec=layers, n_tokens=tokens)
def test_forward_equals_the_dense_merged_weight(spec, n_tokens):
    layer = build(spec)
    x = torch.randn(n_tokens, layer.in_features).to(spec["dtype"])
    reference, _ = dense_reference(layer, x)
    tolerance = TOLERANCE[spec["dtype"]] * 10
    torch.testing.assert_close(layer(x).float(), reference, rtol=tolerance, atol=tolerance)


@settings(max_examples=60, deadline=None)
@given(spec=layers, n_tokens=tokens)
def test_merge_then_unmerge_restores_weights_bit_exactly_and_merged_equals_unmerged(spec, n_tokens):
    layer = build(spec)
    weight_before = layer.get_base_layer().weight.detach().clone()
    x = torch.randn(n_tokens, layer.in_features).to(spec["dtype"])
    unmerged = layer(x)
    layer.merge(safe_merge=True)
    tolerance = TOLERANCE[spec["dtype"]] * 10
    torch.testing.assert_close(layer(x), unmerged, rtol=tolerance, atol=tolerance)
    layer.unmerge()
    assert torch.equal(layer.get_base_layer().weight, weight_before)


@settings(max_examples=60, deadline=None)
@given(spec=layers.map(lambda s: {**s, "dtype": torch.float32}), n_tokens=tokens)
def test_delta_gradient_equals_the_dense_weight_gradient_at_the_placement(spec, n_tokens):
    layer = build(spec)
    x = torch.randn(n_tokens, layer.in_features, requires_grad=True)
    grad_out = torch.randn(n_tokens, layer.out_features)
    layer(x).backward(grad_out)
    reference, merged = dense_reference(layer, x.detach())
    reference.backward(grad_out)
    torch.testing.assert_close(layer.neuroada_delta["default"].grad, merged.grad[positions(layer)])
