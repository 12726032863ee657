"""Where an adapter's deltas sit in a weight (`Placement`; reading and writing exactly those entries makes merge and
unmerge exact), and how a NeuroAda linear layer computes `y = base(x) + Σ (P ⊙ Θ) x`: the base layer's own call (its
hooks, arguments and quantized weights included) plus the adapters' sparse products (`SparseBypass`), which never form
a dense weight or delta; the deltas' gradient here is the tuned neurons' dense weight gradient in float32, gathered at
the placement and freed. The products are functions of tensors (`Kernels`) a layer may be given faster versions of;
here they are plain torch, in float32 (float64 where an operand is). Backward keeps the input (or, for deltas reading
few of its columns, those columns) and the deltas, nothing of the weight's size; gradients are exact at every order.
Without gradients, under forward-mode AD or a `torch.func` transform: plain torch operations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd import forward_ad


def transformed(t: torch.Tensor) -> bool:
    """Whether a `torch.func` transform wraps `t` or forward-mode AD follows it; traced, False: dynamo handles
    transforms itself."""
    if torch.compiler.is_compiling():
        return False
    return torch.func.debug_unwrap(t) is not t or forward_ad.unpack_dual(t).tangent is not None


class Placement(NamedTuple):
    """Where one adapter's deltas sit in a (d_out, d_in) weight: delta[i, j] belongs to input `cols[i, j]` of neuron
    `rows[i]`, or of neuron `i` when every neuron is tuned (`rows` is None). A named tuple: `torch.func` transforms
    find its tensors among an autograd Function's arguments.

    `prepared` adds `neurons`, the (n, 1) neuron of each row of deltas. A layer that keeps its placements between
    calls may add `read` (the input columns the deltas read, sorted) and `read_cols` (`cols` as positions among
    them): backward then keeps only those columns of the input (`input_for_backward`)."""

    cols: torch.Tensor
    rows: torch.Tensor | None = None
    neurons: torch.Tensor | None = None
    read: torch.Tensor | None = None
    read_cols: torch.Tensor | None = None

    def prepared(self) -> Placement:
        """This placement with `neurons` computed (itself where a graph is traced or a `torch.func` transform is
        running: tensors made under it would not outlive it)."""
        if torch.compiler.is_compiling() or transformed(neurons := _neurons(self)):
            return self
        return self._replace(neurons=neurons)

    def copy(self, device: torch.device | None = None) -> Placement:
        """A copy owning its indices (a merge's record must not follow later writes); with `device`, moved there."""
        copy = (lambda t: t.clone()) if device is None else (lambda t: t.to(device))
        return Placement(copy(self.cols), None if self.rows is None else copy(self.rows))


def _neurons(placement: Placement) -> torch.Tensor:
    """The neuron of each row of deltas, as an (n, 1) index."""
    cols = placement.cols
    rows = torch.arange(cols.shape[0], device=cols.device) if placement.rows is None else placement.rows.long()
    return rows[:, None]


def entry_index(weight: torch.Tensor, placement: Placement) -> tuple[torch.Tensor, ...]:
    """The placement's entries of a (d_out, d_in) `weight`, or an (E, d_out, d_in) stack, as an index tuple shaped like
    the deltas (a stack counts its neurons expert after expert: neuron `e * d_out + i`). Indexing the tensor itself
    reads and writes any strides, a transposed view's included."""
    neurons = _neurons(placement) if placement.neurons is None else placement.neurons
    if weight.dim() == 3:
        expert, rows = neurons.div(weight.shape[1], rounding_mode="floor"), neurons.remainder(weight.shape[1])
        return expert, rows, placement.cols
    return neurons, placement.cols


def placed_entries(weight: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The entries of `weight` at the placement, shaped like the deltas."""
    return weight.detach()[entry_index(weight, placement)]


def write_placed_(weight: torch.Tensor, placement: Placement, values: torch.Tensor) -> None:
    """Write `values` at the placement through `weight.data`: the version counter does not move, so another graph
    that saved the weight still runs its backward (a merge is the model's new weight, as LoRA's merge through
    `weight.data` makes it)."""
    weight.data.index_put_(entry_index(weight, placement), values)


def accumulating(a: Tensor, b: Tensor) -> torch.dtype:
    """float32, or float64 where an operand is: the products never accumulate in a dtype narrower than float32."""
    return torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` in `dtype`: itself where it already is (a `to` that does nothing is still an operator called per layer)."""
    return t if t.dtype == dtype else t.to(dtype)


def sampled_grad(x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None) -> Tensor:
    """The deltas' gradient: the dense weight gradient of the tuned neurons, gathered at the placement. One GEMM on
    the operands in their own dtype, accumulated and returned in float32 (`out_dtype` on CUDA), whatever k is: on a
    GPU a half-precision GEMM runs on tensor cores, where a sampled product (cuSPARSE's) has float32 kernels only. The
    (n, d_in) float32 gradient lives for the gather."""
    tuned = grad2d if rows is None else grad2d.index_select(1, rows)
    half = x2d.dtype == tuned.dtype in (torch.float16, torch.bfloat16)
    with torch.autocast(x2d.device.type, enabled=False):
        # The out_dtype GEMM, eager or compiled (inductor lowers it); transforms take the float32 one.
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


def merged_copy(weight: torch.Tensor, placements: Sequence[Placement], deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new tensor `W + Σ P ⊙ Θ` in the weight's dtype and strides (overlapping adapters add up, one after another).
    Each adapter's entries are read, added to and written back: no accumulating write, which CUDA sorts for and the
    CPU runs on one thread (an adapter names each entry once, so the values are the same bits)."""
    copy = weight.clone()
    for placement, delta in zip(placements, deltas, strict=True):
        index, values = entry_index(copy, placement), cast(delta, copy.dtype)
        if transformed(delta) or transformed(copy):  # vmap may batch the delta, not the copy
            copy = copy.index_put(index, copy[index] + values)
        else:
            copy.index_put_(index, copy[index] + values)
    return copy


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def input_for_backward(x: torch.Tensor, placements: Sequence[Placement]) -> tuple[torch.Tensor | None, list]:
    """What backward keeps of the input for the deltas' gradients: for one adapter whose placement names the columns
    its deltas read (`Placement.read`), those columns, with the placement re-indexed into them; else None, for the
    whole input. A tracked `index_select` outside the Functions: higher
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
    def backward(ctx, grad_out: torch.Tensor):
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
    """`result + Σ (P ⊙ Θ) x`, one sparse product per adapter on its input `x` (`frozen`: the base layer's tensors;
    under a `torch.func` transform following any of them, plain torch operations)."""
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
    """Where an adapter's deltas sit in `layer`, read from its index buffers (the layers' plain `placements`)."""
    held = layer.neuroada_rows
    rows = held[adapter_name] if adapter_name in held else None  # noqa: SIM401 (a BufferDict has no get)
    return Placement(layer.neuroada_indices[adapter_name], rows).prepared()
