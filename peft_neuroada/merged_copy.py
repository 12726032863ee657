"""The merged-copy path: where a transient `W + Σ P ⊙ Θ` can stand in for the base layer's call (`copy_refusal`),
one matmul on it (`MergedCopyLinear`), with the deltas rounded into the weight's dtype as a merge and the official code
round them, made again in backward: the input gradient is the frozen layer's own matmul, the deltas' gradient the dense
weight gradient sampled at their positions. It is there for speed where a batch of tokens trains: one dense matmul
instead of the base layer's plus the sparse products. Where the copy cannot stand in, the bypass adds the deltas as
the copy would round them (`rounded_deltas`), so both paths compute the same. `merged_forward` is the
layers' component that takes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
import torch.nn.modules.module as module_hooks
from torch import nn
from transformers.pytorch_utils import Conv1D

from .tuner.forward import (
    Kernels,
    Placement,
    _flatten,
    _needs_grad,
    add_bypasses,
    cast,
    entry_index,
    input_for_backward,
    merged_copy,
    transformed,
)

# Without gradients, calls of at most this many tokens take the bypass (decoding: one token per sequence and step).
BYPASS_MAX_TOKENS = 32
FEW_TOKENS = "few tokens without gradients: the bypass costs less than a copy of the weight"
_LINEAR_MODULES = (nn.Linear, Conv1D)
_PLAIN_WEIGHT_TYPES = (nn.Parameter, torch.Tensor)


def _weight_problem(base: nn.Module, weight: torch.Tensor) -> str | None:
    """Why `weight` is not what the base layer computes with, as a frozen float (d_out, d_in) tensor (None: it is)."""
    if type(base) not in _LINEAR_MODULES:
        return f"the base layer is a {type(base).__name__}"
    if type(base.weight) not in _PLAIN_WEIGHT_TYPES or weight.layout != torch.strided or weight.is_meta:
        return "the weight is not a dense tensor in memory"
    if not weight.dtype.is_floating_point or weight.requires_grad:
        return "the weight is not a frozen floating-point tensor"
    if weight.dim() != 2:  # e.g. DeepSpeed ZeRO-3's empty placeholder outside the base layer's call
        return "the weight is not a (d_out, d_in) matrix"
    return None


def copy_refusal(base: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why `F.linear(x, W + Σ P ⊙ Θ, b)` cannot stand in for `base(x)` plus the bypass (None: it can). `weight` is the
    base layer's weight as a (d_out, d_in) view."""
    return _weight_problem(base, weight) or _call_refusal(base, weight, x)


def _global_hooks() -> bool:
    """Whether hooks registered for every module would see the base layer's call (no public API tells)."""
    return any(
        (
            module_hooks._global_forward_hooks,
            module_hooks._global_forward_pre_hooks,
            module_hooks._global_backward_hooks,
            module_hooks._global_backward_pre_hooks,
        )
    )


def _call_refusal(base: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why the copy cannot stand in for this call of a base layer that computes with `weight` (None: it can)."""
    if base._forward_hooks or base._forward_pre_hooks or base._backward_hooks or base._backward_pre_hooks:
        return "the base layer has hooks"
    if _global_hooks():
        return "global module hooks would see the base layer's call"
    if "forward" in vars(base):
        return "the base layer's forward is wrapped (accelerate's hooks wrap it so)"
    device = weight.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device).itemsize < weight.element_size():
        return "autocast runs the matmul in a narrower dtype, which would round small deltas away"
    if not torch.is_grad_enabled() and x.numel() <= BYPASS_MAX_TOKENS * x.shape[-1]:
        return FEW_TOKENS
    return None


class MergedCopyLinear(torch.autograd.Function):
    """`F.linear(x, W + Σ P ⊙ Θ, b)` with gradients for the input, the bias and the deltas, of every order. `kept` is
    `input_for_backward(x, placements)`'s (None: `x`): the output does not depend on it, the deltas' gradient is
    computed from it. Runs under `torch.func` transforms that do not follow its tensors (which take the plain path)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, kept, kept_placements, weight, bias, placements, kernels, *deltas):
        return F.linear(x, merged_copy(weight, placements, deltas), bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # The weight is a plain reference: an inference tensor (a model loaded under inference_mode) cannot be saved.
        x, kept, ctx.kept_placements, ctx.weight, bias, ctx.placements, ctx.kernels, *deltas = inputs
        ctx.save_for_backward(x if any(_needs_grad(ctx)[7:]) and kept is None else kept, *deltas)
        ctx.input_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad_out):
        (kept, *deltas), needs = ctx.saved_tensors, _needs_grad(ctx)
        grad2d, grad_x, grad_weight, grad_bias = _flatten(grad_out), None, None, None
        if needs[0]:
            copy = merged_copy(ctx.weight, ctx.placements, deltas)
            grad_x = cast(grad_out @ cast(copy, grad_out.dtype), ctx.input_dtype)
        if needs[3] and kept is not None:  # traced only: the copy path is taken for a frozen weight
            grad_weight = (grad2d.T @ _flatten(kept).to(grad2d.dtype)).to(ctx.weight.dtype)
        if needs[4]:
            grad_bias = grad2d.sum(0).to(ctx.bias_dtype)
        grads = [
            cast(ctx.kernels.sampled_grad(_flatten(kept), grad2d, p.cols, p.rows), delta.dtype) if needed else None
            for p, delta, needed in zip(ctx.kept_placements, deltas, needs[7:], strict=True)
        ]
        return grad_x, None, None, grad_weight, grad_bias, None, None, *grads


def _entry_slots(weight: torch.Tensor, indices: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, list]:
    """The distinct entries of `weight` the adapters' `entry_index`es address, and where each adapter's lie in them."""
    if len(indices) == 1:
        return weight.detach()[indices[0]].reshape(-1), [slice(None)]
    flat = [(rows * weight.shape[1] + cols).reshape(-1) for rows, cols in indices]
    used, inverse = torch.unique(torch.cat(flat), return_inverse=True)
    entries = weight.detach()[used.div(weight.shape[1], rounding_mode="floor"), used.remainder(weight.shape[1])]
    return entries, list(inverse.split([f.numel() for f in flat]))


def rounded_deltas(weight: torch.Tensor, placements: Sequence[Placement], deltas: Sequence) -> list[torch.Tensor]:
    """The deltas as the merged copy adds them, one adapter after another, into a weight narrower than float32: each
    entry rounded to the weight's dtype after each adapter, less what it held before. So the bypass adds what the copy
    would, up to the matmul's own rounding; gradients and tangents pass through the rounding, as through the copy."""
    if weight.dtype.itemsize >= torch.float32.itemsize:
        return list(deltas)
    running, slots = _entry_slots(weight, [entry_index(weight, placement) for placement in placements])
    rounded = []
    for delta, slot in zip(deltas, slots, strict=True):
        before = running[slot]
        after = before + delta.detach().reshape(-1).to(before.dtype)
        if len(slots) > 1:
            running = running.index_put((slot,), after)
        step = (after.float() - before.float()).view_as(delta)
        differentiated = (torch.is_grad_enabled() and delta.requires_grad) or transformed(delta)
        rounded.append(step + (delta - delta.detach()) if differentiated else step)
    return rounded


def copied_linear(
    base: nn.Module,
    weight: torch.Tensor,
    x: torch.Tensor,
    placements: Sequence[Placement],
    deltas: Sequence[torch.Tensor],
    kernels: Kernels,
) -> torch.Tensor:
    """`F.linear(x, W + Σ P ⊙ Θ, b)`: through `MergedCopyLinear` where it differentiates, else plain operations."""
    tensors = (x, weight, *deltas) if base.bias is None else (x, weight, base.bias, *deltas)
    if torch.is_grad_enabled() and not any(map(transformed, tensors)):
        trains = any(delta.requires_grad for delta in deltas)
        kept, kept_placements = input_for_backward(x, placements) if trains else (None, placements)
        args = (x, kept, kept_placements, weight, base.bias, tuple(placements), kernels)
        return MergedCopyLinear.apply(*args, *deltas)
    return F.linear(x, merged_copy(weight, placements, deltas), base.bias)


def merged_forward(
    layer: nn.Module,
    x: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    placements: Sequence[Placement],
    deltas: Sequence[torch.Tensor],
    *args,
    **kwargs,
) -> torch.Tensor:
    """A NeuroAda linear layer's `base(x) + Σ (P ⊙ Θ) input` (its `merged_forward` component; each adapter's input is
    `x` unless dropout acts on it): on the merged copy where it can stand in, else the base layer's call plus the
    bypass of the deltas as the copy would round them, so training with dropout adds what the merged model holds."""
    base, weight = layer.get_base_layer(), layer.weight_out_in()
    if args or kwargs:
        refusal = "extra arguments for the base layer"
    elif any(given is not x for given in inputs):
        refusal = "dropout acts on the deltas' input, which the copy cannot drop apart from the frozen layer's"
    else:
        refusal = copy_refusal(base, weight, x)
    if refusal is None:
        return copied_linear(base, weight, x, placements, deltas, layer.kernels)
    if _weight_problem(base, weight) is None:  # the base layer computes with `weight`: round as the copy does
        deltas = rounded_deltas(weight, placements, deltas)
    result = base(x, *args, **kwargs)
    return add_bypasses(result, inputs, placements, deltas, layer.kernels, layer._frozen())
