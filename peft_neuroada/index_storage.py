"""How a layer keeps its selected input columns: int16 in memory, in a buffer every collective backend can broadcast.

The columns are the one tensor NeuroAda keeps that LoRA has none of (SmolLM2 at k=20: 3.1M of them, 11.9 MiB as
int32), and int16 holds every column of a layer with up to 32,768 inputs. But DDP broadcasts buffers, and neither gloo
nor NCCL broadcasts int16 (gloo: `RuntimeError: Invalid scalar type`). So a layer's int16 columns are packed in pairs
into a flat int32 buffer, and everything that reads them takes its (n, k) int16 view. Wider layers keep plain (n, k)
int32 columns. On disk columns are always (n, k), in the smallest dtype that holds them (`index_dtype`).
"""

from __future__ import annotations

import torch

from .selection import INDEX_DTYPE as BUFFER_DTYPE  # the dtype selection returns: every backend broadcasts it

PACKED_DTYPE = torch.int16
_PACKED_MAX_COLUMNS = torch.iinfo(PACKED_DTYPE).max + 1


def index_dtype(size: int) -> torch.dtype:
    """Smallest integer dtype able to hold every index into a dimension of `size` entries (the saved dtype)."""
    return PACKED_DTYPE if size <= _PACKED_MAX_COLUMNS else BUFFER_DTYPE


def to_buffer(cols: torch.Tensor, d_in: int) -> torch.Tensor:
    """The (n, k) columns of a layer with `d_in` inputs as the layer stores them: int16 pairs in a flat int32 tensor
    (padded with one zero when n * k is odd), or (n, k) int32 when d_in exceeds int16."""
    if index_dtype(d_in) != PACKED_DTYPE:
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
