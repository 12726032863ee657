"""Which inputs of each neuron (and which neurons, for coverage ablations) get a delta: read in blocks of rows, kept as
(d_out, k) indices, never a dense mask, random choices seeded per layer so every process and reload agrees."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import NamedTuple

import torch

_MAX_BLOCK_ELEMENTS = 1 << 24
# How a layer keeps its selected columns, one (n, k) tensor per adapter, saved as held (as Super-Tuning keeps its
# indices): a dtype every collective backend (gloo, NCCL) broadcasts, as DDP syncs buffers (int16 is not).
INDEX_DTYPE = torch.int32


class Strategy(NamedTuple):
    """A value of `NeuroAdaConfig.selection`. `score`: the score whose k largest entries per row are selected when
    the adapter is made. `then`: what must follow before training, for a strategy whose final inputs are chosen
    later (None: the inputs are final, a function of the weights and the seed, so a saved adapter's columns can be
    checked against the base it loads on)."""

    score: Callable[[torch.Tensor, torch.Generator], torch.Tensor]
    then: str | None = None


def _magnitude(block: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return block.abs()


# The strategies by name: the config, the layers and the model all read this table (add a row to add one). A score
# sees a block of rows of the weight at a time (`rows_per_block`), the tuned rows only when `neuron_fraction` < 1.
STRATEGIES: dict[str, Strategy] = {
    "magnitude": Strategy(_magnitude),  # the paper's
    "reverse": Strategy(lambda block, generator: block.abs().neg_()),  # the smallest |w| (an ablation)
    "random": Strategy(lambda block, generator: torch.rand(block.shape, generator=generator).to(block.device)),
}


def rows_per_block(d_in: int) -> int:
    """Rows of a (d_out, d_in) weight read at once, bounding every transient block (scores, dequantized values)."""
    return max(1, _MAX_BLOCK_ELEMENTS // d_in)


def layer_generator(seed: int, layer_name: str) -> torch.Generator:
    """A CPU generator seeded from the config seed and the layer's name: the same on every rank and every run."""
    return torch.Generator().manual_seed(seed ^ zlib.crc32(layer_name.encode()))


def _top_k_block(score: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k column indices per row; among equal scores the lower column index wins (topk alone is not stable)."""
    indices = score.topk(k, dim=1).indices
    kth_largest = score.gather(1, indices[:, -1:])
    ambiguous_rows = ((score >= kth_largest).sum(dim=1) > k).nonzero().squeeze(1)
    if ambiguous_rows.numel():
        indices[ambiguous_rows] = score[ambiguous_rows].sort(dim=1, descending=True, stable=True).indices[:, :k]
    return indices


def select_inputs(
    weight: torch.Tensor, k: int, strategy: str = "magnitude", generator: torch.Generator | None = None
) -> torch.Tensor:
    """Per row of `weight` (d_out, d_in), the `k` selected columns, sorted ascending (another score, such as summed
    gradients, goes in as `weight`); a quantized layer comes as its dequantized view, read in float32 blocks."""
    score_of = STRATEGIES[strategy].score
    if hasattr(weight, "full_tensor"):  # a DTensor, sharded (e.g. tensor parallel): select on the gathered rows
        weight = weight.full_tensor()
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    d_out, d_in = weight.shape
    block = rows_per_block(d_in)
    selected = torch.empty(d_out, k, dtype=INDEX_DTYPE, device=weight.device)
    with torch.no_grad():
        for start in range(0, d_out, block):
            score = score_of(weight[start : start + block], generator)
            selected[start : start + block] = _top_k_block(score, k).sort(dim=1).values
    return selected


def tuned_neuron_count(d_out: int, fraction: float) -> int:
    """How many of `d_out` neurons get a bypass: all but int((1 - fraction) * d_out), as the official ablation
    (`certainCell`) counts the neurons it freezes, and at least one."""
    return d_out if fraction >= 1.0 else max(1, d_out - int((1 - fraction) * d_out))


def select_neurons(d_out: int, fraction: float, generator: torch.Generator) -> torch.Tensor | None:
    """The rows, drawn uniformly, that get a bypass when only `fraction` of the neurons are tuned (None: all)."""
    if fraction >= 1.0:
        return None
    rows = torch.randperm(d_out, generator=generator)[: tuned_neuron_count(d_out, fraction)].sort().values
    return rows.to(INDEX_DTYPE)
