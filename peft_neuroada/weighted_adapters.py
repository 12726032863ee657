"""`add_weighted_adapter` for NeuroAda: exact where the sources share their placement, refused elsewhere. A plugin
feature beside the tuner (peft's small tuners have none); docs/upstream.md names it as a later PR's."""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Sequence

import torch
from peft.tuners.tuners_utils import BaseTuner
from peft.utils.other import ModulesToSaveWrapper
from torch import nn

from .targets import targeted_modules
from .tuner.config import NeuroAdaConfig
from .tuner.experts import ParamWrapper
from .tuner.layer import NeuroAdaLayer


def add_weighted_adapter(model: BaseTuner, adapters: list[str], weights: list[float], adapter_name: str) -> None:
    """Add adapter `adapter_name` holding `Σ weights[i] · adapters[i]` in every layer any of them adapts: exactly
    what merging each source scaled by its weight would change in the base weights.

    That is exact only where the sources tune the same input connections (one k, neuron_fraction and selection on
    the same base model); anything else is refused before the model changes, naming the layer. `modules_to_save`
    are copied, unweighted, from the one source that saves them. LoRA's `combination_type`s work on low-rank
    factors, which NeuroAda deltas do not have."""
    if refusal := weighted_adapter_refusal(model, adapters, weights, adapter_name):
        raise ValueError(refusal)
    configs = [model.peft_config[name] for name in adapters]
    layers = {
        name: layer
        for name, layer in model.model.named_modules()
        if isinstance(layer, NeuroAdaLayer) and any(adapter in layer.neuroada_delta for adapter in adapters)
    }
    heads = [
        (wrapper, next(name for name in adapters if name in wrapper.modules_to_save))
        for wrapper in model.model.modules()
        if isinstance(wrapper, ModulesToSaveWrapper) and any(name in wrapper.modules_to_save for name in adapters)
    ]
    active = copy.copy(model.active_adapter)
    model.peft_config[adapter_name] = config_for_layers(model, configs, adapters, layers)
    try:
        model.inject_adapter(model.model, adapter_name)
        for layer in layers.values():
            set_weighted_sum(layer, adapter_name, adapters, weights)
        for wrapper, holder in heads:
            wrapper.modules_to_save[adapter_name].load_state_dict(wrapper.modules_to_save[holder].state_dict())
    except BaseException:
        if adapter_name in model.peft_config:
            model.delete_adapter(adapter_name)
        model.active_adapter = active
        raise


def weighted_adapter_refusal(
    model: BaseTuner, adapters: list[str], weights: list[float], adapter_name: str
) -> str | None:
    """Why `add_weighted_adapter` cannot combine these exactly, or None."""
    if adapter_name in model.peft_config:
        return f"Adapter with name '{adapter_name}' already exists."
    if not adapters:
        return "add_weighted_adapter needs at least one adapter to combine (got none)."
    if len(weights) != len(adapters):
        got = f"{len(adapters)} adapters and {len(weights)} weights"
        return f"add_weighted_adapter needs one weight per adapter (got {got})."
    if not all(math.isfinite(weight) for weight in weights):
        return f"add_weighted_adapter needs finite weights (got {weights})."
    if missing := [name for name in adapters if name not in model.peft_config]:
        return f"Adapter {missing[0]} does not exist"
    configs = [model.peft_config[name] for name in adapters]
    if biased := [(name, c.bias) for name, c in zip(adapters, configs, strict=True) if c.bias != "none"]:
        return (
            f"Cannot weight adapter '{biased[0][0]}': it trains biases (bias={biased[0][1]!r}), which live in the "
            "base model, apply to every adapter and cannot be scaled. Combine adapters trained with bias='none'."
        )
    if len({(c.k, c.neuron_fraction) for c in configs}) > 1:
        pairs = zip(adapters, configs, strict=True)
        listed = ", ".join(f"'{n}': k={c.k}, neuron_fraction={c.neuron_fraction}" for n, c in pairs)
        return (
            f"Cannot combine NeuroAda adapters with different k or neuron_fraction ({listed}): their deltas have "
            "different shapes and tune different input connections. Combine adapters trained with the same ones."
        )
    wrappers = [m for m in model.model.modules() if isinstance(m, ModulesToSaveWrapper)]
    if shared := sum(sum(name in wrapper.modules_to_save for name in adapters) > 1 for wrapper in wrappers):
        return (
            "Cannot add weighted adapters if they target the same module with modules_to_save, but found "
            f"{shared} such instance(s)."
        )
    if refusal := layer_and_parameter_refusal(model, adapters):
        return refusal
    for name, layer in model.model.named_modules():
        if isinstance(layer, NeuroAdaLayer) and (conflict := placement_conflict(layer, adapters)):
            return (
                f"Cannot combine NeuroAda adapters exactly at layer '{name}': {conflict} (their indices differ), "
                "so no single set of k deltas per neuron holds their sum. Combine adapters trained with the same "
                "k, neuron_fraction and selection on the same base model, or activate them together instead "
                "(`model.base_model.set_adapter([...])`), which adds them at weight 1."
            )
    return None


def layer_and_parameter_refusal(model: BaseTuner, adapters: list[str]) -> str | None:
    """Why no one adapter can hold the sources, where one adapts a module as a layer and another a parameter of
    that module (peft wraps a module's parameter only when no adapter targets the module itself), or None."""
    as_layers: dict[str, str] = {}
    as_parameters: dict[str, tuple[str, str]] = {}
    for name, layer in model.model.named_modules():
        if isinstance(layer, NeuroAdaLayer) and (holders := [a for a in adapters if a in layer.neuroada_delta]):
            module = name.replace(".base_layer", "")
            if isinstance(layer, ParamWrapper):
                as_parameters.setdefault(module, (holders[0], layer.parameter_name))
            else:
                as_layers.setdefault(module, holders[0])
    if not (both := sorted(as_layers.keys() & as_parameters.keys())):
        return None
    adapter, parameter = as_parameters[both[0]]
    return (
        f"Cannot combine NeuroAda adapters into one at '{both[0]}': adapter '{as_layers[both[0]]}' adapts it as a "
        f"layer (target_modules) and adapter '{adapter}' its parameter '{parameter}' (target_parameters), and one "
        "adapter cannot do both. Activate them together instead (`model.base_model.set_adapter([...])`), which "
        "adds them at weight 1."
    )


def config_for_layers(
    model: BaseTuner, sources: list[NeuroAdaConfig], adapters: list[str], layers: dict[str, NeuroAdaLayer]
) -> NeuroAdaConfig:
    """The first source's config with every source's `modules_to_save`, so that whichever source comes first the
    weighted adapter is the same: it targets exactly the modules of `layers` (by the config's own targets where
    they do, else by the layers' names) and the parameters any source targets (the sources that target parameters
    all target the same ones, as the tuner requires; `target_parameters=[]` names none), and where the sources'
    deltas differ in dtype it keeps its deltas in the widest of them."""
    config = copy.deepcopy(sources[0])
    config.target_parameters = next(
        (list(source.target_parameters) for source in sources if source.target_parameters),
        config.target_parameters,
    )
    dtypes = {
        layer.neuroada_delta[name].dtype
        for layer in layers.values()
        for name in adapters
        if name in layer.neuroada_delta
    }
    if len(dtypes) > 1:
        config.delta_dtype = str(functools.reduce(torch.promote_types, dtypes)).removeprefix("torch.")
    saved = [module for source in sources for module in source.modules_to_save or ()]
    config.modules_to_save = list(dict.fromkeys(saved)) or None
    layer_names = {name for name, layer in layers.items() if not isinstance(layer, ParamWrapper)}
    inside_layers = tuple(f"{name}." for name in layer_names)
    targeted = {name for name, _ in targeted_modules(model.model, config) if not name.startswith(inside_layers)}
    if targeted != layer_names:
        config.target_modules = "|".join(re.escape(name) for name in sorted(layer_names))
        config.exclude_modules = config.layers_to_transform = config.layers_pattern = None
    return config


def placement_conflict(layer: NeuroAdaLayer, adapters: Sequence[str]) -> str | None:
    """Why the deltas of `adapters` here sit on different entries (no weighted sum of them is exact), or None."""
    present = [name for name in adapters if name in layer.neuroada_delta]
    for other in present[1:]:
        for held in (layer.neuroada_indices, layer.neuroada_rows):
            first = held[present[0]] if present[0] in held else None
            second = held[other] if other in held else None
            if (first is None) != (second is None) or (first is not None and not torch.equal(first, second)):
                return f"adapters '{present[0]}' and '{other}' tune different input connections"
    return None


def set_weighted_sum(
    layer: NeuroAdaLayer, adapter_name: str, adapters: Sequence[str], weights: Sequence[float]
) -> None:
    """Make adapter `adapter_name` (added already) `Σ weights[i] · adapters[i]` on their shared placement, summed
    in at least float32 and stored in the widest of the sources' dtypes: the new adapter is created in the base
    weight's dtype, which peft's float32 upcast of `add_adapter` never reaches here (adapters this layer lacks add
    nothing)."""
    sources = [(name, w) for name, w in zip(adapters, weights, strict=True) if name in layer.neuroada_delta]
    deltas = [layer.neuroada_delta[name].detach() for name, _ in sources]
    widest = functools.reduce(torch.promote_types, (delta.dtype for delta in deltas))
    dtype = torch.promote_types(widest, torch.float32)
    total = sum(weight * delta.to(dtype) for (_, weight), delta in zip(sources, deltas, strict=True))
    first = sources[0][0]
    layer.neuroada_indices[adapter_name] = layer.neuroada_indices[first].clone()
    if first in layer.neuroada_rows:
        layer.neuroada_rows[adapter_name] = layer.neuroada_rows[first].clone()
    own = layer.neuroada_delta[adapter_name]
    layer.neuroada_delta[adapter_name] = nn.Parameter(total.to(widest), requires_grad=own.requires_grad)
