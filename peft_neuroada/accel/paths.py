"""The accelerated forward: `adapted_linear`, the one entry point that picks how to run `W x + b + Σ (P ⊙ Θ) x`.

`FrozenLinear.path` decides, per call, by the first row that matches:

| first match                                                                                   | path      |
|-----------------------------------------------------------------------------------------------|-----------|
| traced (torch.compile, jit); extra base-layer arguments; base not `nn.Linear`/`Conv1D`; weight | general   |
| not a plain dense floating-point tensor in memory; weight trains; hooks on the base or on all  |           |
| `inplace_forward=False`; weight an inference tensor, in shared memory, shared with other       | direct    |
| modules or a view into a larger buffer; autocast to a narrower dtype; CUDA graph capture      |           |
| otherwise                                                                                     | in place  |

**In place** adds the deltas into the k selected entries of each row for one matmul and writes the originals back
bit-exactly: forward and input gradient cost one dense matmul each, like a frozen layer. **Direct** adds the sparse
products into `F.linear`'s output and input gradient; **general** runs the base layer's own forward plus the bypass.
Only the in-place path writes the weight, and it and the direct path hold the layer's `WeightLock`. The products run
on `kernels.choose_backend`'s backend; the in-place patch of one adapter on a CPU weight is the C `entry_patch`, else
torch's gather/scatter_. Backward keeps the input (or just the columns the deltas read): the delta gradient is the
dense weight gradient sampled at the selected positions (`kernels.sampled_grad`), never formed.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import torch.nn.modules.module as module_hooks
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..tuner.placement import Placement, positions, storage_view, unique_columns
from . import kernels
from .lock import WeightLock

# Backward keeps only the input columns the deltas read when they are at most this share of the input.
_COMPACT_INPUT_MAX_SHARE = 0.5
_LINEAR_MODULES = (nn.Linear, Conv1D)
_PLAIN_WEIGHT_TYPES = (nn.Parameter, torch.Tensor)
# torch's registries of global module hooks (dicts it fills and empties in place, never rebinds).
_GLOBAL_HOOKS = tuple(
    getattr(module_hooks, f"_global_{kind}_hooks") for kind in ("forward", "forward_pre", "backward", "backward_pre")
)


class Path(NamedTuple):
    """The path a call takes, and why the next faster one was refused (None on the in-place path)."""

    name: str  # "in place", "direct" or "general"
    reason: str | None


class FrozenLinear(NamedTuple):
    """The frozen layer an adapter sits on, with what its layer keeps for it (see the module docstring)."""

    module: nn.Module  # nn.Linear, Conv1D, or any module computing a linear map (quantized, hooked, ...)
    weight: torch.Tensor  # its weight as a (d_out, d_in) view
    shared_with: tuple[str, ...]  # other modules holding the same weight
    lock: WeightLock

    def locked(self) -> WeightLock:
        return self.lock.on(self.weight.device)

    def path(self, inplace: bool = True, extra_args: bool = False) -> Path:
        """The decision table of the module docstring, one row after the other."""
        if reason := "the base layer gets extra arguments" if extra_args else self._general_reason():
            return Path("general", reason)
        if reason := "inplace_forward is False" if not inplace else self._write_reason():
            return Path("direct", reason)
        return Path("in place", None)

    def _general_reason(self) -> str | None:
        """Why `F.linear(x, weight, bias)` may not stand in for `base(x)`: only the base layer's own call would run
        hooks or tracing, and only a plain dense floating-point weight is read directly."""
        base, weight = self.module, self.weight
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return "the graph is being traced"
        if type(base) not in _LINEAR_MODULES:
            return f"the base layer is a {type(base).__name__}"
        if type(weight) not in _PLAIN_WEIGHT_TYPES or type(base.weight) not in _PLAIN_WEIGHT_TYPES:
            return f"the weight is a {type(base.weight).__name__}"
        if weight.layout != torch.strided or not weight.dtype.is_floating_point or weight.is_meta:
            return "the weight is not a dense floating-point tensor in memory"
        if weight.requires_grad:
            return "the base layer's weight trains"
        # (accelerate's hook is an instance attribute: a dict lookup, where `hasattr` raises and catches)
        if base._forward_hooks or base._forward_pre_hooks or "_hf_hook" in vars(base):
            return "the base layer has forward hooks"
        if base._backward_hooks or base._backward_pre_hooks:
            return "the base layer has backward hooks"
        if any(_GLOBAL_HOOKS):
            return "module hooks are registered globally (torch.nn.modules.module.register_module_*_hook)"
        return None

    def _write_reason(self) -> str | None:
        """Why the weight must not be written in place although it may be read: it must be writable and this layer's
        alone (no other module or process may read patched entries), own its whole storage (not an FSDP1 flat
        parameter's view), and the matmul must run in its dtype (an autocast rounding W + delta would lose deltas
        under half a step of the row's largest weight)."""
        weight = self.weight
        if weight.is_inference():
            return "the weight is an inference tensor"
        device = weight.device.type
        if torch.is_autocast_enabled(device):
            narrower = torch.get_autocast_dtype(device)
            if narrower.itemsize < weight.element_size():
                return f"autocast runs the matmul in {narrower}"
        storage = weight.untyped_storage()
        if device == "cpu" and storage.is_shared():  # (CUDA tensors always report shared)
            return "the weight is in shared memory (other processes may read it: `share_memory()`, multiprocessing)"
        if device == "cuda" and torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured (its replays could overlap other streams' visits)"
        if self.shared_with:
            return f"the weight is shared with {', '.join(self.shared_with)}"
        if weight.storage_offset() != 0 or storage.nbytes() != weight.numel() * weight.element_size():
            return "the weight is a view into a larger buffer"
        return None


def adapted_linear(
    frozen: FrozenLinear,
    x: torch.Tensor,
    placements: Sequence[Placement],
    deltas: Sequence[torch.Tensor],
    out_features: int,
    inplace: bool,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """`W x + b + Σ (P ⊙ Θ) x` on the path `frozen.path` picks; extra arguments go to the base layer."""
    path = frozen.path(inplace, bool(args or kwargs)).name
    if path != "general":
        return _linear(frozen, x, placements, deltas, inplace=path == "in place")
    result = frozen.module(x, *args, **kwargs)
    for placement, delta in zip(placements, deltas, strict=True):
        result = result + bypass_alone(x, placement, out_features, delta).to(result.dtype)
    return result


def frozen_output(frozen: FrozenLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The base layer's output, its weight read under the lock (another thread's visit may have it patched): with
    gradients through the direct path without deltas, else its own forward under the lock; traced, its own forward."""
    if torch.compiler.is_compiling():
        return frozen.module(x, *args, **kwargs)
    if torch.is_grad_enabled() and frozen.path(False, bool(args or kwargs)).name == "direct":
        return _linear(frozen, x, (), (), inplace=False)
    with frozen.locked():
        return frozen.module(x, *args, **kwargs)


def _linear(frozen: FrozenLinear, x: torch.Tensor, placements, deltas, inplace: bool) -> torch.Tensor:
    # Under no_grad (inference, generation) autograd.Function would still report the deltas as needing gradients.
    if torch.is_grad_enabled():
        route = (frozen, inplace)
        return LinearWithDeltas.apply(x, frozen.weight, frozen.module.bias, route, tuple(placements), *deltas)
    return _forward(x, frozen, placements, deltas, inplace)


def _with_deltas_added(frozen: FrozenLinear, placements: Sequence[Placement], deltas: Sequence[torch.Tensor], compute):
    """`compute()` while the weight holds the deltas (overlapping adapters add up); then every entry is bit-identical
    again: the originals are read before any write and written back in the `finally` by one call into torch (nothing
    in Python between the `finally:` and the write), retried once if that call itself is interrupted, so any
    exception, KeyboardInterrupt included, restores the weight."""
    weight = frozen.weight
    if len(placements) == 1 and kernels.patches_entries(weight, deltas[0]):
        entry_patch = kernels.entry_patch(weight, placements[0].cols, placements[0].rows, deltas[0])
        patch, restore = entry_patch.apply, entry_patch.restore
    else:
        storage, places = storage_view(weight), [positions(weight, p) for p in placements]
        everywhere = torch.cat([at.reshape(-1) for at in places])
        with torch.no_grad():
            originals = storage[everywhere]
        restore = functools.partial(storage.index_put_, (everywhere,), originals)

        @torch.no_grad()
        def patch() -> None:
            if len(places) == 1:  # its entries are the originals: no second read (a kernel launch on CUDA)
                delta = deltas[0].detach().reshape(-1)
                return storage.index_put_((everywhere,), originals + delta.to(originals.dtype))
            for at, delta in zip(places, deltas, strict=True):
                storage.index_put_((at,), storage[at] + delta.detach().to(originals.dtype))

    try:
        patch()
        return compute()
    finally:
        try:
            restore()
        except BaseException:
            restore()
            raise


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# Layer inputs some layer's backward keeps whole already: q/k/v (and gate/up) read the same input, and once one keeps
# it, a reference in the others is free where a compacted copy would cost memory. Process-global because those layers
# share nothing else; weak (by `id`, checked by identity), so nothing is kept alive.
_INPUTS_KEPT_WHOLE: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def input_for_backward(x: torch.Tensor, placements: Sequence[Placement]) -> tuple[torch.Tensor, list[Placement]]:
    """What backward keeps of the layer input (the input, or only the columns the deltas read, unless they read most
    of them or another layer keeps it whole) and the placements re-indexed into its columns."""
    d_in = x.shape[-1]
    if _INPUTS_KEPT_WHOLE.get(id(x)) is not x and sum(p.cols.numel() for p in placements) <= 2 * d_in:
        if len(placements) == 1:
            used, local = placements[0].columns_read()
        else:
            used, local = unique_columns(torch.cat([p.cols.reshape(-1) for p in placements]))
        if used.numel() <= _COMPACT_INPUT_MAX_SHARE * d_in:
            local_cols = local.reshape(-1).split([p.cols.numel() for p in placements])
            compact = [Placement(c.view_as(p.cols), p.rows) for c, p in zip(local_cols, placements, strict=True)]
            x2d = _flatten(x)
            return torch.gather(x2d, 1, used.expand(x2d.shape[0], -1)), compact
    _INPUTS_KEPT_WHOLE[id(x)] = x
    return x, list(placements)


def _delta_grads(placements, x_saved: torch.Tensor | None, grad2d: torch.Tensor, deltas, needs) -> list:
    """The deltas' gradients: the dense weight gradient sampled at each placement (None where not needed)."""
    return [
        kernels.sampled_grad(_flatten(x_saved), grad2d, p.cols, p.rows).to(delta.dtype) if need else None
        for p, delta, need in zip(placements, deltas, needs, strict=True)
    ]


def _forward(x, frozen: FrozenLinear, placements: Sequence[Placement], deltas, inplace: bool) -> torch.Tensor:
    """In place: `F.linear(x, W + scatter(deltas), b)` on the weight's own storage. Direct: `F.linear(x, W, b)` with
    the bypasses added into its output."""
    with frozen.locked():
        if inplace:
            linear = functools.partial(F.linear, x, frozen.weight, frozen.module.bias)
            return _with_deltas_added(frozen, placements, deltas, linear)
        out = F.linear(x, frozen.weight, frozen.module.bias)
    out2d, x2d = _flatten(out), _flatten(x)
    for placement, delta in zip(placements, deltas, strict=True):
        kernels.bypass_forward(x2d, placement.cols, placement.rows, delta.detach(), out.shape[-1], out=out2d)
    return out


class LinearWithDeltas(torch.autograd.Function):
    """The in-place and direct paths with gradients. The weight is a plain reference, not a saved tensor: in-place
    visits move its data, and backward reads it under the lock without autograd's version check, which other
    threads' visits would trip."""

    @staticmethod
    def forward(ctx, x, weight, bias, route, placements, *deltas):
        frozen, inplace = route
        out = _forward(x, frozen, placements, deltas, inplace)
        needed = any(ctx.needs_input_grad[5:])
        x_saved, ctx.saved_placements = input_for_backward(x, placements) if needed else (None, placements)
        ctx.save_for_backward(x_saved, *deltas)
        ctx.frozen, ctx.inplace, ctx.placements, ctx.input_dtype = frozen, inplace, placements, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_saved, *deltas = ctx.saved_tensors
        grad2d, frozen, grad_x = _flatten(grad_out), ctx.frozen, None
        if ctx.needs_input_grad[0]:

            def times_weight() -> torch.Tensor:  # reads the weight when called: patched, on the in-place path
                return grad_out @ frozen.weight.to(grad_out.dtype)

            with frozen.locked():
                if ctx.inplace:
                    grad_x = _with_deltas_added(frozen, ctx.placements, deltas, times_weight)
                else:
                    grad_x = times_weight()
            grad_x = grad_x.to(ctx.input_dtype)
            if not ctx.inplace:
                grad_x2d, d_in = _flatten(grad_x), grad_x.shape[-1]
                for placement, delta in zip(ctx.placements, deltas, strict=True):
                    kernels.bypass_input_grad(grad2d, placement.cols, placement.rows, delta, d_in, out=grad_x2d)
        grad_bias = grad2d.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        grad_deltas = _delta_grads(ctx.saved_placements, x_saved, grad2d, deltas, ctx.needs_input_grad[5:])
        return grad_x, None, grad_bias, None, None, *grad_deltas


@torch.library.custom_op("neuroada::bypass_input_grad", mutates_args=())
def bypass_input_grad(
    grad2d: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor, d_in: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """`kernels.bypass_input_grad` as an opaque op to `torch.compile`, so compiled graphs run the compiled kernels
    (traced, the torch-op fallback's index_add_ loop is fused by inductor into code that writes out of bounds).
    Registered with torch when the accelerators are first imported: with the first NeuroAda layer, never while
    tracing (dynamo cannot trace a registration)."""
    return kernels.bypass_input_grad(grad2d, cols, rows, delta, d_in, dtype)


@bypass_input_grad.register_fake
def _(grad2d, cols, rows, delta, d_in, dtype):
    return grad2d.new_empty(grad2d.shape[0], d_in, dtype=dtype)


def bypass_alone(x: torch.Tensor, placement: Placement, out_features: int, delta: torch.Tensor) -> torch.Tensor:
    """`(P ⊙ Θ) x` alone, for adding to an untouched base layer's output."""
    if torch.is_grad_enabled():
        return SparseBypass.apply(x, placement, out_features, delta)
    out = kernels.bypass_forward(_flatten(x), placement.cols, placement.rows, delta.detach(), out_features)
    return out.view(*x.shape[:-1], out_features)


class SparseBypass(torch.autograd.Function):
    """`bypass_alone` with gradients. Backward keeps what the other paths keep (the whole input when traced: the
    compaction is Python state), nothing of it when the delta is frozen."""

    @staticmethod
    def forward(ctx, x, placement, out_features, delta):
        out = kernels.bypass_forward(_flatten(x), placement.cols, placement.rows, delta, out_features)
        if not ctx.needs_input_grad[3]:
            x_saved, ctx.saved_placements = None, [placement]
        elif torch.compiler.is_compiling():
            x_saved, ctx.saved_placements = x, [placement]
        else:
            x_saved, ctx.saved_placements = input_for_backward(x, [placement])
        ctx.save_for_backward(x_saved, delta)
        ctx.placement, ctx.input_shape, ctx.input_dtype = placement, x.shape, x.dtype
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        x_saved, delta = ctx.saved_tensors
        grad2d = _flatten(grad_out)
        grad_x = grad_delta = None
        if ctx.needs_input_grad[0]:
            cols, rows, (*_, d_in) = ctx.placement.cols, ctx.placement.rows, ctx.input_shape
            grad_x = bypass_input_grad(grad2d, cols, rows, delta, d_in, ctx.input_dtype).view(ctx.input_shape)
        if ctx.needs_input_grad[3]:
            (grad_delta,) = _delta_grads(ctx.saved_placements, x_saved, grad2d, [delta], [True])
        return grad_x, None, None, grad_delta
