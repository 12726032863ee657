"""The plugin's NeuroAdaModel: the tuner's, creating the plugin's layers, with checks before anything changes, the
workarounds of generic peft behaviour (peft_compat.py) and mixed batches served per thread."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils.other import ModulesToSaveWrapper
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from transformers.pytorch_utils import Conv1D

from . import layers, weighted_adapters
from .config import NeuroAdaConfig
from .gradient_selection import STRATEGIES
from .guards import (
    BUFFER_DTYPE,
    INDEX_TENSORS,
    check_before_load,
    check_saved_tensors,
    guard_loads,
    mark_shared_weights,
)
from .loading import check_saved_deltas
from .peft_compat import (
    merge_all_or_nothing,
    route_safetensors_calls,
    trained_biases,
    unmerge_all_or_nothing,
    without_wrapper_names,
)
from .quantized import torchao_config_of, unreadable_quantized_weight, unsupported_quantization
from .targets import targeted_modules, targeted_parameters
from .tuner import model as tuner_model
from .tuner.config import LLAMA_STYLE_TARGETS
from .tuner.experts import ParamWrapper, expert_projections
from .tuner.layer import LOAD_WEIGHTS_HINT, NeuroAdaLayer, unreadable_weight

# Projections fused into one layer: their rows are the parts' neurons, so per-row selection applies unchanged.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class NeuroAdaPluginModel(tuner_model.NeuroAdaModel):
    __doc__ = tuner_model.NeuroAdaModel.__doc__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The first NeuroAda model routes peft's safetensors calls (every save and load of an adapter makes one
        first); any `load_state_dict` checks every layer's tensors before any loads."""
        route_safetensors_calls()
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_pre_hook(check_before_load)

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls, model: nn.Module, config: Any, adapter_name: str, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """peft's, with saved indices checked and turned into the layers' buffers; warns if chosen on another base."""
        remapped = super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        elsewhere = [
            name
            for name, module in model.named_modules()
            if isinstance(module, cls.tuner_layer_cls) and adapter_name in module.neuroada_indices
            if check_saved_tensors(module, name, adapter_name, remapped)
        ]
        if elsewhere and STRATEGIES[config.selection].then is None:  # (columns chosen later are the user's choice)
            more = f" and {len(elsewhere) - 3} more" if len(elsewhere) > 3 else ""
            warnings.warn(
                f"NeuroAda adapter '{adapter_name}' was selected on another base model: at {', '.join(elsewhere[:3])}"
                f"{more}, most saved input columns are not among those this base's weights select. It loads and runs "
                "as saved, but was trained on other weights: load it on the base model it was trained on.",
                stacklevel=2,
            )
        return remapped

    @classmethod
    def _get_adapter_state_dict(
        cls, model: nn.Module, config: Any, adapter_name: str, state_dict: dict, unwanted_adapter_names: list[str]
    ) -> dict[str, torch.Tensor]:
        """peft's, refused before anything is written where index buffers were cast: they would load nowhere."""
        selected = super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        for key, tensor in selected.items():
            if any(f".{name}" in key for name in INDEX_TENSORS) and tensor.dtype != BUFFER_DTYPE:
                raise ValueError(
                    f"Refusing to save NeuroAda adapter '{adapter_name}': {key} is a {tensor.dtype} tensor, where "
                    f"{BUFFER_DTYPE} indices belong (converted, e.g. by `model.type(...)`), and would load as other "
                    "columns. Nothing was written: load the adapter again from its saved files."
                )
        return selected

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        """peft's, then marks shared weights, so that a layer merged directly (`layer.merge()`) refuses one too. peft
        runs `_pre_injection_hook` before the first adapter only; later ones (`add_adapter`, `load_adapter`) are
        checked the same way, before any layer changes (peft_compat.py)."""
        if any(isinstance(module, NeuroAdaLayer) for module in model.modules()):
            self._pre_injection_hook(model, self.peft_config[adapter_name], adapter_name)
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        mark_shared_weights(model, self.tuner_layer_cls)

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        """peft trains the biases a config names even for an adapter loaded for inference; nothing of one trains."""
        super()._mark_only_adapters_as_trainable(model)
        for name in self.active_adapters:
            config = self.peft_config[name]
            if config.bias != "none" and config.inference_mode:
                for bias in trained_biases(model, config.bias):
                    bias.requires_grad = False

    def merge_adapter(self, adapter_names: list[str] | None = None, safe_merge: bool = False) -> None:
        """All or nothing, where peft leaves the model half merged when a layer fails (peft_compat.py)."""
        merge_all_or_nothing(self, adapter_names, safe_merge)

    def unmerge_adapter(self) -> None:
        """All or nothing, as `merge_adapter` (a layer with nothing merged warns, as peft's)."""
        unmerge_all_or_nothing(self)

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

    def add_weighted_adapter(self, adapters: list[str], weights: list[float], adapter_name: str) -> None:
        """Add adapter `adapter_name` holding `Σ weights[i] · adapters[i]` in every layer any of them adapts: exactly
        what merging each source scaled by its weight would change in the base weights (weighted_adapters.py)."""
        weighted_adapters.add_weighted_adapter(self, adapters, weights, adapter_name)

    def _check_merge_allowed(self) -> None:
        """peft's, then which weights are shared now (a merge into one would change its other holders)."""
        super()._check_merge_allowed()
        mark_shared_weights(self.model, self.tuner_layer_cls)

    def _prepare_adapter_config(self, peft_config: NeuroAdaConfig, model_config: dict) -> NeuroAdaConfig:
        """The tuner's defaults; a new adapter that leaves some of the paper's projections out says which, once."""
        defaulted = peft_config.target_modules is None
        peft_config = super()._prepare_adapter_config(peft_config, model_config)
        if not peft_config.inference_mode and (left_out := left_out_projections(self.model, peft_config, defaulted)):
            warnings.warn(
                f"NeuroAda leaves these projections of the model unadapted: {', '.join(left_out[:6])}"
                f"{f' and {len(left_out) - 6} more' if len(left_out) > 6 else ''}. To adapt them, add their names to "
                "target_modules (layers) or target_parameters (MoE experts' 3-D weights, e.g. "
                "'experts.gate_up_proj'; of a module you parametrized yourself, its full name, as peft adapts only "
                "those); to leave them out on purpose, this warning can be ignored.",
                stacklevel=3,
            )
        return peft_config

    def _pre_injection_hook(self, model: nn.Module, config: NeuroAdaConfig, adapter_name: str) -> None:
        """Selection reads whole weights, before any layer is replaced: refuse sharded and offloaded models, layers
        whose quantized weights hold merged adapters, and a loaded config that would create other deltas than its
        weights file holds."""
        if any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules()):
            raise ValueError(
                "NeuroAda must be added before the model is sharded: call get_peft_model on the plain model, then "
                "wrap it with fully_shard / FullyShardedDataParallel / accelerator.prepare (see docs/distributed.md)."
            )
        targeted = targeted_modules(model, config)
        check_saved_deltas(config, [(without_wrapper_names(name), module) for name, module in targeted])
        unsupported, unreadable, unready = {}, {}, {}
        for name, module in targeted:
            if isinstance(module, NeuroAdaLayer) and module._quantized_originals:
                raise ValueError(
                    f"Cannot add a NeuroAda adapter to '{name}' while adapters are merged into its quantized weight: "
                    "its inputs are selected on the base weights, which the merge requantized. Unmerge first "
                    "(`model.unmerge_adapter()`)."
                )
            base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
            if reason := unsupported_quantization(base):
                unsupported[name] = reason
            elif hasattr(base, "weight") and (reason := unreadable_weight(base)):
                unreadable[name] = reason
            elif hasattr(base, "weight") and (reason := unreadable_quantized_weight(base)):
                unready[name] = reason
        for key, param in targeted_parameters(model, config):
            if param.is_meta:
                unreadable[key] = "it is on the meta device (offloaded or not loaded)"
        if unsupported:
            raise TypeError(
                f"NeuroAda cannot adapt the quantized layers {_listed(unsupported)}. Supported quantized bases: "
                "bitsandbytes 4-bit and 8-bit, and torchao tensors that dequantize. Remove these layers from "
                "target_modules (or add them to exclude_modules), or load the base model with one of those or in "
                "full precision."
            )
        if unreadable:
            raise ValueError(f"NeuroAda cannot read the weights of {_listed(unreadable)}. {LOAD_WEIGHTS_HINT}")
        if unready:
            raise ValueError(f"NeuroAda cannot read the quantized weights of {_listed(unready)}.")

    def _post_injection_hook(self, model: nn.Module, config: NeuroAdaConfig, adapter_name: str) -> None:
        super()._post_injection_hook(model, config, adapter_name)
        if hasattr(model, "add_model_tags"):
            model.add_model_tags(["neuroada", "peft-neuroada"])  # in the card save_pretrained writes

    linear_layer_cls = layers.NeuroAdaLinear

    @classmethod
    def _create_new_module(
        cls,
        config: NeuroAdaConfig,
        adapter_name: str,
        target: nn.Module,
        current_key: str,
        tuner: BaseTuner,
        parameter_name: str | None = None,
    ) -> NeuroAdaLayer:
        """The tuner's layers with the plugin's components (an expert wrapper is given them; `NeuroAdaLinear` holds
        them), their loads guarded."""
        if parameter_name is None:
            given = {"requantize_with": torchao_config_of(tuner.model)}
        else:
            given = layers.parameter_components()
        layer = super()._create_new_module(config, adapter_name, target, current_key, tuner, parameter_name, **given)
        if parameter_name is not None:
            guard_loads(layer)
        return layer

    def delete_adapter(self, adapter_name: str) -> None:
        """peft's, also dropping what the layers keep of the adapter (a merged adapter cannot be deleted: peft refuses,
        as its merge record must stay)."""
        super().delete_adapter(adapter_name)
        for module in self.model.modules():
            if isinstance(module, NeuroAdaLayer) and isinstance(module.placements, layers.KeptPlacements):
                module.placements.forget(set(module.neuroada_delta))

    @contextmanager
    def _serving(self, mixed: tuner_model.MixedBatch) -> Iterator[None]:
        """The tuner's mixed batch, made known to this thread's layers too (their `mixed_batch_names` component reads
        it from a context variable), so concurrent calls in other threads are unaffected; peft's `modules_to_save`
        wrappers get the names through the tuner's forward pre-hooks, as with LoRA."""
        with super()._serving(mixed), layers.serving(mixed):
            yield


NeuroAdaModel = NeuroAdaPluginModel  # the name users import


def _listed(reasons: dict[str, str]) -> str:
    """The layers and why, for an error message: each reason once, after the first few layers it applies to."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        by_reason.setdefault(reason, []).append(name)
    parts = []
    for reason, names in by_reason.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        parts.append(", ".join(f"'{name}'" for name in names[:3]) + f"{more}: {reason}")
    return "; ".join(parts)


def left_out_projections(model: nn.Module, config: NeuroAdaConfig, defaulted: bool) -> list[str]:
    """Projections `config` would leave unadapted: expert weights it does not target, and, for the default targets,
    layers named as the paper's projections (for named targets, fused layers holding a named part, e.g. Phi-3's
    qkv_proj for 'q_proj')."""
    targeted = {name for name, _ in targeted_parameters(model, config)}
    declined = config.target_parameters is not None and not config.target_parameters  # [] names no expert on purpose
    left_out = [] if declined else [name for _, name in expert_projections(model) if name not in targeted]
    if config.layers_to_transform is not None or config.exclude_modules:
        return left_out  # a chosen subset of layers: only the experts are worth a word
    adapted = {name for name, _ in targeted_modules(model, config)}
    if defaulted:
        wanted = {*LLAMA_STYLE_TARGETS, *FUSED_PROJECTIONS}
    elif isinstance(config.target_modules, (set, list)):
        named = set(config.target_modules)
        wanted = {fused for fused, parts in FUSED_PROJECTIONS.items() if named & set(parts)}
    else:
        wanted = set()
    for name, module in model.named_modules():
        unwrapped = name.replace(".base_layer", "")
        if isinstance(module, (nn.Linear, Conv1D)) and name.rpartition(".")[2] in wanted and unwrapped not in adapted:
            left_out.append(unwrapped)
    return left_out
