"""Where an adapter's deltas sit (`Placement`), and how a layer computes `y = base(x) + Σ (P ⊙ Θ) x`: the base layer's
own call plus one sparse product per adapter (`SparseBypass`), never a dense weight or delta. The products (`Kernels`)
are plain torch accumulated in float32 (float64 where an operand is); a layer may be given faster ones. Backward keeps
the input (or only the columns the deltas read) and the deltas; the deltas' gradient is the tuned neurons' dense
float32 weight gradient, gathered at the placement and freed. Gradients are exact at every order. Without gradients,
under forward-mode AD or a `torch.func` transform: plain torch operations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd import forward_ad


def transformed(t: Tensor) -> bool:
    """Whether a `torch.func` transform wraps `t` or forward-mode AD follows it (traced: False, dynamo handles it)."""
    if torch.compiler.is_compiling():
        return False
    return torch.func.debug_unwrap(t) is not t or forward_ad.unpack_dual(t).tangent is not None


class Placement(NamedTuple):
    """delta[i, j] belongs to input `cols[i, j]` of neuron `rows[i]` (of neuron i when `rows` is None). `neurons`: the
    (n, 1) neuron of each row, once `prepared`. A layer keeping placements may add `read` (the sorted input columns
    the deltas read) and `read_cols` (`cols` as positions among them): backward then keeps only those columns."""

    cols: Tensor
    rows: Tensor | None = None
    neurons: Tensor | None = None
    read: Tensor | None = None
    read_cols: Tensor | None = None

    def prepared(self) -> Placement:
        """With `neurons` (not while traced or transformed: tensors made there would not outlive it)."""
        if torch.compiler.is_compiling() or transformed(neurons := _neurons(self)):
            return self
        return self._replace(neurons=neurons)

    def copy(self, device: torch.device | None = None) -> Placement:
        """A copy owning its indices (a merge's record must not follow later writes); with `device`, the indices on
        that device (a record's own where they already are)."""
        copy = (lambda t: t.clone()) if device is None else (lambda t: t.to(device))
        return Placement(copy(self.cols), None if self.rows is None else copy(self.rows))


def _neurons(placement: Placement) -> Tensor:
    cols = placement.cols
    rows = torch.arange(cols.shape[0], device=cols.device) if placement.rows is None else placement.rows.long()
    return rows[:, None]


def entry_index(weight: Tensor, placement: Placement) -> tuple[Tensor, ...]:
    """The placement's entries of a (d_out, d_in) weight or an (E, d_out, d_in) stack (neuron `e * d_out + i`), as an
    index tuple shaped like the deltas; indexing the tensor itself reads and writes any strides."""
    neurons = _neurons(placement) if placement.neurons is None else placement.neurons
    if weight.dim() == 3:
        return neurons.div(weight.shape[1], rounding_mode="floor"), neurons.remainder(weight.shape[1]), placement.cols
    return neurons, placement.cols


def placed_entries(weight: Tensor, placement: Placement) -> Tensor:
    return weight.detach()[entry_index(weight, placement)]


def write_placed_(weight: Tensor, placement: Placement, values: Tensor) -> None:
    """Write through `weight.data`, as LoRA's merge: the version counter does not move, so a graph that saved the
    weight still runs its backward."""
    weight.data.index_put_(entry_index(weight, placement), values)


def accumulating(a: Tensor, b: Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # (a `to` that does nothing is still an operator call)


def sampled_grad(x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None) -> Tensor:
    """The deltas' gradient: the tuned neurons' dense weight gradient, one GEMM accumulated in float32 (on CUDA
    `out_dtype`, so half-precision operands run on tensor cores), gathered at the placement and freed."""
    tuned = grad2d if rows is None else grad2d.index_select(1, rows)
    half = x2d.dtype == tuned.dtype in (torch.float16, torch.bfloat16)
    with torch.autocast(x2d.device.type, enabled=False):
        if half and x2d.device.type == "cuda" and not (transformed(x2d) or transformed(tuned)):
            dense = torch.mm(tuned.T, x2d, out_dtype=torch.float32)
        else:
            dtype = accumulating(x2d, tuned)
            dense = cast(tuned, dtype).T @ cast(x2d, dtype)
    return dense.gather(1, cols.long())


def bypass_forward(x2d: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor, d_out: int) -> Tensor:
    """`(P ⊙ Θ) x` (tokens, d_out), as k passes of gathers."""
    dtype = accumulating(x2d, delta)
    tuned = sum(cast(x2d.index_select(1, cols[:, j]), dtype) * delta[:, j].to(dtype) for j in range(cols.shape[1]))
    if rows is None:
        return tuned
    return torch.zeros(x2d.shape[0], d_out, dtype=dtype, device=x2d.device).index_add(1, rows, tuned)


def bypass_input_grad(grad2d: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor, d_in: int) -> Tensor:
    """The input gradient of `bypass_forward` (tokens, d_in), as k passes of scatters."""
    dtype = accumulating(grad2d, delta)
    tuned = cast(grad2d if rows is None else grad2d.index_select(1, rows), dtype)
    grad_x = torch.zeros(grad2d.shape[0], d_in, dtype=dtype, device=grad2d.device)
    for j in range(cols.shape[1]):
        grad_x.index_add_(1, cols[:, j], tuned * delta[:, j].to(dtype))
    return grad_x


class Kernels(NamedTuple):
    """The forward's products, each a function of tensors: a layer may be given faster ones, where measured so."""

    sampled_grad: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor] = sampled_grad
    bypass_forward: Callable[[Tensor, Tensor, Tensor | None, Tensor, int], Tensor] = bypass_forward
    bypass_input_grad: Callable[[Tensor, Tensor, Tensor | None, Tensor, int], Tensor] = bypass_input_grad


def merged_copy(weight: Tensor, placements: Sequence[Placement], deltas: Sequence[Tensor]) -> Tensor:
    """A new `W + Σ P ⊙ Θ` in the weight's dtype and strides, adapters added one after another. Read, add, write:
    no accumulating write (CUDA sorts for it, the CPU runs it on one thread), the same bits as each adapter names an
    entry once."""
    copy = weight.clone()
    for placement, delta in zip(placements, deltas, strict=True):
        index, values = entry_index(copy, placement), cast(delta, copy.dtype)
        if transformed(delta) or transformed(copy):  # vmap may batch the delta, not the copy
            copy = copy.index_put(index, copy[index] + values)
        else:
            copy.index_put_(index, copy[index] + values)
    return copy


def _flatten(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def input_for_backward(x: Tensor, placements: Sequence[Placement]) -> tuple[Tensor | None, list]:
    """What backward keeps of the input: the columns one adapter's deltas read (`Placement.read`) with the placement
    re-indexed into them, else None (the whole input). Tracked, so higher orders see the dependence on the input."""
    if len(placements) == 1 and placements[0].read is not None:
        placement = placements[0]
        compact = Placement(placement.read_cols, placement.rows)
        return _flatten(x).index_select(1, placement.read.to(x.device)), [compact]
    return None, list(placements)


def _needs_grad(ctx) -> list[bool]:
    """Every input when traced: compiled around a `torch.func` transform, inputs whose gradient is asked read False."""
    return [needed or torch.compiler.is_compiling() for needed in ctx.needs_input_grad]


class SparseBypass(torch.autograd.Function):
    """`(P ⊙ Θ) x` for one adapter, gradients of every order; backward keeps `kept` (as above) if the delta trains."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, kept, kept_placement, placement: Placement, out_features: int, kernels, delta):
        out = kernels.bypass_forward(_flatten(x), placement.cols, placement.rows, delta, out_features)
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, kept, ctx.kept_placement, ctx.placement, _, ctx.kernels, delta = inputs
        ctx.save_for_backward(x if _needs_grad(ctx)[6] and kept is None else kept, delta)
        ctx.input_shape = x.shape

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (kept, delta), needs = ctx.saved_tensors, _needs_grad(ctx)
        grad2d, placement, grad_x, grad_delta = _flatten(grad_out), ctx.placement, None, None
        if needs[0]:
            d_in = ctx.input_shape[-1]
            grad_x = ctx.kernels.bypass_input_grad(grad2d, placement.cols, placement.rows, delta, d_in)
            grad_x = grad_x.to(grad_out.dtype).view(ctx.input_shape)
        if needs[6]:
            cols, rows = ctx.kept_placement.cols, ctx.kept_placement.rows
            grad_delta = cast(ctx.kernels.sampled_grad(_flatten(kept), grad2d, cols, rows), delta.dtype)
        return grad_x, None, None, None, None, None, grad_delta


def add_bypasses(
    result: Tensor,
    inputs: Sequence[Tensor],
    placements: Sequence[Placement],
    deltas: Sequence[Tensor],
    kernels: Kernels,
    frozen: Sequence[Tensor] = (),
) -> Tensor:
    """`result + Σ (P ⊙ Θ) x`, one sparse product per adapter on its input; plain torch operations under a
    `torch.func` transform following any input, delta or of the base layer's `frozen` tensors."""
    functions = torch.is_grad_enabled() and not any(map(transformed, (*inputs, *frozen, *deltas)))
    for x, p, delta in zip(inputs, placements, deltas, strict=True):
        if functions:
            kept, (kept_placement,) = input_for_backward(x, [p]) if delta.requires_grad else (None, [p])
            bypass = SparseBypass.apply(x, kept, kept_placement, p, result.shape[-1], kernels, delta)
        else:
            bypass = kernels.bypass_forward(_flatten(x), p.cols, p.rows, delta, result.shape[-1])
        result = result + bypass.view(result.shape).to(result.dtype)
    return result


def placement_of(layer, adapter_name: str) -> Placement:
    """The layers' plain `placements`: read from the index buffers at every call."""
    held = layer.neuroada_rows
    rows = held[adapter_name] if adapter_name in held else None  # noqa: SIM401 (a BufferDict has no get)
    return Placement(layer.neuroada_indices[adapter_name], rows).prepared()
