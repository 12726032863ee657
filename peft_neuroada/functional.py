"""The sparse bypass `(P ⊙ Θ) x` and its gradients.

Two autograd paths share the same primitives:

* `InplaceMergedLinear` (fast path): adds the deltas into the k selected entries of each row of the frozen weight,
  runs the ordinary dense matmul, and writes the saved original entries back bit-exactly. Forward and input gradient
  therefore cost exactly one dense matmul each, like a frozen layer, and nothing of size d_out x d_in is allocated.
* `SparseBypass` (general path): `base(x) + bypass(x)` computed with gathers, for weights that must not be touched
  (quantized, sharded, trainable, or traced by `torch.compile`).

Both save only the layer input for backward; the delta gradient is the dense weight gradient sampled at the selected
positions, computed without forming it: `grad[i, j] = sum_t grad_out[t, row_i] * x[t, cols[i, j]]`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F

# Above this k, a sampled sparse-dense matmul (one kernel) beats k gather passes for the delta gradient on CPU.
_GATHER_LOOP_MAX_K = 4
# Backward keeps only the input columns the deltas read when they are at most this share of the input.
_COMPACT_INPUT_MAX_SHARE = 0.5
# Inputs some layer already keeps whole for backward (q/k/v and gate/up share theirs): others just reference them.
_INPUTS_KEPT_WHOLE: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class Placement(NamedTuple):
    """Where one adapter's deltas sit in a (d_out, d_in) weight: delta[i, j] belongs to input `cols[i, j]` of neuron
    `rows[i]`, or of neuron `i` when every neuron is tuned (`rows` is None)."""

    cols: torch.Tensor
    rows: torch.Tensor | None = None


class _Entries(NamedTuple):
    """One placement's entries in one weight, located once per use and then read or written in delta order (n, k)."""

    target: torch.Tensor  # the (d_out, d_in) weight itself (row-wise) or a 1-D view of its storage
    index: torch.Tensor  # int64 (n, k): columns along dim 1 (row-wise) or positions in the storage
    row_wise: bool

    def read(self) -> torch.Tensor:
        return self.target.gather(1, self.index) if self.row_wise else self.target[self.index]

    def write(self, values: torch.Tensor) -> None:
        if self.row_wise:
            self.target.scatter_(1, self.index, values)
        else:
            self.target.index_put_((self.index,), values)


def _locate(weight: torch.Tensor, placement: Placement) -> _Entries:
    """Row-wise gather/scatter is fastest for float32/64 with every neuron tuned; elsewhere CPU scatter kernels copy
    a half-precision weight to float32 and back, so positions in the storage are used (this also covers transposed
    views and a subset of neurons)."""
    cols = placement.cols.long()
    if placement.rows is None and weight.dtype in (torch.float32, torch.float64):
        return _Entries(weight, cols, row_wise=True)
    rows = torch.arange(cols.shape[0], device=cols.device) if placement.rows is None else placement.rows.long()
    storage = weight.as_strided((weight.numel(),), (1,), weight.storage_offset())
    return _Entries(storage, rows[:, None] * weight.stride(0) + cols * weight.stride(1), row_wise=False)


def _locate_all(weight: torch.Tensor, placements: Sequence[Placement]) -> list[_Entries]:
    return [_locate(weight, placement) for placement in placements]


def placed_entries(weight: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The entries of `weight` at the placement, shaped like the deltas."""
    return _locate(weight, placement).read()


def _add_into(entries: Sequence[_Entries], deltas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Add each delta at its located entries; return the overwritten originals, in order.

    Positions are unique within one placement; placements of different adapters may overlap and are applied one
    after another, each reading the entries the previous one wrote.
    """
    originals = []
    for located, delta in zip(entries, deltas, strict=True):
        original = located.read()
        located.write(original + delta.detach().to(original.dtype))
        originals.append(original)
    return originals


def _write_back(entries: Sequence[_Entries], originals: Sequence[torch.Tensor]) -> None:
    """Undo `_add_into` exactly by writing the originals back in reverse order (positions may overlap)."""
    for located, original in zip(reversed(entries), reversed(originals), strict=True):
        located.write(original)


def add_deltas_(weight: torch.Tensor, placements: Sequence[Placement], deltas: Sequence[torch.Tensor]) -> list:
    """Add each delta into `weight` (d_out, d_in view) at its placement; return the overwritten originals."""
    return _add_into(_locate_all(weight, placements), deltas)


def restore_(weight: torch.Tensor, placements: Sequence[Placement], originals: Sequence[torch.Tensor]) -> None:
    """Undo `add_deltas_` exactly."""
    _write_back(_locate_all(weight, placements), originals)


@contextmanager
def deltas_added(weight: torch.Tensor, placements: Sequence[Placement], deltas: Sequence[torch.Tensor]) -> Iterator:
    """The weight with the deltas added for the duration of the block, each placement located only once."""
    with torch.no_grad():
        entries = _locate_all(weight, placements)
        originals = _add_into(entries, deltas)
    try:
        yield
    finally:
        with torch.no_grad():
            _write_back(entries, originals)


def _tuned_columns(t2d: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The output columns of the tuned neurons (all of them when `rows` is None)."""
    return t2d if rows is None else t2d.index_select(1, rows)


def sampled_weight_grad(x2d: torch.Tensor, grad2d: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The dense weight gradient `grad2d.T @ x2d` sampled at the placement, in float32, without forming it."""
    grad2d = _tuned_columns(grad2d, placement.rows)
    cols = placement.cols  # int32 or int64: index_select and CSR indices take either, so no conversion per call
    n, k = cols.shape
    if k <= _GATHER_LOOP_MAX_K or x2d.device.type not in ("cpu", "cuda") or torch.compiler.is_compiling():
        columns = [(x2d.index_select(1, cols[:, j]) * grad2d).sum(0, dtype=torch.float32) for j in range(k)]
        return torch.stack(columns, dim=1)
    row_offsets = torch.arange(0, n * k + 1, k, dtype=cols.dtype, device=cols.device)
    pattern = torch.sparse_csr_tensor(
        row_offsets,
        cols.reshape(-1),
        torch.zeros(n * k, device=cols.device),
        size=(n, x2d.shape[1]),
        check_invariants=False,
    )
    sampled = torch.sparse.sampled_addmm(pattern, grad2d.T.float(), x2d.float(), beta=0.0)
    return sampled.values().view(n, k)


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def input_for_backward(x: torch.Tensor, placements: Sequence[Placement]) -> tuple[torch.Tensor, list[Placement]]:
    """What backward needs of the layer input: the input itself, or only the columns the deltas read.

    Returns the tensor to save and the placements re-indexed into its columns. The input is kept whole when another
    layer already keeps it (saving a reference is free) or when the deltas read most of its columns.
    """
    d_in = x.shape[-1]
    selected = sum(p.cols.numel() for p in placements)
    if _INPUTS_KEPT_WHOLE.get(id(x)) is not x and selected <= 2 * d_in:
        used, local = torch.unique(torch.cat([p.cols.reshape(-1) for p in placements]).long(), return_inverse=True)
        if used.numel() <= _COMPACT_INPUT_MAX_SHARE * d_in:
            local_cols = local.split([p.cols.numel() for p in placements])
            compact = [Placement(c.view_as(p.cols), p.rows) for c, p in zip(local_cols, placements, strict=True)]
            return _flatten(x).index_select(1, used), compact
    _INPUTS_KEPT_WHOLE[id(x)] = x
    return x, list(placements)


def merged_linear(x, weight, bias, placements: Sequence[Placement], *deltas: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, W + scatter(deltas), b)` on the frozen weight's own storage, with no autograd bookkeeping."""
    with deltas_added(weight, placements, deltas):
        return F.linear(x, weight, bias)


class InplaceMergedLinear(torch.autograd.Function):
    """`merged_linear` with the deltas' gradient (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, placements, *deltas):
        out = merged_linear(x, weight, bias, placements, *deltas)
        needs_delta_grads = any(ctx.needs_input_grad[4:])
        x_saved, ctx.saved_placements = input_for_backward(x, placements) if needs_delta_grads else (None, placements)
        ctx.save_for_backward(x_saved, *deltas)
        ctx.weight, ctx.placements, ctx.input_dtype = weight, placements, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_saved, *deltas = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            with deltas_added(ctx.weight, ctx.placements, deltas):
                grad_x = (grad_out @ ctx.weight.to(grad_out.dtype)).to(ctx.input_dtype)
        grad2d = _flatten(grad_out)
        grad_deltas = [
            sampled_weight_grad(_flatten(x_saved), grad2d, placement).to(delta.dtype) if needs else None
            for placement, delta, needs in zip(ctx.saved_placements, deltas, ctx.needs_input_grad[4:], strict=True)
        ]
        return grad_x, None, None, None, *grad_deltas


@torch.library.custom_op("neuroada::scatter_to_columns", mutates_args=())
def scatter_to_columns(
    tuned_grad: torch.Tensor, cols: torch.Tensor, delta: torch.Tensor, d_in: int, dtype: torch.dtype
) -> torch.Tensor:
    """The input gradient of the bypass: `grad_x[:, cols[i, j]] += tuned_grad[:, i] * delta[i, j]`.

    An opaque op to `torch.compile`: inductor's fusion of these index_add_ loops writes out of bounds on CPU.
    """
    grad_x = tuned_grad.new_zeros(tuned_grad.shape[0], d_in, dtype=dtype)
    for j in range(cols.shape[1]):
        grad_x.index_add_(1, cols[:, j], (tuned_grad * delta[:, j]).to(dtype))
    return grad_x


@scatter_to_columns.register_fake
def _(tuned_grad: torch.Tensor, cols: torch.Tensor, delta: torch.Tensor, d_in: int, dtype: torch.dtype):
    return tuned_grad.new_empty(tuned_grad.shape[0], d_in, dtype=dtype)


class SparseBypass(torch.autograd.Function):
    """`(P ⊙ Θ) x` alone, for adding to an untouched base layer's output."""

    @staticmethod
    def forward(ctx, x, placement, out_features, delta):
        x2d = _flatten(x)
        cols = placement.cols.long()
        tuned = sum(x2d.index_select(1, cols[:, j]) * delta[:, j].to(x.dtype) for j in range(cols.shape[1]))
        if placement.rows is None:
            out = tuned
        else:
            out = x2d.new_zeros(x2d.shape[0], out_features).index_copy_(1, placement.rows.long(), tuned)
        ctx.save_for_backward(x, delta)
        ctx.placement = placement
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        x, delta = ctx.saved_tensors
        x2d, grad2d = _flatten(x), _flatten(grad_out)
        placement = ctx.placement
        grad_x = grad_delta = None
        if ctx.needs_input_grad[0]:
            tuned_grad = _tuned_columns(grad2d, placement.rows)
            grad_x = scatter_to_columns(tuned_grad, placement.cols.long(), delta, x2d.shape[1], x.dtype).view_as(x)
        if ctx.needs_input_grad[3]:
            grad_delta = sampled_weight_grad(x2d, grad2d, placement).to(delta.dtype)
        return grad_x, None, None, grad_delta
