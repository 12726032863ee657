"""The sparse bypass `(P ⊙ Θ) x` and its gradients.

Two autograd paths share the same primitives:

* `InplaceMergedLinear` (fast path): adds the deltas into the k selected entries of each row of the frozen weight,
  runs the ordinary dense matmul, and writes the saved original entries back bit-exactly. Forward and input gradient
  therefore cost exactly one dense matmul each, like a frozen layer, and nothing of size d_out x d_in is allocated.
* `SparseBypass` (general path): `base(x) + bypass(x)` computed with gathers, for weights that must not be touched
  (quantized, sharded, trainable, or traced by `torch.compile`).

Both save only the layer input for backward; the delta gradient is the dense weight gradient sampled at the selected
positions, computed without forming it: `grad[i, j] = sum_t grad_out[t, i] * x[t, idx[i, j]]`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# Above this k, a sampled sparse-dense matmul (one kernel) beats k gather passes for the delta gradient on CPU.
_GATHER_LOOP_MAX_K = 4


def add_deltas_(weight: torch.Tensor, indices: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor]) -> list:
    """Add each delta into `weight` (d_out, d_in view) at its indices; return the overwritten originals, in order."""
    originals = []
    for idx, delta in zip(indices, deltas, strict=True):
        idx = idx.long()
        originals.append(weight.gather(1, idx))
        weight.scatter_add_(1, idx, delta.detach().to(weight.dtype))
    return originals


def restore_(weight: torch.Tensor, indices: Sequence[torch.Tensor], originals: Sequence[torch.Tensor]) -> None:
    """Undo `add_deltas_` exactly by writing the originals back in reverse order (positions may overlap)."""
    for idx, original in zip(reversed(indices), reversed(originals), strict=True):
        weight.scatter_(1, idx.long(), original)


@contextmanager
def deltas_added(weight: torch.Tensor, indices: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor]) -> Iterator:
    with torch.no_grad():
        originals = add_deltas_(weight, indices, deltas)
    try:
        yield
    finally:
        with torch.no_grad():
            restore_(weight, indices, originals)


def sampled_weight_grad(x2d: torch.Tensor, grad2d: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`(grad2d.T @ x2d)` sampled at `idx` (d_out, k), in float32, without forming the d_out x d_in product."""
    idx = idx.long()
    k = idx.shape[1]
    if k <= _GATHER_LOOP_MAX_K or x2d.device.type not in ("cpu", "cuda"):
        columns = [(x2d.index_select(1, idx[:, j]) * grad2d).sum(0, dtype=torch.float32) for j in range(k)]
        return torch.stack(columns, dim=1)
    d_out, d_in = idx.shape[0], x2d.shape[1]
    row_offsets = torch.arange(0, d_out * k + 1, k, device=idx.device)
    pattern = torch.sparse_csr_tensor(
        row_offsets,
        idx.reshape(-1),
        torch.zeros(d_out * k, device=idx.device),
        size=(d_out, d_in),
        check_invariants=False,
    )
    sampled = torch.sparse.sampled_addmm(pattern, grad2d.T.float(), x2d.float(), beta=0.0)
    return sampled.values().view(d_out, k)


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class InplaceMergedLinear(torch.autograd.Function):
    """`F.linear(x, W + scatter(deltas), b)` on the frozen weight's own storage (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, indices, *deltas):
        with deltas_added(weight, indices, deltas):
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, *deltas)
        ctx.weight, ctx.indices = weight, indices
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *deltas = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            with deltas_added(ctx.weight, ctx.indices, deltas):
                grad_x = (grad_out @ ctx.weight.to(grad_out.dtype)).to(x.dtype)
        x2d, grad2d = _flatten(x), _flatten(grad_out)
        grad_deltas = [
            sampled_weight_grad(x2d, grad2d, idx).to(delta.dtype) if needs else None
            for idx, delta, needs in zip(ctx.indices, deltas, ctx.needs_input_grad[4:], strict=True)
        ]
        return grad_x, None, None, None, *grad_deltas


class SparseBypass(torch.autograd.Function):
    """`(P ⊙ Θ) x` alone, for adding to an untouched base layer's output."""

    @staticmethod
    def forward(ctx, x, idx, delta):
        x2d = _flatten(x)
        idx_long = idx.long()
        out = sum(x2d.index_select(1, idx_long[:, j]) * delta[:, j].to(x.dtype) for j in range(idx.shape[1]))
        ctx.save_for_backward(x, idx, delta)
        return out.view(*x.shape[:-1], idx.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, idx, delta = ctx.saved_tensors
        x2d, grad2d = _flatten(x), _flatten(grad_out)
        grad_x = grad_delta = None
        if ctx.needs_input_grad[0]:
            idx_long = idx.long()
            grad_x = torch.zeros_like(x2d)
            for j in range(idx.shape[1]):
                grad_x.index_add_(1, idx_long[:, j], (grad2d * delta[:, j]).to(x.dtype))
            grad_x = grad_x.view_as(x)
        if ctx.needs_input_grad[2]:
            grad_delta = sampled_weight_grad(x2d, grad2d, idx).to(delta.dtype)
        return grad_x, None, grad_delta
