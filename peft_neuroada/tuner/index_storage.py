"""How a layer keeps its selected input columns: one (n, k) int32 tensor per adapter, saved as held, as Super-Tuning
keeps its indices (int32: DDP broadcasts buffers, and gloo and NCCL broadcast int32, not int16).

Adapters saved before 2026-12-05 hold int16 columns packed in pairs into a flat int32 tensor (the first column of a
pair in the low half); `saved_columns` reads them, and (n, k) columns of any integer dtype, on any host."""

from __future__ import annotations

import torch

from .selection import INDEX_DTYPE as BUFFER_DTYPE


def index_range(indices: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest of non-empty `indices`, as Python ints."""
    low, high = torch.stack(indices.aminmax()).tolist()
    return low, high


def saved_columns(saved: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The (n, k) columns a saved index tensor holds: (n, k) columns, or an older adapter's packed pairs."""
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
