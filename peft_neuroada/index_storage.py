"""How a layer keeps its selected input columns: int16 in memory, in a buffer every collective backend can broadcast
and every loader can load by name.

The columns are the one tensor NeuroAda keeps that LoRA has none of (SmolLM2 at k=20: 3.1M of them, 11.9 MiB as
int32), and int16 holds every column of a layer with up to 32,768 inputs. But DDP broadcasts buffers, and neither gloo
nor NCCL broadcasts int16 (gloo: `RuntimeError: Invalid scalar type`). So a layer's int16 columns are packed in pairs
into a flat int32 buffer, and everything that reads them takes its (n, k) int16 view. Wider layers keep plain (n, k)
int32 columns.

The buffer is saved as it is held: transformers' own adapter loading (`load_adapter`, `from_pretrained` on an adapter
folder) assigns saved tensors to buffers by name after comparing shapes, and calls no peft hook that could repack them.
peft's loading also reads (n, k) columns, the layout of adapters saved before.
"""

from __future__ import annotations

import sys

import torch

from .selection import INDEX_DTYPE as BUFFER_DTYPE  # the dtype selection returns: every backend broadcasts it

PACKED_DTYPE = torch.int16
_PACKED_MAX_COLUMNS = torch.iinfo(PACKED_DTYPE).max + 1
# A pair's first column is the low half of its int32 in saved files; the int16 view reads it there on little-endian
# machines only, so big-endian ones keep (n, k) int32 columns.
_PACKS = sys.byteorder == "little"


def index_dtype(size: int) -> torch.dtype:
    """Smallest integer dtype able to hold every index into a dimension of `size` entries."""
    return PACKED_DTYPE if size <= _PACKED_MAX_COLUMNS else BUFFER_DTYPE


def to_buffer(cols: torch.Tensor, d_in: int) -> torch.Tensor:
    """The (n, k) columns of a layer with `d_in` inputs as the layer stores them: int16 pairs in a flat int32 tensor
    (padded with one zero when n * k is odd), or (n, k) int32 when d_in exceeds int16."""
    if index_dtype(d_in) != PACKED_DTYPE or not _PACKS:
        return cols.to(BUFFER_DTYPE)
    flat = cols.reshape(-1).to(PACKED_DTYPE)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat.view(BUFFER_DTYPE)


def from_buffer(buffer: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """The (n, k) columns (`shape`, the deltas' shape) a buffer made by `to_buffer` holds: a view, no copy."""
    if buffer.dim() == 2:
        return buffer
    n, k = shape
    return buffer.view(PACKED_DTYPE)[: n * k].view(n, k)


def buffer_problem(buffer: torch.Tensor, shape: torch.Size | tuple[int, int], d_in: int) -> str | None:
    """What is wrong with `buffer` as the index buffer `to_buffer` makes for (n, k) columns of a layer with `d_in`
    inputs, or None. A buffer of another dtype or size holds no columns at all: viewed as int16 pairs, a cast or
    resized buffer would read as other, possibly valid, columns."""
    n, k = shape
    packed = index_dtype(d_in) == PACKED_DTYPE and _PACKS
    expected = (n * k + 1) // 2 if packed else (n, k)
    held = buffer.numel() if packed else tuple(buffer.shape)
    if buffer.dtype != BUFFER_DTYPE or buffer.dim() != (1 if packed else 2) or held != expected:
        wanted = f"{expected} int32 pairs of int16 columns" if packed else f"int32 columns of shape {expected}"
        return f"is a {buffer.dtype} tensor of shape {tuple(buffer.shape)}, where {wanted} belong"
    return None


def saved_columns(saved: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The (n, k) columns a saved index tensor holds: a packed buffer (int16 pairs in int32) or (n, k) columns.

    Unpacked arithmetically, whatever the machine's byte order; raises if the tensor cannot hold (n, k) columns."""
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
    """What makes `indices` (a layer's (n, k) columns or (n,) rows) differ from what selection makes (integers in
    [0, bound), no column twice in a row, no neuron twice), or None. Kernels and merges would write other weight
    entries otherwise. Values on the meta device are not checked."""
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        return f"have dtype {indices.dtype}, not integer"
    if indices.is_meta or not indices.numel():
        return None
    # Compared as Python ints: torch compares an int16 tensor with 32768 in int16, where it wraps to -32768.
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= bound:
        what = "inputs" if attribute == "neuroada_indices" else "outputs"
        return f"range over [{low}, {high}] but the layer has only {bound} {what}"
    if _repeats(indices):
        return "name a neuron twice" if attribute == "neuroada_rows" else "name a column twice within a neuron's row"
    return None


def checked_indices(layer: str, attribute: str, indices: torch.Tensor, bound: int) -> torch.Tensor:
    """`indices` read from a saved adapter if `index_problem` finds nothing; raises naming the layer otherwise."""
    problem = index_problem(indices, bound, attribute)
    if problem is None:
        return indices
    if problem.startswith("range"):
        raise ValueError(
            f"The NeuroAda adapter does not fit the base model at layer '{layer}': its {attribute} {problem}. "
            "Load the adapter on the base model it was trained on."
        )
    raise ValueError(
        f"The NeuroAda adapter's {attribute} for layer '{layer}' {problem}; selection never makes such indices, so "
        "the file is damaged or was edited. Save the adapter again from the model it was trained in."
    )


def _repeats(indices: torch.Tensor) -> bool:
    """Whether a row of (n, k) columns, or (n,) rows, holds one index twice."""
    if indices.is_meta or indices.shape[-1] < 2:
        return False
    ordered = indices.sort(dim=-1).values
    return bool((ordered[..., 1:] == ordered[..., :-1]).any())
