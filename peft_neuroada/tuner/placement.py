"""Where an adapter's deltas sit in a weight, and reading or writing exactly those entries (merge, unmerge)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Placement(NamedTuple):
    """Where one adapter's deltas sit in a (d_out, d_in) weight: delta[i, j] belongs to input `cols[i, j]` of neuron
    `rows[i]`, or of neuron `i` when every neuron is tuned (`rows` is None). A named tuple: `torch.func` transforms
    find its tensors among an autograd Function's arguments."""

    cols: torch.Tensor
    rows: torch.Tensor | None = None

    def copy(self, device: torch.device | None = None) -> Placement:
        """A copy owning its indices (a merge's record must not follow later writes); with `device`, moved there."""
        copy = (lambda t: t.clone()) if device is None else (lambda t: t.to(device))
        return Placement(copy(self.cols), None if self.rows is None else copy(self.rows))


def unique_columns(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted distinct input columns `cols` reads, and `cols` as positions among them (in cols' dtype)."""
    used, local = torch.unique(cols.reshape(-1).long(), return_inverse=True)
    return used, local.to(cols.dtype).view(cols.shape)


def entry_index(weight: torch.Tensor, placement: Placement) -> tuple[torch.Tensor, ...]:
    """The placement's entries of a (d_out, d_in) `weight`, or an (E, d_out, d_in) stack, as an index tuple shaped like
    the deltas (a stack counts its neurons expert after expert: neuron `e * d_out + i`). Indexing the tensor itself
    reads and writes any strides, a transposed view's included."""
    cols = placement.cols.long()
    rows = torch.arange(cols.shape[0], device=cols.device) if placement.rows is None else placement.rows.long()
    if weight.dim() == 3:
        expert, rows = rows.div(weight.shape[1], rounding_mode="floor"), rows.remainder(weight.shape[1])
        return expert[:, None], rows[:, None], cols
    return rows[:, None], cols


def placed_entries(weight: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The entries of `weight` at the placement, shaped like the deltas."""
    return weight.detach()[entry_index(weight, placement)]


def write_placed_(weight: torch.Tensor, placement: Placement, values: torch.Tensor) -> None:
    """Write `values` at the placement through `weight.data`: the version counter does not move, so another graph
    that saved the weight still runs its backward (a merge is the model's new weight, as LoRA's merge through
    `weight.data` makes it)."""
    weight.data.index_put_(entry_index(weight, placement), values)
