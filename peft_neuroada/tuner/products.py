"""The three sparse products of the bypass and the deltas' gradient, one torch kernel each: `sampled_grad` (the dense
weight gradient at the placement, SDDMM), `bypass_forward` (`(P ⊙ Θ) x`, CSR times dense) and `bypass_input_grad` (its
transpose, CSC times dense). Where torch has no sparse kernels (other devices, `torch.compile`, `transformed` operands)
they run as k passes of gathers, as `sampled_grad` does for small k (faster, measured on the CPU). On CUDA
`sampled_grad` is `gathered_grad`, one half-precision GEMM gathered at the placement. They compute in float32, or in
float64 where an operand is float64.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad

COLUMN_LOOP_MAX_K = 4  # above, one sparse kernel beats k passes of gathers (measured on the CPU)
# Up to this many (token, delta) pairs the forward gathers the inputs it reads instead of building a sparse matrix.
GATHER_MAX_ENTRIES = 1 << 16


def _check_bounds(cols: Tensor, rows: Tensor | None, d_in: int, d_out: int) -> None:
    """IndexError for out-of-range indices (the sparse kernels are built unchecked). Eager CPU only: on CUDA the check
    would synchronize, under torch.compile break the graph (placements are checked when a layer is built)."""
    if cols.device.type != "cpu" or torch.compiler.is_compiling():
        return
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


def transformed(t: Tensor) -> bool:
    """Whether a `torch.func` transform wraps `t` or forward-mode AD follows it (sparse kernels serve neither); traced,
    False: dynamo handles transforms itself."""
    if torch.compiler.is_compiling():
        return False
    return torch.func.debug_unwrap(t) is not t or forward_ad.unpack_dual(t).tangent is not None


def _sparse_kernels_cover(*operands: Tensor) -> bool:
    """Whether torch's sparse kernels take the operands: on the CPU and CUDA, eager, and none `transformed`."""
    eager = operands[0].device.type in ("cpu", "cuda") and not torch.compiler.is_compiling()
    return eager and not any(map(transformed, operands))


def token_major(t: Tensor) -> Tensor:
    """`t` (T, features) with unit token stride: itself if laid out so, else a copy laid out so."""
    if t.stride(0) == 1:
        return t
    return torch.empty_strided(t.shape, (1, t.shape[0]), dtype=t.dtype, device=t.device).copy_(t)


def _accumulating(a: Tensor, b: Tensor) -> torch.dtype:
    """float32, or float64 where an operand is: the products never accumulate in a dtype narrower than float32."""
    return torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` in `dtype`: itself where it already is (a `to` that does nothing is still an operator called per layer)."""
    return t if t.dtype == dtype else t.to(dtype)


def _no_autocast(t: Tensor):
    """Sparse kernels run in the accumulating dtype (autocast would hand them bfloat16, which CPU CSR kernels lack)."""
    return torch.autocast(t.device.type, enabled=False)


def sampled_grad(x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None) -> Tensor:
    """The deltas' gradient: `gathered_grad` on CUDA, `sparse_sampled_grad` elsewhere (each the faster there)."""
    return (gathered_grad if x2d.device.type == "cuda" else sparse_sampled_grad)(x2d, grad2d, cols, rows)


def sparse_sampled_grad(x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None) -> Tensor:
    """The deltas' gradient as k passes of gathers (small k, or where torch's sparse kernels do not run) or torch's
    sampled product (SDDMM), in float32: only the n * k sampled entries are computed."""
    _check_bounds(cols, rows, x2d.shape[1], grad2d.shape[1])
    dtype = _accumulating(x2d, grad2d)
    tuned = cast(grad2d if rows is None else grad2d.index_select(1, rows), dtype)
    n, k = cols.shape
    if k <= COLUMN_LOOP_MAX_K or not _sparse_kernels_cover(x2d, grad2d):
        columns = [(cast(x2d.index_select(1, cols[:, j]), dtype) * tuned).sum(0) for j in range(k)]
        return torch.stack(columns, dim=1)
    pattern = _pattern(cols, x2d.shape[1], torch.zeros(n * k, dtype=dtype, device=cols.device))
    # Token-major operands: the kernel's own transposes of row-major ones cost it twice as much as these copies.
    with _no_autocast(x2d):
        operands = token_major(tuned).T, token_major(cast(x2d, dtype))
        return torch.sparse.sampled_addmm(pattern, *operands, beta=0.0).values().view(n, k)


def gathered_grad(x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None) -> Tensor:
    """`sampled_grad` as the dense weight gradient of the tuned neurons, gathered at the placement: one GEMM on the
    operands in their own dtype, accumulated and returned in float32 (`out_dtype` on CUDA), whatever k is. On a GPU
    a half-precision GEMM runs on tensor cores, where cuSPARSE's sampled product has float32 kernels only and runs at
    an fp32 GEMM's speed; the (n, d_in) float32 gradient lives for the gather."""
    tuned = grad2d if rows is None else grad2d.index_select(1, rows)
    half = x2d.dtype == tuned.dtype in (torch.float16, torch.bfloat16)
    with _no_autocast(x2d):
        # The out_dtype GEMM, eager or compiled (inductor lowers it); transforms take the float32 one.
        if half and x2d.device.type == "cuda" and not (transformed(x2d) or transformed(tuned)):
            dense = torch.mm(tuned.T, x2d, out_dtype=torch.float32)
        else:
            dtype = _accumulating(x2d, tuned)
            dense = cast(tuned, dtype).T @ cast(x2d, dtype)
    return dense.gather(1, cols.long())


def bypass_forward(x2d: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor, d_out: int) -> Tensor:
    (n, k), tokens, dtype = cols.shape, x2d.shape[0], _accumulating(x2d, delta)
    if tokens * n * k <= GATHER_MAX_ENTRIES:  # (decoding) one gather of the inputs read, which checks the indices
        gathered = x2d.index_select(1, cols.reshape(-1)).view(tokens, n, k).to(dtype)
        tuned = (gathered * delta.to(dtype)).sum(-1)
    elif _sparse_kernels_cover(x2d, delta):
        _check_bounds(cols, rows, x2d.shape[1], d_out)
        with _no_autocast(x2d):
            tuned = torch.sparse.mm(_pattern(cols, x2d.shape[1], delta.to(dtype)), x2d.to(dtype).T).T
    else:
        tuned = sum(x2d.index_select(1, cols[:, j]).to(dtype) * delta[:, j].to(dtype) for j in range(k))
    if rows is None:
        return tuned
    return torch.zeros(x2d.shape[0], d_out, dtype=dtype, device=x2d.device).index_add(1, rows, tuned)


def bypass_input_grad(grad2d: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor, d_in: int) -> Tensor:
    _check_bounds(cols, rows, d_in, grad2d.shape[1])
    dtype = _accumulating(grad2d, delta)
    tuned = (grad2d if rows is None else grad2d.index_select(1, rows)).to(dtype)
    if _sparse_kernels_cover(grad2d, delta):
        with _no_autocast(grad2d):
            return (_pattern(cols, d_in, delta.to(dtype)).t() @ tuned.T).T
    grad_x = torch.zeros(grad2d.shape[0], d_in, dtype=dtype, device=grad2d.device)
    for j in range(cols.shape[1]):
        grad_x.index_add_(1, cols[:, j], tuned * delta[:, j].to(dtype))
    return grad_x
