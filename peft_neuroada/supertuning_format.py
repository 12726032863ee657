"""A NeuroAda adapter as Super-Tuning's per-row selection holds it, and back, exactly: the alternative contribution
(docs/upstream/supertuning/, whose second patch adds `selection="row"`) keeps Super-Tuning's format, one float32 value
and one int32 flat position `row * d_in + col` per trainable entry, where NeuroAda keeps (n, k) deltas and (n, k)
columns. Both forwards add each value into its entry in the weight's dtype, so the converted adapter computes the
same bits.

Works on the state dicts peft's `get_peft_model_state_dict` / `set_peft_model_state_dict` use (adapter names
stripped), with the model whose layers give each weight's d_in."""

from __future__ import annotations

import torch
from torch import nn

from .tuner.forward import entry_index
from .tuner.layer import Linear, NeuroAdaLayer
from .tuner.selection import INDEX_DTYPE as BUFFER_DTYPE

SUPERTUNING_KEYS = ("supertuning_values", "supertuning_indices")


def _layers(model: nn.Module, adapter_name: str) -> dict[str, NeuroAdaLayer]:
    """The model's NeuroAda layers holding the adapter, by the name peft's state-dict keys give them."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, NeuroAdaLayer) and adapter_name in module.neuroada_delta
    }


def _refusal(layer: NeuroAdaLayer, adapter_name: str) -> str | None:
    if not isinstance(layer, Linear) or type(layer.get_base_layer()) is not nn.Linear:
        return "Super-Tuning adapts nn.Linear layers only"
    if adapter_name in layer.neuroada_rows:
        return "it tunes a share of the neurons (neuron_fraction < 1), where the per-row selection tunes all"
    return None


def to_supertuning(model: nn.Module, adapter_name: str = "default") -> tuple[dict, dict[str, torch.Tensor]]:
    """The `SupertuningConfig` fields and the state dict of `model`'s NeuroAda adapter in the per-row selection.
    ValueError naming the layer where the mode cannot hold it (nothing is converted then)."""
    layers, config = _layers(model, adapter_name), model.peft_config[adapter_name]
    if config.bias != "none" or config.modules_to_save:
        raise ValueError("Super-Tuning trains no biases or extra modules: convert an adapter of deltas alone.")
    state = {}
    for name, layer in layers.items():
        if reason := _refusal(layer, adapter_name):
            raise ValueError(f"Cannot convert NeuroAda adapter '{adapter_name}' at '{name}': {reason}.")
        neurons, cols = entry_index(layer.weight_out_in(), layer.placement(adapter_name))
        positions = neurons * layer.in_features + cols
        state[f"{name}.supertuning_indices"] = positions.reshape(-1).to(BUFFER_DTYPE)
        state[f"{name}.supertuning_values"] = layer.neuroada_delta[adapter_name].detach().reshape(-1).float()
    fields = {
        "target_modules": sorted({name.rpartition(".")[2] for name in layers}),
        "selection": "row",
        "entries_per_row": max(layer.neuroada_delta[adapter_name].shape[1] for layer in layers.values()),
        "select_top": config.selection != "reverse",
        "save_precomputed_indices": True,
    }
    return fields, state


def from_supertuning(model: nn.Module, state: dict[str, torch.Tensor], adapter_name: str = "default") -> dict:
    """The state dict of `model`'s NeuroAda adapter (k per neuron, every neuron tuned) that holds a per-row
    Super-Tuning adapter's `state`; ValueError where its entries are not k per row, row after row."""
    converted = {}
    for name, layer in _layers(model, adapter_name).items():
        n, k = layer.neuroada_delta[adapter_name].shape
        positions = state[f"{name}.supertuning_indices"].long().view(n, k)
        rows = positions.div(layer.in_features, rounding_mode="floor")
        if not torch.equal(rows, torch.arange(n, device=rows.device)[:, None].expand(n, k)):
            raise ValueError(f"Cannot convert at '{name}': its entries are not {k} per row, row after row.")
        converted[f"{name}.neuroada_indices"] = positions.remainder(layer.in_features).to(BUFFER_DTYPE)
        converted[f"{name}.neuroada_delta"] = state[f"{name}.supertuning_values"].view(n, k)
    return converted
