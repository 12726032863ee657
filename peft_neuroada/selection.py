"""Which inputs of each neuron get a trainable delta.

Selection runs once, at injection, on the frozen weight. It works on blocks of rows so the transient `|W|` never
exceeds a fixed number of elements, and it returns only a (d_out, k) index matrix: no dense mask is ever built.
"""

from __future__ import annotations

import torch

_MAX_BLOCK_ELEMENTS = 1 << 24


def index_dtype(in_features: int) -> torch.dtype:
    """Smallest integer dtype able to hold every column index of a layer with `in_features` inputs."""
    return torch.int16 if in_features <= torch.iinfo(torch.int16).max + 1 else torch.int32


def _top_k_block(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k column indices per row; among equal magnitudes the lower column index wins."""
    indices = magnitude.topk(k, dim=1).indices
    kth_largest = magnitude.gather(1, indices[:, -1:])
    ambiguous_rows = ((magnitude >= kth_largest).sum(dim=1) > k).nonzero().squeeze(1)
    if ambiguous_rows.numel():
        stable_order = magnitude[ambiguous_rows].sort(dim=1, descending=True, stable=True).indices
        indices[ambiguous_rows] = stable_order[:, :k]
    return indices


def select_top_magnitude(weight: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of `weight` (d_out, d_in), the `k` columns of largest |w|, sorted ascending, in a compact int dtype."""
    d_out, d_in = weight.shape
    rows_per_block = max(1, _MAX_BLOCK_ELEMENTS // d_in)
    selected = torch.empty(d_out, k, dtype=index_dtype(d_in), device=weight.device)
    with torch.no_grad():
        for start in range(0, d_out, rows_per_block):
            block = weight[start : start + rows_per_block].abs()
            selected[start : start + rows_per_block] = _top_k_block(block, k).sort(dim=1).values
    return selected
