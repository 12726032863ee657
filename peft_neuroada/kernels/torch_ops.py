"""The three products in plain torch ops: the reference and the fallback on every device.

What `functional.py` computed before the compiled kernels: a loop over the k columns for small k, one sampled
sparse-dense matmul (cuSPARSE on CUDA, MKL on CPU) for the delta gradient at larger k, a CSR matmul for the forward
at larger k, and `index_add_` for the input gradient. Traceable by `torch.compile` and deterministic where torch is.
"""

from __future__ import annotations

import torch

# Above this k, one sparse kernel beats k passes of gathers (measured for the delta gradient on CPU; see
# docs/design.md, "Per op").
COLUMN_LOOP_MAX_K = 4


def _check_bounds(cols: torch.Tensor, rows: torch.Tensor | None, d_in: int, d_out: int) -> None:
    """Out-of-range indices raise IndexError, as in the C kernels. Eager CPU only: on CUDA the check would
    synchronize, and under torch.compile it would break the graph (placements are checked when a layer is built)."""
    if cols.device.type != "cpu" or torch.compiler.is_compiling():
        return
    for name, index, limit in (("cols", cols, d_in), ("rows", rows, d_out)):
        # Python ints: an int16 index compared with a tensor op against 32768 would wrap to -32768.
        if index is not None and index.numel() and (int(index.min()) < 0 or int(index.max()) >= limit):
            raise IndexError(f"NeuroAda sparse product: {name} has an index outside [0, {limit})")


def _widened(index: torch.Tensor | None) -> torch.Tensor | None:
    """int16 indices (layers store columns so) as int32, which index_select and the sparse kernels take."""
    return index.int() if index is not None and index.dtype == torch.int16 else index


def _indices(cols: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _widened(cols), _widened(rows)


def _tuned_columns(t2d: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t2d if rows is None else t2d.index_select(1, rows)


def _pattern(cols: torch.Tensor, d_in: int, values: torch.Tensor) -> torch.Tensor:
    """The (n, d_in) CSR matrix with `values` (n, k) at the columns `cols` (n, k)."""
    n, k = cols.shape
    row_offsets = torch.arange(0, n * k + 1, k, dtype=cols.dtype, device=cols.device)
    return torch.sparse_csr_tensor(
        row_offsets, cols.reshape(-1), values.reshape(-1), size=(n, d_in), check_invariants=False
    )


def _sparse_kernels_cover(t: torch.Tensor, k: int) -> bool:
    return k > COLUMN_LOOP_MAX_K and t.device.type in ("cpu", "cuda") and not torch.compiler.is_compiling()


def sampled_grad(
    x2d: torch.Tensor, grad2d: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    cols, rows = _indices(cols, rows)
    _check_bounds(cols, rows, x2d.shape[1], grad2d.shape[1])
    tuned = _tuned_columns(grad2d, rows).float()
    n, k = cols.shape
    if not _sparse_kernels_cover(x2d, k):
        out = torch.zeros(n, k, dtype=torch.float32, device=x2d.device)
        for j in range(k):
            out[:, j] = (x2d.index_select(1, cols[:, j]).float() * tuned).sum(0)
        return out
    pattern = _pattern(cols, x2d.shape[1], torch.zeros(n * k, device=cols.device))
    return torch.sparse.sampled_addmm(pattern, tuned.T, x2d.float(), beta=0.0).values().view(n, k)


def bypass_forward(
    x2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_out: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    cols, rows = _indices(cols, rows)
    _check_bounds(cols, rows, x2d.shape[1], d_out)
    n, k = cols.shape
    if _sparse_kernels_cover(x2d, k):
        tuned = torch.sparse.mm(_pattern(cols, x2d.shape[1], delta.float()), x2d.float().T).T
    else:
        tuned = torch.zeros(x2d.shape[0], n, dtype=torch.float32, device=x2d.device)
        for j in range(k):
            tuned += x2d.index_select(1, cols[:, j]).float() * delta[:, j].float()
    if out is None and rows is None:
        return tuned.to(x2d.dtype)
    if out is None:
        out = torch.zeros(x2d.shape[0], d_out, dtype=x2d.dtype, device=x2d.device)
    return out.add_(tuned) if rows is None else out.index_add_(1, rows, tuned.to(out.dtype))


def bypass_input_grad(
    grad2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_in: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    cols, rows = _indices(cols, rows)
    _check_bounds(cols, rows, d_in, grad2d.shape[1])
    tuned = _tuned_columns(grad2d, rows).float()
    grad_x = torch.zeros(grad2d.shape[0], d_in, dtype=torch.float32, device=grad2d.device)
    for j in range(cols.shape[1]):
        grad_x.index_add_(1, cols[:, j], tuned * delta[:, j].float())
    return grad_x.to(dtype) if out is None else out.add_(grad_x)
