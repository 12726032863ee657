"""Triton kernels for the three products on CUDA tensors (on CPU tensors under `TRITON_INTERPRET=1`, in the tests).

They read x and the output gradient token-major (x^T, g^T), so a program's run of adjacent tokens of one column is one
coalesced load, where row-major reads scatter (docs/performance-history.md, the Llama-7B MLP per-op table). The delta
gradient tiles flattened entries e = i * k + j (no padding for any k); the input gradient adds with float32 atomics.
Jitted on first use, so `TRITON_INTERPRET` is read then.
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import torch
from torch import Tensor

triton = tl = None  # imported on first use (half a second); the jitted kernels resolve these globals

BLOCK_TOKENS, BLOCK_ENTRIES, BLOCK_NEURONS = 64, 64, 32
TARGET_PROGRAMS = 512  # split a delta gradient's tokens until about this many programs run (an H100 has 132 SMs)


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_major(t: Tensor) -> Tensor:
    """`t` (T, features) with unit token stride: itself if laid out so, else a transposed copy."""
    return t if t.stride(0) == 1 else t.T.contiguous().T


# The kernels take token-major (T, features) tensors: element (t, f) sits at `ptr + t + f * feature_stride`.
def _sampled_grad_kernel(
    x_ptr, g_ptr, cols_ptr, rows_ptr, out_ptr, T, K, NK, tokens_per_split, x_sf, g_sf,
    HAS_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e < NK
    col = tl.load(cols_ptr + e, mask=e_mask, other=0).to(tl.int64)
    neuron = e // K
    row = tl.load(rows_ptr + neuron, mask=e_mask, other=0).to(tl.int64) if HAS_ROWS else neuron.to(tl.int64)
    t_begin = tl.program_id(1) * tokens_per_split
    t_end = tl.minimum(t_begin + tokens_per_split, T)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for t0 in range(0, tokens_per_split, BLOCK_T):  # (bounds of plain ints: older interpreters cannot loop to t_end)
        t = (t_begin + t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask = (t < t_end)[:, None] & e_mask[None, :]
        xv = tl.load(x_ptr + t[:, None] + (col * x_sf)[None, :], mask=mask, other=0.0).to(tl.float32)
        gv = tl.load(g_ptr + t[:, None] + (row * g_sf)[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += xv * gv
    tl.store(out_ptr + tl.program_id(1) * NK + e, tl.sum(acc, axis=0), mask=e_mask)


def _bypass_forward_kernel(
    x_ptr, cols_ptr, rows_ptr, delta_ptr, y_ptr, T, N, K, x_sf, y_s0,
    HAS_ROWS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    neuron = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = neuron < N
    mask = (t < T)[:, None] & n_mask[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j in range(0, K):
        col = tl.load(cols_ptr + neuron * K + j, mask=n_mask, other=0).to(tl.int64)
        d = tl.load(delta_ptr + neuron * K + j, mask=n_mask, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + t[:, None] + (col * x_sf)[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += xv * d[None, :]
    row = tl.load(rows_ptr + neuron, mask=n_mask, other=0).to(tl.int64) if HAS_ROWS else neuron.to(tl.int64)
    y_ptrs = y_ptr + t[:, None] * y_s0 + row[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _bypass_input_grad_kernel(
    g_ptr, cols_ptr, rows_ptr, delta_ptr, gx_ptr, T, N, K, g_sf, gx_sf,
    HAS_ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    neuron = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = neuron < N
    mask = (t < T)[:, None] & n_mask[None, :]
    row = tl.load(rows_ptr + neuron, mask=n_mask, other=0).to(tl.int64) if HAS_ROWS else neuron.to(tl.int64)
    gv = tl.load(g_ptr + t[:, None] + (row * g_sf)[None, :], mask=mask, other=0.0).to(tl.float32)
    for j in range(0, K):
        col = tl.load(cols_ptr + neuron * K + j, mask=n_mask, other=0).to(tl.int64)
        d = tl.load(delta_ptr + neuron * K + j, mask=n_mask, other=0.0).to(tl.float32)
        tl.atomic_add(gx_ptr + t[:, None] + (col * gx_sf)[None, :], gv * d[None, :], mask=mask)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernels (reads TRITON_INTERPRET now; tests clear this cache after setting it)."""
    global triton, tl
    if not available():
        raise RuntimeError("triton is not installed")
    import triton
    import triton.language as tl

    products = ("sampled_grad", "bypass_forward", "bypass_input_grad")
    return SimpleNamespace(**{name: triton.jit(globals()[f"_{name}_kernel"]) for name in products})


def _rows_arg(rows: Tensor | None, cols: Tensor) -> Tensor:
    return cols if rows is None else rows.contiguous()  # any valid pointer when HAS_ROWS is off


def sampled_grad(x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None) -> Tensor:
    (n, k), T = cols.shape, x2d.shape[0]
    x2d, grad2d, cols = _token_major(x2d), _token_major(grad2d), cols.contiguous()
    entry_blocks = _cdiv(n * k, BLOCK_ENTRIES)
    splits = max(1, min(_cdiv(T, BLOCK_TOKENS), TARGET_PROGRAMS // entry_blocks))
    tokens_per_split = _cdiv(_cdiv(T, splits), BLOCK_TOKENS) * BLOCK_TOKENS
    splits = _cdiv(T, tokens_per_split)
    partial = torch.empty(splits, n * k, dtype=torch.float32, device=x2d.device)
    _kernels().sampled_grad[entry_blocks, splits](
        x2d, grad2d, cols, _rows_arg(rows, cols), partial, T, k, n * k, tokens_per_split, x2d.stride(1),
        grad2d.stride(1), HAS_ROWS=rows is not None, BLOCK_E=BLOCK_ENTRIES, BLOCK_T=BLOCK_TOKENS,
    )  # fmt: skip
    return (partial[0] if splits == 1 else partial.sum(0)).view(n, k)


def bypass_forward(x2d: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor, d_out: int, out=None) -> Tensor:
    (n, k), T, accumulate = cols.shape, x2d.shape[0], out is not None
    if out is None:
        out = (torch.empty if rows is None else torch.zeros)(T, d_out, dtype=x2d.dtype, device=x2d.device)
    x2d, cols, delta = _token_major(x2d), cols.contiguous(), delta.detach().contiguous()
    _kernels().bypass_forward[_cdiv(T, BLOCK_TOKENS), _cdiv(n, BLOCK_NEURONS)](
        x2d, cols, _rows_arg(rows, cols), delta, out, T, n, k, x2d.stride(1), out.stride(0),
        HAS_ROWS=rows is not None, ACCUMULATE=accumulate, BLOCK_T=BLOCK_TOKENS, BLOCK_N=BLOCK_NEURONS,
    )  # fmt: skip
    return out


def bypass_input_grad(
    grad2d: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor, d_in: int, dtype: torch.dtype, out=None
) -> Tensor:
    (n, k), T = cols.shape, grad2d.shape[0]
    grad_x = torch.zeros(d_in, T, dtype=torch.float32, device=grad2d.device).T  # token-major, for the atomics
    grad2d, cols, delta = _token_major(grad2d), cols.contiguous(), delta.detach().contiguous()
    _kernels().bypass_input_grad[_cdiv(T, BLOCK_TOKENS), _cdiv(n, BLOCK_NEURONS)](
        grad2d, cols, _rows_arg(rows, cols), delta, grad_x, T, n, k, grad2d.stride(1), grad_x.stride(1),
        HAS_ROWS=rows is not None, BLOCK_T=BLOCK_TOKENS, BLOCK_N=BLOCK_NEURONS,
    )  # fmt: skip
    return out.add_(grad_x) if out is not None else grad_x.to(dtype, memory_format=torch.contiguous_format)
