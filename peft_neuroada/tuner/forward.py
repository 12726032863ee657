"""How a NeuroAda linear layer computes `y = W x + b + Σ (P ⊙ Θ) x`, in two paths that never write the base weight:

* **merged copy** (`MergedCopyLinear`): one matmul on a transient `W + Σ P ⊙ Θ` (deltas rounded into the weight's
  dtype, as a merge and the official code round them), made again in backward: the input gradient is the frozen
  layer's own matmul, the deltas' gradient the dense weight gradient sampled at their positions, never formed.
* **bypass** (`SparseBypass`): the base layer's own output plus `(P ⊙ Θ) x`, for what a copy cannot stand in for
  (`copy_refusal`) and for few tokens without gradients (decoding), where copying the weight costs more than it saves.

Without gradients, under forward-mode AD or a `torch.func` transform: plain torch operations torch differentiates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import products
from .placement import Placement, entry_index

# The delta gradient's product: (x2d, grad2d, cols, rows) -> (n, k), at least float32 (`products.sampled_grad`'s).
SampledGrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# Why the merged copy cannot stand in for a call: (base, weight, x) -> reason or None (`copy_refusal`'s).
CopyRefusal = Callable[[nn.Module, torch.Tensor, torch.Tensor], str | None]
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


def _call_refusal(base: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why the copy cannot stand in for this call of a base layer that computes with `weight` (None: it can)."""
    if base._forward_hooks or base._forward_pre_hooks or base._backward_hooks or base._backward_pre_hooks:
        return "the base layer has hooks"
    if "forward" in vars(base):
        return "the base layer's forward is wrapped (accelerate's hooks wrap it so)"
    device = weight.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device).itemsize < weight.element_size():
        return "autocast runs the matmul in a narrower dtype, which would round small deltas away"
    if not torch.is_grad_enabled() and x.numel() <= BYPASS_MAX_TOKENS * x.shape[-1]:
        return FEW_TOKENS
    return None


def merged_copy(weight: torch.Tensor, placements: Sequence[Placement], deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new tensor `W + Σ P ⊙ Θ` in the weight's dtype and strides (overlapping adapters add up, one after another).
    Each adapter's entries are read, added to and written back: no accumulating write, which CUDA sorts for and the
    CPU runs on one thread (an adapter names each entry once, so the values are the same bits)."""
    copy = weight.clone()
    for placement, delta in zip(placements, deltas, strict=True):
        index, values = entry_index(copy, placement), products.cast(delta, copy.dtype)
        if products.transformed(delta) or products.transformed(copy):  # vmap may batch the delta, not the copy
            copy = copy.index_put(index, copy[index] + values)
        else:
            copy.index_put_(index, copy[index] + values)
    return copy


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def input_for_backward(x: torch.Tensor, placements: Sequence[Placement]) -> tuple[torch.Tensor | None, list]:
    """What backward keeps of the input for the deltas' gradients: for one adapter whose deltas read few of the input
    columns (k=1 reads a small share of most layers' inputs; `Placement.prepared`), those columns, with the placement
    re-indexed into them; else None, for the whole input. A tracked `index_select` outside the Functions: higher
    orders see the deltas' gradient depend on the input."""
    if len(placements) == 1 and placements[0].read is not None:
        placement = placements[0]
        compact = Placement(placement.read_cols, placement.rows)
        return _flatten(x).index_select(1, placement.read.to(x.device)), [compact]
    return None, list(placements)


def _needs_grad(ctx) -> list[bool]:
    """Which inputs backward differentiates: every one when traced, where torch.compile around a `torch.func`
    transform reports False for inputs whose gradient is asked (the compiled graph drops the gradients unused)."""
    return [needed or torch.compiler.is_compiling() for needed in ctx.needs_input_grad]


class MergedCopyLinear(torch.autograd.Function):
    """`F.linear(x, W + Σ P ⊙ Θ, b)` with gradients for the input, the bias and the deltas, of every order. `kept` is
    `input_for_backward(x, placements)`'s (None: `x`): the output does not depend on it, the deltas' gradient is
    computed from it. Runs under `torch.func` transforms that do not follow its tensors (which take the plain path)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, kept, kept_placements, weight, bias, placements, sampled_grad, *deltas):
        return F.linear(x, merged_copy(weight, placements, deltas), bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # The weight is a plain reference: an inference tensor (a model loaded under inference_mode) cannot be saved.
        x, kept, ctx.kept_placements, ctx.weight, bias, ctx.placements, ctx.sampled_grad, *deltas = inputs
        ctx.save_for_backward(x if any(_needs_grad(ctx)[7:]) and kept is None else kept, *deltas)
        ctx.input_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad_out):
        (kept, *deltas), needs = ctx.saved_tensors, _needs_grad(ctx)
        grad2d, grad_x, grad_weight, grad_bias = _flatten(grad_out), None, None, None
        if needs[0]:
            copy = merged_copy(ctx.weight, ctx.placements, deltas)
            grad_x = products.cast(grad_out @ products.cast(copy, grad_out.dtype), ctx.input_dtype)
        if needs[3] and kept is not None:  # traced only: the copy path is taken for a frozen weight
            grad_weight = (grad2d.T @ _flatten(kept).to(grad2d.dtype)).to(ctx.weight.dtype)
        if needs[4]:
            grad_bias = grad2d.sum(0).to(ctx.bias_dtype)
        grads = [
            products.cast(ctx.sampled_grad(_flatten(kept), grad2d, p.cols, p.rows), delta.dtype) if needed else None
            for p, delta, needed in zip(ctx.kept_placements, deltas, needs[7:], strict=True)
        ]
        return grad_x, None, None, grad_weight, grad_bias, None, None, *grads


class SparseBypass(torch.autograd.Function):
    """`(P ⊙ Θ) x` for one adapter, gradients of every order; backward keeps `kept` (as above) if the delta trains."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, kept, kept_placement, placement: Placement, out_features: int, sampled_grad, delta):
        out = products.bypass_forward(_flatten(x), placement.cols, placement.rows, delta, out_features)
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, kept, ctx.kept_placement, ctx.placement, _, ctx.sampled_grad, delta = inputs
        ctx.save_for_backward(x if _needs_grad(ctx)[6] and kept is None else kept, delta)
        ctx.input_shape = x.shape

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (kept, delta), needs = ctx.saved_tensors, _needs_grad(ctx)
        grad2d, placement, grad_x, grad_delta = _flatten(grad_out), ctx.placement, None, None
        if needs[0]:
            d_in = ctx.input_shape[-1]
            grad_x = products.bypass_input_grad(grad2d, placement.cols, placement.rows, delta, d_in)
            grad_x = grad_x.to(grad_out.dtype).view(ctx.input_shape)
        if needs[6]:
            cols, rows = ctx.kept_placement.cols, ctx.kept_placement.rows
            grad_delta = products.cast(ctx.sampled_grad(_flatten(kept), grad2d, cols, rows), delta.dtype)
        return grad_x, None, None, None, None, None, grad_delta


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
        differentiated = (torch.is_grad_enabled() and delta.requires_grad) or products.transformed(delta)
        rounded.append(step + (delta - delta.detach()) if differentiated else step)
    return rounded


def adapted_linear(
    base: nn.Module,
    weight: torch.Tensor,
    x: torch.Tensor,
    placements: Sequence[Placement],
    deltas: Sequence[torch.Tensor],
    sampled_grad: SampledGrad,
    copy_refusal: CopyRefusal,
    *args,
    **kwargs,
) -> torch.Tensor:
    """`base(x, *args, **kwargs) + Σ (P ⊙ Θ) x`, on the merged copy where it can stand in, else on the bypass.
    `weight` is the base layer's weight as a (d_out, d_in) view; `sampled_grad` computes the deltas' gradient,
    `copy_refusal` says why the copy cannot stand in (`copy_refusal` below, or one that refuses more)."""
    problem = _weight_problem(base, weight)
    refusal = "extra arguments for the base layer" if args or kwargs else copy_refusal(base, weight, x)
    # Plain torch operations without gradients, under forward-mode AD or a torch.func transform (module docstring).
    tensors = (x, weight, *deltas) if base.bias is None else (x, weight, base.bias, *deltas)
    functions = torch.is_grad_enabled() and not any(map(products.transformed, tensors))
    if refusal is None:
        if functions:
            trains = any(delta.requires_grad for delta in deltas)
            kept, kept_placements = input_for_backward(x, placements) if trains else (None, placements)
            args = (x, kept, kept_placements, weight, base.bias, tuple(placements), sampled_grad)
            return MergedCopyLinear.apply(*args, *deltas)
        return F.linear(x, merged_copy(weight, placements, deltas), base.bias)
    if problem is None:  # the base layer computes with `weight`: round the deltas into it as the copy does
        deltas = rounded_deltas(weight, placements, deltas)
    result = base(x, *args, **kwargs)
    for p, delta in zip(placements, deltas, strict=True):
        if functions:
            kept, (kept_placement,) = input_for_backward(x, [p]) if delta.requires_grad else (None, [p])
            bypass = SparseBypass.apply(x, kept, kept_placement, p, result.shape[-1], sampled_grad, delta)
        else:
            bypass = products.bypass_forward(_flatten(x), p.cols, p.rows, delta, result.shape[-1])
        result = result + bypass.view(result.shape).to(result.dtype)
    return result
