"""The products of `tuner.forward` with torch's sparse kernels and shape thresholds, measured faster on the CPU
(docs/performance.md): the deltas' gradient as k passes of gathers for small k, else torch's sampled product (SDDMM);
the bypass's `(P ⊙ Θ) x` as one gather for few (token, delta) pairs (decoding), else CSR times dense; its input
gradient as CSC times dense. On other devices, under `torch.compile` and for `transformed` operands: the tuner's.
The plugin's layers use them by default (`layers.KERNELS`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..tuner import forward
from ..tuner.forward import cast, transformed

COLUMN_LOOP_MAX_K = 4  # above, one sparse kernel beats k passes of gathers (measured on the CPU)
# Up to this many (token, delta) pairs the forward gathers the inputs it reads instead of building a sparse matrix.
GATHER_MAX_ENTRIES = 1 << 16


def _covered(*operands: Tensor) -> bool:
    """Whether torch's sparse kernels take the operands here: on the CPU, eager, and none `transformed`."""
    eager = operands[0].device.type == "cpu" and not torch.compiler.is_compiling()
    return eager and not any(map(transformed, operands))


def _check_bounds(cols: Tensor, rows: Tensor | None, d_in: int, d_out: int) -> None:
    """IndexError for out-of-range indices (the sparse kernels are built unchecked)."""
    for name, index, limit in (("cols", cols, d_in), ("rows", rows, d_out)):
        if index is None or not index.numel():
            continue
        low, high = torch.stack(index.aminmax()).tolist()
        if low < 0 or high >= limit:
            raise IndexError(f"NeuroAda sparse product: {name} has an index outside [0, {limit})")


def _pattern(cols: Tensor, d_in: int, values: Tensor) -> Tensor:
    """The (n, d_in) CSR matrix with `values` (n, k) at the columns `cols` (n, k)."""
    (n, k), flat = cols.shape, cols.reshape(-1)
    offsets = torch.arange(0, n * k + 1, k, dtype=cols.dtype, device=cols.device)
    return torch.sparse_csr_tensor(offsets, flat, values.reshape(-1), size=(n, d_in), check_invariants=False)


def token_major(t: Tensor) -> Tensor:
    """`t` (T, features) with unit token stride: itself if laid out so, else a copy laid out so."""
    if t.stride(0) == 1:
        return t
    return torch.empty_strided(t.shape, (1, t.shape[0]), dtype=t.dtype, device=t.device).copy_(t)


def _no_autocast(t: Tensor):
    """Sparse kernels run in the accumulating dtype (autocast would hand them bfloat16, which CPU CSR kernels lack)."""
    return torch.autocast(t.device.type, enabled=False)


def sampled_grad(x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None) -> Tensor:
    """The deltas' gradient as k passes of gathers (small k) or torch's sampled product (SDDMM), in float32: only
    the n * k sampled entries are computed."""
    if not _covered(x2d, grad2d):
        return forward.sampled_grad(x2d, grad2d, cols, rows)
    _check_bounds(cols, rows, x2d.shape[1], grad2d.shape[1])
    dtype = forward.accumulating(x2d, grad2d)
    tuned = cast(grad2d if rows is None else grad2d.index_select(1, rows), dtype)
    n, k = cols.shape
    if k <= COLUMN_LOOP_MAX_K:
        columns = [(cast(x2d.index_select(1, cols[:, j]), dtype) * tuned).sum(0) for j in range(k)]
        return torch.stack(columns, dim=1)
    pattern = _pattern(cols, x2d.shape[1], torch.zeros(n * k, dtype=dtype, device=cols.device))
    # Token-major operands: the kernel's own transposes of row-major ones cost it twice as much as these copies.
    with _no_autocast(x2d):
        operands = token_major(tuned).T, token_major(cast(x2d, dtype))
        return torch.sparse.sampled_addmm(pattern, *operands, beta=0.0).values().view(n, k)


def bypass_forward(x2d: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor, d_out: int) -> Tensor:
    if not _covered(x2d, delta):
        return forward.bypass_forward(x2d, cols, rows, delta, d_out)
    (n, k), tokens, dtype = cols.shape, x2d.shape[0], forward.accumulating(x2d, delta)
    if tokens * n * k <= GATHER_MAX_ENTRIES:  # (decoding) one gather of the inputs read, which checks the indices
        gathered = x2d.index_select(1, cols.reshape(-1)).view(tokens, n, k).to(dtype)
        tuned = (gathered * delta.to(dtype)).sum(-1)
    else:
        _check_bounds(cols, rows, x2d.shape[1], d_out)
        with _no_autocast(x2d):
            tuned = torch.sparse.mm(_pattern(cols, x2d.shape[1], delta.to(dtype)), x2d.to(dtype).T).T
    if rows is None:
        return tuned
    return torch.zeros(x2d.shape[0], d_out, dtype=dtype, device=x2d.device).index_add(1, rows, tuned)


def bypass_input_grad(grad2d: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor, d_in: int) -> Tensor:
    if not _covered(grad2d, delta):
        return forward.bypass_input_grad(grad2d, cols, rows, delta, d_in)
    _check_bounds(cols, rows, d_in, grad2d.shape[1])
    dtype = forward.accumulating(grad2d, delta)
    tuned = (grad2d if rows is None else grad2d.index_select(1, rows)).to(dtype)
    with _no_autocast(grad2d):
        return (_pattern(cols, d_in, delta.to(dtype)).t() @ tuned.T).T
