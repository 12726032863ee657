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
_PACKS = sys.byteorder == "little"


def index_dtype(size: int) -> torch.dtype:
    return PACKED_DTYPE if size <= _PACKED_MAX_COLUMNS else BUFFER_DTYPE


def to_buffer(cols: torch.Tensor, d_in: int) -> torch.Tensor:
    """(n, k) columns of a layer with `d_in` inputs as it stores them (int16 pairs, a zero padding an odd count)."""
    if index_dtype(d_in) != PACKED_DTYPE or not _PACKS:
        return cols.to(BUFFER_DTYPE)
    flat = cols.reshape(-1).to(PACKED_DTYPE)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat.view(BUFFER_DTYPE)


def from_buffer(buffer: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """The (n, k) columns (`shape`: the deltas') a `to_buffer` buffer holds, as a view."""
    n, k = shape
    return buffer if buffer.dim() == 2 else buffer.view(PACKED_DTYPE)[: n * k].view(n, k)


def buffer_problem(buffer: torch.Tensor, shape: torch.Size | tuple[int, int], d_in: int) -> str | None:
    """How `buffer` differs from `to_buffer`'s for (n, k) columns of `d_in` inputs, or None. Dtype and size must
    match exactly: viewed as int16 pairs, a cast or resized buffer would read as other columns."""
    n, k = shape
    packed = index_dtype(d_in) == PACKED_DTYPE and _PACKS
    expected = (n * k + 1) // 2 if packed else (n, k)
    held = buffer.numel() if packed else tuple(buffer.shape)
    if buffer.dtype != BUFFER_DTYPE or buffer.dim() != (1 if packed else 2) or held != expected:
        wanted = f"{expected} int32 pairs of int16 columns" if packed else f"int32 columns of shape {expected}"
        return f"is a {buffer.dtype} tensor of shape {tuple(buffer.shape)}, where {wanted} belong"
    return None


def saved_columns(saved: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The (n, k) columns a saved index tensor (packed or (n, k)) holds, unpacked whatever the machine's byte order."""
    n, k = shape
    if saved.dim() == 2:
        if tuple(saved.shape) != (n, k):
            raise ValueError(f"holds columns of shape {tuple(saved.shape)}, not {(n, k)}")
        return saved
    if saved.dim() != 1 or saved.dtype not in (BUFFER_DTYPE, torch.int64) or saved.numel() != (n * k + 1) // 2:
        raise ValueError(
            f"is a {saved.dtype} tensor of shape {tuple(saved.shape)}, not {(n * k + 1) // 2} int32 pairs of columns "
            f"for {(n, k)}"
        )
    pairs = saved.long()
    return torch.stack([pairs & 0xFFFF, pairs >> 16], dim=-1).reshape(-1)[: n * k].view(n, k)


def index_problem(indices: torch.Tensor, bound: int, attribute: str = "neuroada_indices") -> str | None:
    """What makes `indices` ((n, k) columns or (n,) rows) differ from selection's (integers in [0, bound), none twice
    in a row), or None: kernels and merges would write other weight entries."""
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        return f"have dtype {indices.dtype}, not integer"
    if indices.is_meta or not indices.numel():
        return None
    # Compared as Python ints: torch compares an int16 tensor with 32768 in int16, where it wraps to -32768.
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= bound:
        what = "inputs" if attribute == "neuroada_indices" else "outputs"
        return f"range over [{low}, {high}] but the layer has only {bound} {what}"
    if indices.shape[-1] > 1 and bool((indices.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        return "name a neuron twice" if attribute == "neuroada_rows" else "name a column twice within a neuron's row"
    return None
