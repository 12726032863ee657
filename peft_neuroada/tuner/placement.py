"""Where an adapter's deltas sit in a weight, and reading or writing exactly those entries (merge, unmerge)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .products import transformed

# Backward keeps only the input columns the deltas read when they are at most this share of the input.
COMPACT_INPUT_MAX_SHARE = 0.5


class Placement(NamedTuple):
    """Where one adapter's deltas sit in a (d_out, d_in) weight: delta[i, j] belongs to input `cols[i, j]` of neuron
    `rows[i]`, or of neuron `i` when every neuron is tuned (`rows` is None). A named tuple: `torch.func` transforms
    find its tensors among an autograd Function's arguments.

    `prepared` adds what every call would otherwise derive again, some of it only by waiting on the device (`unique`):
    `neurons`, the (n, 1) neuron of each row of deltas, and, when the deltas read at most `COMPACT_INPUT_MAX_SHARE`
    of the inputs, `read` (those input columns, sorted) and `read_cols` (`cols` as positions among them)."""

    cols: torch.Tensor
    rows: torch.Tensor | None = None
    neurons: torch.Tensor | None = None
    read: torch.Tensor | None = None
    read_cols: torch.Tensor | None = None

    def prepared(self, d_in: int) -> Placement:
        """This placement with `neurons`, `read` and `read_cols` computed (itself where a graph is traced or a
        `torch.func` transform is running: tensors made under it would not outlive it)."""
        if torch.compiler.is_compiling() or transformed(neurons := _neurons(self)):
            return self
        read = read_cols = None
        if self.cols.numel() <= 2 * d_in:
            used, local = unique_columns(self.cols)
            if used.numel() <= COMPACT_INPUT_MAX_SHARE * d_in:
                read, read_cols = used, local
        return self._replace(neurons=neurons, read=read, read_cols=read_cols)

    def copy(self, device: torch.device | None = None) -> Placement:
        """A copy owning its indices (a merge's record must not follow later writes); with `device`, moved there."""
        copy = (lambda t: t.clone()) if device is None else (lambda t: t.to(device))
        return Placement(copy(self.cols), None if self.rows is None else copy(self.rows))


def _neurons(placement: Placement) -> torch.Tensor:
    """The neuron of each row of deltas, as an (n, 1) index."""
    cols = placement.cols
    rows = torch.arange(cols.shape[0], device=cols.device) if placement.rows is None else placement.rows.long()
    return rows[:, None]


def unique_columns(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted distinct input columns `cols` reads, and `cols` as positions among them (in cols' dtype)."""
    used, local = torch.unique(cols.reshape(-1).long(), return_inverse=True)
    return used, local.to(cols.dtype).view(cols.shape)


def entry_index(weight: torch.Tensor, placement: Placement) -> tuple[torch.Tensor, ...]:
    """The placement's entries of a (d_out, d_in) `weight`, or an (E, d_out, d_in) stack, as an index tuple shaped like
    the deltas (a stack counts its neurons expert after expert: neuron `e * d_out + i`). Indexing the tensor itself
    reads and writes any strides, a transposed view's included."""
    neurons = _neurons(placement) if placement.neurons is None else placement.neurons
    if weight.dim() == 3:
        expert, rows = neurons.div(weight.shape[1], rounding_mode="floor"), neurons.remainder(weight.shape[1])
        return expert, rows, placement.cols
    return neurons, placement.cols


def placed_entries(weight: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The entries of `weight` at the placement, shaped like the deltas."""
    return weight.detach()[entry_index(weight, placement)]


def write_placed_(weight: torch.Tensor, placement: Placement, values: torch.Tensor) -> None:
    """Write `values` at the placement through `weight.data`: the version counter does not move, so another graph
    that saved the weight still runs its backward (a merge is the model's new weight, as LoRA's merge through
    `weight.data` makes it)."""
    weight.data.index_put_(entry_index(weight, placement), values)
