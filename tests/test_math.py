"""The sparse bypass computes exactly `W x + b + (P ⊙ Θ) x`, with gradients only for Θ, on every path and dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from peft_neuroada import Linear, NeuroAdaConfig
from peft_neuroada.gradient_selection import reselect
from peft_neuroada.merged_copy import copy_refusal

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-3}
# The two paths of `adapted_linear`: one matmul on a merged copy of the weight; the base layer's own forward (which a
# forward hook on it forces) plus the sparse bypass.
PATHS = ("copy", "bypass")


def make_layer(
    k=3, dtype=torch.float32, path="copy", conv1d=False, device="cpu", d_in=24, d_out=16, neuron_fraction=1.0
) -> Linear:
    torch.manual_seed(0)
    base = Conv1D(d_out, d_in) if conv1d else nn.Linear(d_in, d_out)
    nn.init.normal_(base.weight)
    nn.init.normal_(base.bias)
    base = base.to(device=device, dtype=dtype).requires_grad_(False)
    if path == "bypass":
        base.register_forward_hook(lambda module, args, out: out)
    config = NeuroAdaConfig(k=k, init_weights=False, neuron_fraction=neuron_fraction)
    return Linear(base, "default", config, fan_in_fan_out=conv1d)


def positions(layer: Linear, adapter: str = "default") -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) index pair addressing the tuned entries of a (d_out, d_in) matrix."""
    cols = layer.placement(adapter).cols.long()
    if adapter in layer.neuroada_rows:
        return layer.neuroada_rows[adapter].long()[:, None], cols
    return torch.arange(layer.out_features, device=cols.device)[:, None], cols


def dense_delta(layer: Linear, adapter: str = "default") -> torch.Tensor:
    """Θ placed into a (d_out, d_in) float32 matrix: the reference the tests compare against."""
    delta = layer.neuroada_delta[adapter]
    dense = torch.zeros(layer.out_features, layer.in_features, device=delta.device)
    dense[positions(layer, adapter)] = delta.detach().float()
    return dense


def dense_reference(layer: Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output of an ordinary float32 linear layer with weight W + scatter(Θ), and that weight as a leaf tensor."""
    merged = (layer.weight_out_in().detach().float() + dense_delta(layer)).requires_grad_(True)
    return torch.nn.functional.linear(x.float(), merged, layer.get_base_layer().bias.float()), merged


def inputs(layer: Linear, tokens: int = 5) -> torch.Tensor:
    torch.manual_seed(1)
    weight = layer.get_base_layer().weight
    return torch.randn(2, tokens, layer.in_features, device=weight.device, dtype=weight.dtype, requires_grad=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("neuron_fraction", [1.0, 0.5], ids=["all-neurons", "half-neurons"])
@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_matches_dense_reference(dtype, path, conv1d, neuron_fraction, device):
    layer = make_layer(dtype=dtype, path=path, conv1d=conv1d, device=device, neuron_fraction=neuron_fraction)
    x = inputs(layer)
    reference, _ = dense_reference(layer, x)
    torch.testing.assert_close(layer(x).float(), reference, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("neuron_fraction", [1.0, 0.5], ids=["all-neurons", "half-neurons"])
@pytest.mark.parametrize("k", [1, 5, 24], ids=["k1", "k5-sampled-matmul", "k-all"])
@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("path", PATHS)
def test_delta_gradient_is_dense_weight_gradient_at_selected_positions(path, conv1d, k, neuron_fraction, device):
    layer = make_layer(k=k, path=path, conv1d=conv1d, device=device, neuron_fraction=neuron_fraction)
    x = inputs(layer)
    grad_out = torch.randn(2, 5, layer.out_features, device=device)
    layer(x).backward(grad_out)
    x_ref = x.detach().clone().requires_grad_(True)
    reference, merged = dense_reference(layer, x_ref)
    reference.backward(grad_out)
    torch.testing.assert_close(layer.neuroada_delta["default"].grad, merged.grad[positions(layer)])
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert layer.get_base_layer().weight.grad is None


@pytest.mark.parametrize("k", [1, 5], ids=["k1-column-loop", "k5-sampled-matmul"])
@pytest.mark.parametrize("tokens", [1, 40], ids=["decoding", "batch"])
@pytest.mark.parametrize("path", PATHS)
def test_a_float64_layer_computes_its_output_and_delta_gradient_in_float64(path, tokens, k):
    layer = make_layer(k=k, dtype=torch.float64, path=path)
    x = inputs(layer, tokens)
    merged = (layer.weight_out_in().detach() + layer.get_delta_weight("default")).requires_grad_(True)
    reference = torch.nn.functional.linear(x, merged, layer.get_base_layer().bias)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference.detach(), rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(reference)
    layer(x).backward(grad_out)
    reference.backward(grad_out)
    delta = layer.neuroada_delta["default"]
    assert delta.dtype == torch.float64
    torch.testing.assert_close(delta.grad, merged.grad[positions(layer)], rtol=1e-12, atol=1e-12)


def replace_weight(layer: Linear) -> None:
    base = layer.get_base_layer()
    base.weight = nn.Parameter(torch.randn_like(base.weight), requires_grad=False)


def give_weight_new_data(layer: Linear) -> None:
    weight = layer.get_base_layer().weight
    weight.data = torch.randn_like(weight)


def share_weight(layer: Linear) -> None:
    layer.weight_shared_with = ("lm_head",)


# What the layer is told or given between two calls: the copy path reads the weight, never writes it, so a weight
# shared with other modules takes it too.
CHANGES = {
    "replaced-weight": replace_weight,
    "weight-with-new-data": give_weight_new_data,
    "weight-now-shared": share_weight,
}


@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_each_call_computes_with_the_base_weight_the_layer_holds_at_that_call(change, conv1d):
    layer = make_layer(conv1d=conv1d)
    x = inputs(layer).detach()
    layer(x)
    change(layer)
    torch.testing.assert_close(layer(x), dense_reference(layer, x)[0])
    assert copy_refusal(layer.get_base_layer(), layer.weight_out_in(), x) is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("neuron_fraction", [1.0, 0.5], ids=["all-neurons", "half-neurons"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unmerged_output_equals_merged_output(dtype, path, neuron_fraction, device):
    layer = make_layer(dtype=dtype, path=path, neuron_fraction=neuron_fraction, device=device)
    x = inputs(layer).detach()
    unmerged = layer(x)
    layer.merge()
    merged = layer(x)
    if path == "copy":
        assert torch.equal(unmerged, merged), "the copy path runs the very matmul a merged layer runs"
    torch.testing.assert_close(unmerged, merged, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


# Two adapters on the same entries of a narrow weight, each path against the merged layer, where each adapter is
# rounded into the weight after the other. Decoding: weight 1 + one step, deltas half a step each, which tie and
# round to even (merged 1 + 2 steps, where rounding each against the original weight gives 1 + 3), read by one-hot
# inputs. A hook on the base layer: weights +-1.5 that cancel over an input of ones, deltas 0.45 of a step each, which
# a merge rounds away (output 0, where adding them beside the matmul gives 7.2 steps).
ROUNDING_CASES = {
    "decoding": (False, False, 0.5),
    "hooked-base": (True, False, 0.45),
    "hooked-base-training": (True, True, 0.45),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ROUNDING_CASES, ids=ROUNDING_CASES.keys())
def test_every_path_rounds_overlapping_deltas_into_a_narrow_weight_as_a_merge_does(dtype, case):
    hooked, training, share = ROUNDING_CASES[case]
    base = nn.Linear(8, 8, bias=False).to(dtype).requires_grad_(False)
    step = torch.finfo(dtype).eps
    with torch.no_grad():
        base.weight.copy_(torch.tensor([1.5, -1.5]).repeat(8, 4) if hooked else torch.full((8, 8), 1 + step))
    layer = Linear(base, "one", NeuroAdaConfig(k=8, delta_dtype="float32"))
    layer.update_layer("two", NeuroAdaConfig(k=8, delta_dtype="float32"))
    layer.set_adapter(["one", "two"])
    for delta in layer.neuroada_delta.values():
        nn.init.constant_(delta, share * step)
    if hooked:
        base.register_forward_hook(lambda module, args, out: out)
    x = torch.ones(8, 8, dtype=dtype) if hooked else torch.eye(8, dtype=dtype)  # 8 tokens: the decoding bypass
    with torch.set_grad_enabled(training):
        unmerged = layer(x)
    if training:  # the gradient passes through the rounding, as through the merged copy: the dense one, x summed
        unmerged.sum().backward()
        assert all(torch.equal(delta.grad, torch.full_like(delta, 8)) for delta in layer.neuroada_delta.values())
    layer.merge()
    assert torch.equal(unmerged, layer(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_training_step_leaves_frozen_weight_bit_identical(dtype, device):
    layer = make_layer(dtype=dtype, device=device)
    original = layer.get_base_layer().weight.detach().clone()
    layer(inputs(layer)).sum().backward()
    assert torch.equal(layer.get_base_layer().weight, original)


def saved_for_backward(run) -> list[torch.Tensor]:
    """Every tensor autograd saves while `run()` builds the graph."""
    saved: list[torch.Tensor] = []

    def keep(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        run()
    return saved


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("path", PATHS)
def test_backward_keeps_nothing_weight_sized(path):
    """Backward keeps the layer input (or some of its columns), Θ, the indices and at most a reference to the frozen
    weight: no copy of it, no dense delta, no mask."""
    layer = make_layer(k=2, path=path, d_in=64, d_out=48)
    x = inputs(layer, tokens=3)
    saved = saved_for_backward(lambda: layer(x))
    weight = layer.get_base_layer().weight
    weight_sized = layer.in_features * layer.out_features
    adapter_tensors = (x, weight, layer.neuroada_delta["default"], layer.neuroada_indices["default"])
    assert saved and all(
        t.numel() < weight_sized or t.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        for t in saved
    )
    assert all(t.shape[:-1] == (6,) for t in saved if t.untyped_storage().data_ptr() not in storages(adapter_tensors))


def kept_per_token(layer: Linear, x: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes of what autograd keeps for one layer visit with a row per token of `x`."""
    tokens = x.shape[:-1].numel()
    return [tuple(t.shape) for t in saved_for_backward(lambda: layer(x)) if t.shape[:-1].numel() == tokens]


@pytest.mark.parametrize("path", PATHS)
def test_backward_keeps_only_the_input_columns_the_deltas_read(path):
    layer = make_layer(k=1, d_in=64, d_out=8, path=path)
    used = layer.placement("default").cols.unique().numel()
    assert kept_per_token(layer, inputs(layer, tokens=3)) == [(6, used)] and used <= 8


@pytest.mark.parametrize("path", PATHS)
def test_backward_keeps_nothing_of_the_input_for_frozen_deltas(path):
    layer = make_layer(k=1, d_in=64, d_out=8, path=path)
    layer.neuroada_delta["default"].requires_grad_(False)
    assert kept_per_token(layer, inputs(layer, tokens=3)) == []


@pytest.mark.parametrize("change", ["in-place", "new-buffer"])
def test_the_delta_gradient_follows_indices_changed_between_steps(change):
    """Backward keeps the columns the deltas read from step to step; changed indices must never reuse stale ones."""
    layer = make_layer(k=1, d_in=64, d_out=8)
    grad_out = torch.randn(2, 3, layer.out_features)
    layer(inputs(layer, tokens=3)).backward(grad_out)
    moved = (layer.placement("default").cols.long() + 1) % layer.in_features
    if change == "in-place":
        layer.placement("default").cols.copy_(moved)
    else:
        reselect(layer, "default", moved)
        layer.neuroada_delta["default"].data.normal_()
    layer.neuroada_delta["default"].grad = None
    x = inputs(layer, tokens=3)
    layer(x).backward(grad_out)
    reference, merged = dense_reference(layer, x.detach())
    reference.backward(grad_out)
    assert torch.equal(layer.placement("default").cols.long(), moved)
    torch.testing.assert_close(layer.neuroada_delta["default"].grad, merged.grad[positions(layer)])


def test_a_frozen_adapter_on_the_copy_path_keeps_no_input_for_backward():
    layer = make_layer(k=1).requires_grad_(False)
    x = inputs(layer)
    saved = saved_for_backward(lambda: layer(x))
    assert storages([x]).isdisjoint(storages(saved))
    layer(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("path", PATHS)
def test_under_bf16_autocast_a_delta_below_a_bf16_step_of_its_weight_still_counts(path):
    # W = [1, 0.5] and x = [1, -2]: the base output is 0, the delta (0.001, under half of bf16's 2^-7 step at 1.0)
    # sits on the largest |w|. The additive formula gives 0.001; added into the weight before a bf16 matmul, 0.
    base = nn.Linear(2, 1, bias=False).requires_grad_(False)
    base.weight.copy_(torch.tensor([[1.0, 0.5]]))
    if path == "bypass":
        base.register_forward_hook(lambda module, args, out: out)
    layer = Linear(base, "default", NeuroAdaConfig(k=1))
    with torch.no_grad():
        layer.neuroada_delta["default"].fill_(1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.tensor([[1.0, -2.0]]))
    torch.testing.assert_close(out.float(), torch.tensor([[1e-3]]), rtol=1e-2, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_cpu_autocast_bfloat16_trains_float32_deltas(path):
    layer = make_layer(path=path)
    x = inputs(layer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    delta = layer.neuroada_delta["default"]
    assert delta.grad is not None and delta.grad.dtype == torch.float32
    reference, merged = dense_reference(layer, x.detach())
    reference.sum().backward()
    expected = merged.grad[positions(layer)]
    torch.testing.assert_close(delta.grad, expected, rtol=5e-2, atol=5e-2)


def test_overlapping_adapters_unmerge_restores_weight_bit_exactly():
    layer = make_layer(k=4, conv1d=True)
    layer.update_layer("other", NeuroAdaConfig(k=4, init_weights=False, neuron_fraction=0.5))
    original = layer.get_base_layer().weight.detach().clone()
    for _ in range(3):
        layer.merge(adapter_names=["default", "other"])
        assert not torch.equal(layer.get_base_layer().weight, original)
        layer.unmerge()
        assert torch.equal(layer.get_base_layer().weight, original)


@pytest.mark.parametrize("path", PATHS)
def test_inference_mode_gives_the_no_grad_output_and_leaves_the_weight_intact(path):
    layer = make_layer(path=path)
    original = layer.get_base_layer().weight.detach().clone()
    x = inputs(layer).detach()
    with torch.no_grad():
        expected = layer(x)
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
    assert torch.equal(layer.get_base_layer().weight, original)
