"""The deltas' gradient (the dense weight gradient sampled at the placement, `tuner.forward.sampled_grad`'s
contract) as a Triton kernel on CUDA tensors; on other tensors, the plugin's products (`sparse_products`). Under
`TRITON_INTERPRET=1` it also runs on CPU tensors, which is how the tests check it. float64 operands take the exact
products.

The kernel reads x and the output gradient token-major, so a program's run of adjacent tokens of one column is one
coalesced load; it tiles the flattened entries e = i * k + j (no padding for any k) and splits the tokens until about
`TARGET_PROGRAMS` programs run, summing the splits' partial sums in float32. Jitted on first use.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from ..tuner import forward
from . import sparse_products
from .sparse_products import token_major

triton = tl = None  # imported on first use; the jitted kernel resolves these globals
BLOCK_TOKENS, BLOCK_ENTRIES = 64, 64
TARGET_PROGRAMS = 512


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _runs_on(t: Tensor) -> bool:
    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    for t0 in range(0, tokens_per_split, BLOCK_T):
        t = (t_begin + t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask = (t < t_end)[:, None] & e_mask[None, :]
        xv = tl.load(x_ptr + t[:, None] + (col * x_sf)[None, :], mask=mask, other=0.0).to(tl.float32)
        gv = tl.load(g_ptr + t[:, None] + (row * g_sf)[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += xv * gv
    tl.store(out_ptr + tl.program_id(1) * NK + e, tl.sum(acc, axis=0), mask=e_mask)


@functools.cache
def _kernel():
    global triton, tl
    import triton
    import triton.language as tl

    return triton.jit(_sampled_grad_kernel)


def sampled_grad(x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None) -> Tensor:
    """The kernel accumulates in float32: float64 operands take the plugin's products, which accumulate in float64."""
    exact_elsewhere = forward.accumulating(x2d, grad2d) != torch.float32
    if exact_elsewhere or not _runs_on(x2d) or torch.compiler.is_compiling():
        return sparse_products.sampled_grad(x2d, grad2d, cols, rows)
    (n, k), tokens = cols.shape, x2d.shape[0]
    if n * k == 0 or tokens == 0:
        return torch.zeros(n, k, dtype=torch.float32, device=x2d.device)
    x2d, grad2d, cols = token_major(x2d), token_major(grad2d), cols.contiguous()
    entry_blocks = _cdiv(n * k, BLOCK_ENTRIES)
    splits = max(1, min(_cdiv(tokens, BLOCK_TOKENS), TARGET_PROGRAMS // entry_blocks))
    tokens_per_split = _cdiv(_cdiv(tokens, splits), BLOCK_TOKENS) * BLOCK_TOKENS
    splits = _cdiv(tokens, tokens_per_split)
    partial = torch.empty(splits, n * k, dtype=torch.float32, device=x2d.device)
    rows_arg = cols if rows is None else rows.contiguous()  # any valid pointer when HAS_ROWS is off
    _kernel()[entry_blocks, splits](
        x2d, grad2d, cols, rows_arg, partial, tokens, k, n * k, tokens_per_split, x2d.stride(1), grad2d.stride(1),
        HAS_ROWS=rows is not None, BLOCK_E=BLOCK_ENTRIES, BLOCK_T=BLOCK_TOKENS,
    )  # fmt: skip
    return partial.sum(0).view(n, k)
