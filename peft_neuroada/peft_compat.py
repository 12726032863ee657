"""Workarounds of generic peft behaviour that NeuroAda's guarantees need, in one place.

Each names the peft behaviour it works around. tests/test_peft_compat.py holds one spec per workaround that runs
peft's own behaviour and fails once peft changes it: the workaround can be dropped then.
"""

from __future__ import annotations

import warnings
from typing import Any

import peft.peft_model
import peft.utils.save_and_load
import safetensors.torch
from peft.tuners.tuners_utils import BaseTuner, onload_layer
from peft.utils.other import ModulesToSaveWrapper
from torch import nn

from . import safe_io
from .tuner.experts import ParamWrapper
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


class PeftCompat(BaseTuner):
    """The BaseTuner methods NeuroAdaModel overrides for generic peft behaviour (mixed in before BaseTuner)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The first NeuroAda model routes peft's safetensors calls (every save and load of an adapter makes one
        first)."""
        route_safetensors_calls()
        super().__init__(*args, **kwargs)

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        """peft runs `_pre_injection_hook` before the first adapter only; later ones (`add_adapter`, `load_adapter`)
        are checked the same way, before any layer changes."""
        if any(isinstance(module, NeuroAdaLayer) for module in model.modules()):
            self._pre_injection_hook(model, self.peft_config[adapter_name], adapter_name)
        super().inject_adapter(model, adapter_name, *args, **kwargs)

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        """peft trains the biases a config names even for an adapter loaded for inference; nothing of one trains."""
        super()._mark_only_adapters_as_trainable(model)
        for name in self.active_adapters:
            config = self.peft_config[name]
            if config.bias != "none" and config.inference_mode:
                for bias in trained_biases(model, config.bias):
                    bias.requires_grad = False

    def merge_adapter(self, adapter_names: list[str] | None = None, safe_merge: bool = False) -> None:
        """peft merges layer after layer and leaves the model half merged when one fails. All or nothing here: every
        layer is checked first, and the layers merged before a failing one are unmerged again."""
        self._check_merge_allowed()
        layers = [module for module in self.model.modules() if isinstance(module, NeuroAdaLayer)]
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

    def unmerge_adapter(self) -> None:
        """All or nothing, as `merge_adapter` (a layer with nothing merged warns, as peft's)."""
        unmerged = []
        try:
            for module in self.model.modules():
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

    def _unload_and_optionally_merge(
        self,
        merge: bool = True,
        progressbar: bool = False,
        safe_merge: bool = False,
        adapter_names: list[str] | None = None,
    ) -> nn.Module:
        """peft merges while it unloads, layer by layer, and a failing layer leaves the model half merged and half
        unloaded. Here peft's refusal of an ambiguous `modules_to_save` selection comes first, then every layer is
        merged (all or nothing), then peft unloads as it does for LoRA: the selected `modules_to_save` copies and its
        fix-ups, each NeuroAda layer already merged."""
        if merge:
            self._check_merge_allowed()
            for wrapper in self.model.modules():
                if adapter_names and isinstance(wrapper, ModulesToSaveWrapper):
                    wrapper.check_set_adapter(adapter_names)
            self.merge_adapter(adapter_names=adapter_names, safe_merge=safe_merge)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "All adapters are already merged", UserWarning)
            return super()._unload_and_optionally_merge(merge, progressbar, safe_merge, adapter_names)

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        """Unloading an experts module unwrapped from `ParamWrapper`s, peft would give it the wrapper's `weight`,
        which it has none of (LoRA's model handles its own): the module only goes back in place."""
        if isinstance(child, ParamWrapper) and new_module is not child:
            setattr(parent, child_name, new_module)
            return
        super()._replace_module(parent, child_name, new_module, child)


def trained_biases(model: nn.Module, bias: str) -> list[nn.Parameter]:
    """The biases a config's `bias` option trains, chosen as peft's BaseTuner chooses them."""
    if bias == "all":
        return [p for n, p in model.named_parameters() if n == "bias" or n.endswith(".bias")]
    return [m.bias for m in model.modules() if isinstance(m, NeuroAdaLayer) and getattr(m, "bias", None) is not None]
