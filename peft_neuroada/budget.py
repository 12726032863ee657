"""Choose k from a parameter budget, e.g. "as many trainable parameters as LoRA r=8" or "0.1% of the model"."""

from __future__ import annotations

from peft.tuners.tuners_utils import _get_in_out_features
from torch import nn
from transformers.pytorch_utils import Conv1D

from .targets import targeted_modules, targeted_parameters
from .tuner.config import NeuroAdaConfig
from .tuner.experts import is_transposed
from .tuner.selection import tuned_neuron_count


def targeted_shapes(model: nn.Module, config: NeuroAdaConfig) -> list[tuple[int, int]]:
    """(d_out, d_in) of every weight `config` would adapt in `model`: each layer, from its feature counts (a quantized
    weight, bitsandbytes 4-bit, is stored packed in a tensor of another shape), and each expert of a targeted expert
    stack on its own (NeuroAda tunes k entries per neuron of each expert; LoRA trains a rank-r pair per expert)."""
    shapes = [
        _get_in_out_features(module)[::-1]
        for _, module in targeted_modules(model, config)
        if isinstance(module, (nn.Linear, Conv1D))
    ]
    for name, param in targeted_parameters(model, config):
        owner = model.get_submodule(name.rpartition(".")[0])
        d_out, d_in = param.shape[-2:][::-1] if is_transposed(owner, param) else param.shape[-2:]
        shapes += [(d_out, d_in)] * (param.shape[0] if param.dim() == 3 else 1)
    return shapes


def neuroada_parameter_count(shapes: list[tuple[int, int]], k: int, neuron_fraction: float = 1.0) -> int:
    return sum(tuned_neuron_count(d_out, neuron_fraction) * min(k, d_in) for d_out, d_in in shapes)


def lora_parameter_count(shapes: list[tuple[int, int]], rank: int) -> int:
    return sum(rank * (d_in + d_out) for d_out, d_in in shapes)


def k_for_budget(
    model: nn.Module, config: NeuroAdaConfig, *, lora_rank: int | None = None, percent: float | None = None
) -> int:
    """The k whose parameter count is closest to exactly one budget (the smaller k on a tie): that of LoRA with
    `lora_rank` on the same layers, or `percent` of the model's parameters (as in the paper's tables)."""
    if (lora_rank is None) == (percent is None):
        raise ValueError("Give exactly one budget: lora_rank=... or percent=...")
    shapes = targeted_shapes(model, config)
    if not shapes:
        raise ValueError(f"No layer of the model matches target_modules={config.target_modules!r}.")
    total = sum(p.numel() for p in model.parameters())
    target = lora_parameter_count(shapes, lora_rank) if lora_rank is not None else percent / 100 * total
    max_k = max(d_in for _, d_in in shapes)
    counts = {k: neuroada_parameter_count(shapes, k, config.neuron_fraction) for k in range(1, max_k + 1)}
    return min(counts, key=lambda k: (abs(counts[k] - target), k))


def lora_rank_for_k(shapes: list[tuple[int, int]], k: int) -> int:
    """The LoRA rank of the parameter count closest to NeuroAda's with this k (the smaller on a tie)."""
    target = neuroada_parameter_count(shapes, k)
    low = max(1, target // lora_parameter_count(shapes, 1))
    return min((low, low + 1), key=lambda rank: (abs(lora_parameter_count(shapes, rank) - target), rank))


def density_for_k(shapes: list[tuple[int, int]], k: int) -> float:
    """The share of weight entries NeuroAda tunes: a sparse method's (SHiRA, Super-Tuning) density at equal budget."""
    return neuroada_parameter_count(shapes, k) / sum(d_out * d_in for d_out, d_in in shapes)
