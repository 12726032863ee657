"""Workarounds of generic peft behaviour that NeuroAda's guarantees need, in one place.

Each names the peft behaviour it works around. tests/test_peft_compat.py holds one spec per workaround that runs
peft's own behaviour and fails once peft changes it: the workaround can be dropped then.
"""

from __future__ import annotations

import peft.peft_model
import peft.utils.save_and_load
import safetensors.torch
from peft.tuners.tuners_utils import BaseTuner, onload_layer
from torch import nn

from . import safe_io
from .tuner.layer import NeuroAdaLayer

# Wrappers that FSDP1 auto-wrapping and activation checkpointing put around submodules: part of module names, not of
# state-dict keys (the wrappers' state-dict hooks drop them).
WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def without_wrapper_names(name: str) -> str:
    """A module's name as state-dict keys give it."""
    for wrapper in WRAPPER_NAMES:
        name = name.replace(wrapper, "")
    return name


def route_safetensors_calls() -> None:
    """peft writes adapter weights with safetensors' `save_file` straight onto the final path, then the config, and
    reads with `load_file`: route both through `safe_io` (atomic, NeuroAda files only), where peft still holds
    safetensors' own functions; if peft's internals move, nothing changes."""
    if getattr(peft.peft_model, "safe_save_file", None) is safetensors.torch.save_file:
        peft.peft_model.safe_save_file = safe_io.save_file
    if getattr(peft.utils.save_and_load, "safe_load_file", None) is safetensors.torch.load_file:
        peft.utils.save_and_load.safe_load_file = safe_io.load_file


def merge_all_or_nothing(model: BaseTuner, adapter_names: list[str] | None = None, safe_merge: bool = False) -> None:
    """peft merges layer after layer and leaves the model half merged when one fails. All or nothing here: every
    layer is checked first, and the layers merged before a failing one are unmerged again."""
    model._check_merge_allowed()
    layers = [module for module in model.model.modules() if isinstance(module, NeuroAdaLayer)]
    for layer in layers:
        if any(adapter in layer.neuroada_delta for adapter in adapter_names or layer.active_adapters):
            layer.check_mergeable()
    merged = []
    try:
        for layer in layers:
            with onload_layer(layer):
                before = len(layer.merged_adapters)
                layer.merge(adapter_names=adapter_names, safe_merge=safe_merge)
            merged.append((layer, before))
    except BaseException:
        for layer, before in reversed(merged):
            with onload_layer(layer):
                layer.unmerge_to(before)
        raise


def unmerge_all_or_nothing(model: BaseTuner) -> None:
    """All or nothing, as `merge_adapter` (a layer with nothing merged warns, as peft's)."""
    unmerged = []
    try:
        for module in model.model.modules():
            if isinstance(module, NeuroAdaLayer):
                with onload_layer(module):
                    names = list(module.merged_adapters)
                    module.unmerge()
                unmerged.append((module, names))
    except BaseException:
        for layer, names in reversed(unmerged):
            with onload_layer(layer):
                layer.merge(adapter_names=names)
        raise


def trained_biases(model: nn.Module, bias: str) -> list[nn.Parameter]:
    """The biases a config's `bias` option trains, chosen as peft's BaseTuner chooses them."""
    if bias == "all":
        return [p for n, p in model.named_parameters() if n == "bias" or n.endswith(".bias")]
    return [m.bias for m in model.modules() if isinstance(m, NeuroAdaLayer) and getattr(m, "bias", None) is not None]
