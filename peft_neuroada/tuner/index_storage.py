"""How a layer keeps its selected input columns: int16 (enough for up to 32,768 inputs) halves the one tensor LoRA
has no counterpart of. DDP broadcasts buffers and neither gloo nor NCCL broadcasts int16, so the columns are packed
in pairs into a flat int32 buffer, read through an (n, k) int16 view; wider layers keep (n, k) int32. The buffer is
saved as held: transformers' adapter loading assigns saved tensors to buffers by name, with no peft hook to repack."""

from __future__ import annotations

import sys

import torch

from .selection import INDEX_DTYPE as BUFFER_DTYPE

PACKED_DTYPE = torch.int16
_PACKED_MAX_COLUMNS = torch.iinfo(PACKED_DTYPE).max + 1
# Saved files hold a pair's first column in the low half of its int32, where the int16 view reads it on little-endian
# machines only: big-endian ones keep (n, k) int32 columns.
PACKS_PAIRS = sys.byteorder == "little"


def index_dtype(size: int) -> torch.dtype:
    return PACKED_DTYPE if size <= _PACKED_MAX_COLUMNS else BUFFER_DTYPE


def index_range(indices: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest of non-empty `indices`, as Python ints: torch compares an int16 tensor with 32768 in
    int16, where it wraps to -32768."""
    low, high = torch.stack(indices.aminmax()).tolist()
    return low, high


def to_buffer(cols: torch.Tensor, d_in: int) -> torch.Tensor:
    """(n, k) columns of a layer with `d_in` inputs as it stores them (int16 pairs, a zero padding an odd count)."""
    if index_dtype(d_in) != PACKED_DTYPE or not PACKS_PAIRS:
        return cols.to(BUFFER_DTYPE)
    flat = cols.reshape(-1).to(PACKED_DTYPE)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat.view(BUFFER_DTYPE)


def from_buffer(buffer: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """The (n, k) columns (`shape`: the deltas') a `to_buffer` buffer holds, as a view."""
    n, k = shape
    return buffer if buffer.dim() == 2 else buffer.view(PACKED_DTYPE)[: n * k].view(n, k)
