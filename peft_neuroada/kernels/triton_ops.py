"""Triton kernels for the three products, for CUDA tensors (and CPU tensors under `TRITON_INTERPRET=1`, which is how
the test suite checks them on a machine without a GPU).

All three read the token-major layout the issue on these kernels calls the dot-product layout: x and the output
gradient as (T, features) with the tokens adjacent in memory (x^T and g^T contiguous, one copy each per call unless the
caller's tensor is laid out so already). A program owns a tile of tokens x placement entries (or neurons) and reads,
for each entry, a run of adjacent tokens of one input column: one coalesced load where the (T, features) row-major
layout reads one scattered element per token (on an H100 that layout made the k=20 delta gradient of a 4096-token
4096 -> 11008 layer cost 1.12 matmuls and the input gradient 4.1).

* delta gradient: a program owns a block of flattened entries e = i * k + j (so neurons of any k pack the tile with
  no padding) and a slice of the tokens, multiplies `x[t, cols[e]]` by `grad[t, rows[e // k]]` and reduces over
  tokens once at the end. Short inputs are split over more token slices, whose float32 partial sums are added after.
* forward: a program owns a tile of tokens x neurons and loops over the k inputs of its neurons.
* input gradient: the same tiles, adding `grad * delta` with atomics into a token-major float32 buffer (duplicates
  sum; adjacent tokens' atomics coalesce); the dispatcher uses the torch ops instead when deterministic algorithms are
  requested.

Every kernel accumulates in float32. They are jitted on first use rather than at import, so `TRITON_INTERPRET` is
read when they are first needed. Timings on an H100: docs/performance.md ("GPU: one H100").
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import torch

# Imported on first use (half a second; the names are globals that the jitted kernels resolve).
triton = tl = None

BLOCK_TOKENS = 64
BLOCK_ENTRIES = 64
BLOCK_NEURONS = 32
# Split the tokens of a delta gradient until about this many programs run (an H100 has 132 SMs).
TARGET_PROGRAMS = 512


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """`t` (T, features) with unit token stride: a view of itself if it is laid out so, else a transposed copy."""
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
    if HAS_ROWS:
        row = tl.load(rows_ptr + neuron, mask=e_mask, other=0).to(tl.int64)
    else:
        row = neuron.to(tl.int64)
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
    if HAS_ROWS:
        row = tl.load(rows_ptr + neuron, mask=n_mask, other=0).to(tl.int64)
    else:
        row = neuron.to(tl.int64)
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
    if HAS_ROWS:
        row = tl.load(rows_ptr + neuron, mask=n_mask, other=0).to(tl.int64)
    else:
        row = neuron.to(tl.int64)
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

    return SimpleNamespace(
        sampled_grad=triton.jit(_sampled_grad_kernel),
        bypass_forward=triton.jit(_bypass_forward_kernel),
        bypass_input_grad=triton.jit(_bypass_input_grad_kernel),
    )


def _rows_arg(rows: torch.Tensor | None, cols: torch.Tensor) -> torch.Tensor:
    return cols if rows is None else rows.contiguous()  # any valid pointer when HAS_ROWS is off


def sampled_grad(
    x2d: torch.Tensor, grad2d: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    n, k = cols.shape
    T = x2d.shape[0]
    x2d, grad2d, cols = _token_major(x2d), _token_major(grad2d), cols.contiguous()
    entry_blocks = _cdiv(n * k, BLOCK_ENTRIES)
    splits = max(1, min(_cdiv(T, BLOCK_TOKENS), TARGET_PROGRAMS // entry_blocks))
    tokens_per_split = _cdiv(_cdiv(T, splits), BLOCK_TOKENS) * BLOCK_TOKENS
    splits = _cdiv(T, tokens_per_split)
    partial = torch.empty(splits, n * k, dtype=torch.float32, device=x2d.device)
    _kernels().sampled_grad[(entry_blocks, splits)](
        x2d, grad2d, cols, _rows_arg(rows, cols), partial, T, k, n * k, tokens_per_split,
        x2d.stride(1), grad2d.stride(1),
        HAS_ROWS=rows is not None, BLOCK_E=BLOCK_ENTRIES, BLOCK_T=BLOCK_TOKENS,
    )  # fmt: skip
    return (partial[0] if splits == 1 else partial.sum(0)).view(n, k)


def bypass_forward(
    x2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_out: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k = cols.shape
    T = x2d.shape[0]
    accumulate = out is not None
    if out is None:
        out = (torch.empty if rows is None else torch.zeros)(T, d_out, dtype=x2d.dtype, device=x2d.device)
    x2d, cols, delta = _token_major(x2d), cols.contiguous(), delta.detach().contiguous()
    grid = (_cdiv(T, BLOCK_TOKENS), _cdiv(n, BLOCK_NEURONS))
    _kernels().bypass_forward[grid](
        x2d, cols, _rows_arg(rows, cols), delta, out, T, n, k, x2d.stride(1), out.stride(0),
        HAS_ROWS=rows is not None, ACCUMULATE=accumulate, BLOCK_T=BLOCK_TOKENS, BLOCK_N=BLOCK_NEURONS,
    )  # fmt: skip
    return out


def bypass_input_grad(
    grad2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_in: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k = cols.shape
    T = grad2d.shape[0]
    grad_x = torch.zeros(d_in, T, dtype=torch.float32, device=grad2d.device).T  # token-major, for the atomics
    grad2d, cols, delta = _token_major(grad2d), cols.contiguous(), delta.detach().contiguous()
    grid = (_cdiv(T, BLOCK_TOKENS), _cdiv(n, BLOCK_NEURONS))
    _kernels().bypass_input_grad[grid](
        grad2d, cols, _rows_arg(rows, cols), delta, grad_x, T, n, k, grad2d.stride(1), grad_x.stride(1),
        HAS_ROWS=rows is not None, BLOCK_T=BLOCK_TOKENS, BLOCK_N=BLOCK_NEURONS,
    )  # fmt: skip
    if out is not None:
        return out.add_(grad_x)
    return grad_x.to(dtype, memory_format=torch.contiguous_format)
