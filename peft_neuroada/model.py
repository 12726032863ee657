"""NeuroAdaModel: wires NeuroAda layers into a model and checks adapters against it on load."""

from __future__ import annotations

import copy
import itertools
import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from peft.tuners.tuners_utils import (
    BaseTuner,
    BaseTunerLayer,
    _maybe_include_all_linear_layers,
    check_target_module_exists,
    onload_layer,
)
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from transformers.pytorch_utils import Conv1D

from .config import (
    PREFIX,
    TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING,
    NeuroAdaConfig,
    default_targets,
)
from .layer import (
    BASE_ADAPTER_NAME,
    LOAD_WEIGHTS_HINT,
    SAVED_TENSORS,
    Linear,
    MixedBatch,
    NeuroAdaLayer,
    serving,
    unreadable_weight,
)
from .quantized import torchao_config_of, unreadable_quantized_weight, unsupported_quantization

# Wrappers that FSDP1 auto-wrapping and activation checkpointing put around submodules: their names are part of the
# module names but not of the state-dict keys (the wrappers' state-dict hooks drop them).
_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class NeuroAdaModel(BaseTuner):
    """Creates a NeuroAda model from a pretrained transformers model.

    Example:
        ```py
        >>> import peft_neuroada
        >>> from peft import get_peft_model
        >>> model = get_peft_model(base_model, peft_neuroada.NeuroAdaConfig(k=1))
        >>> model.print_trainable_parameters()
        ```
    """

    prefix: str = PREFIX
    tuner_layer_cls = NeuroAdaLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_pre_hook(_check_tensors_before_load)

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        """peft runs `_pre_injection_hook` before the first adapter only: an adapter added later (`add_adapter`,
        `load_adapter`) is checked the same way here, before any layer changes."""
        if any(isinstance(module, NeuroAdaLayer) for module in model.modules()):
            self._pre_injection_hook(model, self.peft_config[adapter_name], adapter_name)
        super().inject_adapter(model, adapter_name, *args, **kwargs)

    def _prepare_adapter_config(self, peft_config: NeuroAdaConfig, model_config: dict) -> NeuroAdaConfig:
        if peft_config.target_modules is None:
            peft_config.target_modules = default_targets(model_config.get("model_type"))
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
        config.check_saved_deltas((_without_wrapper_names(name), module) for name, module in targeted)
        unsupported, unreadable, unready = {}, {}, {}
        for name, module in targeted:
            if isinstance(module, NeuroAdaLayer) and module.merged_into_quantized_weight():
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
        mark_shared_weights(model)
        # Tags end up in the model card written by save_pretrained / push_to_hub.
        if hasattr(model, "add_model_tags"):
            model.add_model_tags(["neuroada", "peft-neuroada"])
        if config.selection == "gradient" and not config.inference_mode:
            warnings.warn(
                f"Adapter '{adapter_name}' uses selection='gradient': its inputs are chosen by magnitude until you "
                "call peft_neuroada.select_by_gradient(model, calibration_batches) before training.",
                stacklevel=2,
            )

    def _create_and_replace(
        self,
        config: NeuroAdaConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **optional_kwargs: Any,
    ) -> None:
        if isinstance(target, NeuroAdaLayer):
            target.update_layer(adapter_name, config, layer_name=current_key)
            return
        new_module = self._create_new_module(config, adapter_name, target, current_key)
        new_module.requantize_with = torchao_config_of(self.model)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    @staticmethod
    def _create_new_module(config: NeuroAdaConfig, adapter_name: str, target: nn.Module, current_key: str) -> Linear:
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, Conv1D):
            fan_in_fan_out = True
        elif isinstance(base, nn.Linear):
            fan_in_fan_out = False
        else:
            raise TypeError(
                f"NeuroAda cannot adapt module '{current_key}' of type {type(base).__name__}: only torch.nn.Linear "
                "and transformers' Conv1D are supported. Remove it from target_modules or add it to exclude_modules."
            )
        if fan_in_fan_out != config.fan_in_fan_out:
            warnings.warn(
                f"fan_in_fan_out={config.fan_in_fan_out} does not match {type(base).__name__} layers; "
                f"using fan_in_fan_out={fan_in_fan_out} for them.",
                stacklevel=2,
            )
            config.fan_in_fan_out = fan_in_fan_out  # as LoRA does: the saved config then loads without the warning
        return Linear(target, adapter_name, config, fan_in_fan_out=fan_in_fan_out, layer_name=current_key)

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        """peft's, except that the biases of an adapter loaded for inference (`is_trainable=False`) stay frozen like
        its deltas: nothing of an inference adapter trains."""
        super()._mark_only_adapters_as_trainable(model)
        for name in self.active_adapters:
            config = self.peft_config[name]
            if config.bias != "none" and config.inference_mode:
                for bias in trained_biases(model, config.bias):
                    bias.requires_grad = False

    def _check_merge_allowed(self) -> None:
        super()._check_merge_allowed()
        mark_shared_weights(self.model)

    def merge_adapter(self, adapter_names: list[str] | None = None, safe_merge: bool = False) -> None:
        """peft's `merge_adapter`, all or nothing: every layer is checked first, and if a layer still fails, the
        layers merged before it are unmerged again, so the model is either fully merged or bit-identical."""
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
        """peft's `unmerge_adapter`, all or nothing: if a layer fails, the layers unmerged before it are merged again
        exactly as they were."""
        unmerged = []
        try:
            for module in self.model.modules():
                if isinstance(module, NeuroAdaLayer) and module.merged:
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
        # Merge everything first (all or nothing), then take the adapter layers out.
        if merge:
            self.merge_adapter(adapter_names=adapter_names, safe_merge=safe_merge)
        return super()._unload_and_optionally_merge(merge=False, progressbar=progressbar)

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        """peft's, except when unloading a `modules_to_save` (or trainable-tokens) wrapper: its module only goes back
        in place. peft's own would give that module the wrapper's `weight`, which fails for a head without one of its
        own (RoBERTa's `RobertaClassificationHead`, the paper's GLUE runs). LoRA's override (for quantized weights)
        copies no weight either."""
        if isinstance(child, AuxiliaryTrainingWrapper):
            setattr(parent, child_name, new_module)
            return
        super()._replace_module(parent, child_name, new_module, child)

    def add_weighted_adapter(self, adapters: list[str], weights: list[float], adapter_name: str) -> None:
        """Add adapter `adapter_name` holding `Σ weights[i] · adapters[i]` in every layer any of them adapts: exactly
        the change that merging each source scaled by its weight would make to the base weights.

        NeuroAda adapters add exactly only where they tune the same input connections, as adapters trained with one
        `k` and `neuron_fraction` and the same selection on the same base model do (magnitude selection depends on the
        base weights alone). Every check runs before the model changes, and a combination that cannot be exact is
        refused with a ValueError (naming the layer where the indices differ). Modules in `modules_to_save` are copied
        from the one source that saves them, unweighted; two sources saving the same module are refused, as in LoRA.
        LoRA's other combination types (svd, cat, ties, dare, magnitude_prune) work on low-rank factors, which NeuroAda
        deltas do not have: there is no `combination_type`.
        """
        config, layers = self._checked_weighted_adapter(adapters, weights, adapter_name)
        heads = [
            (wrapper, next(name for name in adapters if name in wrapper.modules_to_save))
            for wrapper in self.model.modules()
            if isinstance(wrapper, ModulesToSaveWrapper) and any(name in wrapper.modules_to_save for name in adapters)
        ]
        active = copy.copy(self.active_adapter)
        self.peft_config[adapter_name] = config
        try:
            self.inject_adapter(self.model, adapter_name)
            for layer in layers:
                layer.set_weighted_sum(adapter_name, adapters, weights)
            for wrapper, holder in heads:
                wrapper.modules_to_save[adapter_name].load_state_dict(wrapper.modules_to_save[holder].state_dict())
        except BaseException:
            if adapter_name in self.peft_config:
                self.delete_adapter(adapter_name)
            self.active_adapter = active
            raise

    def _checked_weighted_adapter(
        self, adapters: list[str], weights: list[float], adapter_name: str
    ) -> tuple[NeuroAdaConfig, list[NeuroAdaLayer]]:
        """The config of `add_weighted_adapter`'s new adapter and the layers it gets, after checking that the
        combination is exact."""
        if adapter_name in self.peft_config:
            raise ValueError(f"Adapter with name '{adapter_name}' already exists.")
        if not adapters:
            raise ValueError("add_weighted_adapter needs at least one adapter to combine (got none).")
        if len(weights) != len(adapters):
            raise ValueError(
                f"add_weighted_adapter needs one weight per adapter (got {len(adapters)} adapters and "
                f"{len(weights)} weights)."
            )
        if not all(math.isfinite(weight) for weight in weights):
            raise ValueError(f"add_weighted_adapter needs finite weights (got {weights}).")
        for name in adapters:
            if name not in self.peft_config:
                raise ValueError(f"Adapter {name} does not exist")
        configs = [self.peft_config[name] for name in adapters]
        for name, source in zip(adapters, configs, strict=True):
            if source.bias != "none":
                raise ValueError(
                    f"Cannot weight adapter '{name}': it trains biases (bias={source.bias!r}), which live in the base "
                    "model, apply to every adapter and cannot be scaled. Combine adapters trained with bias='none'."
                )
        shapes = {(source.k, source.neuron_fraction) for source in configs}
        if len(shapes) > 1:
            listed = ", ".join(
                f"'{name}': k={source.k}, neuron_fraction={source.neuron_fraction}"
                for name, source in zip(adapters, configs, strict=True)
            )
            raise ValueError(
                f"Cannot combine NeuroAda adapters with different k or neuron_fraction ({listed}): their deltas have "
                "different shapes and tune different input connections. Combine adapters trained with the same ones."
            )
        shared_heads = [
            wrapper
            for wrapper in self.model.modules()
            if isinstance(wrapper, ModulesToSaveWrapper) and sum(n in wrapper.modules_to_save for n in adapters) > 1
        ]
        if shared_heads:
            raise ValueError(
                "Cannot add weighted adapters if they target the same module with modules_to_save, but found "
                f"{len(shared_heads)} such instance(s)."
            )
        layers = {}
        for name, layer in self.model.named_modules():
            if isinstance(layer, NeuroAdaLayer) and any(adapter in layer.neuroada_delta for adapter in adapters):
                if conflict := layer.placement_conflict(adapters):
                    raise ValueError(
                        f"Cannot combine NeuroAda adapters exactly at layer '{name}': {conflict} (their indices "
                        "differ), so no single set of k deltas per neuron holds their sum. Combine adapters trained "
                        "with the same k, neuron_fraction and selection on the same base model, or activate them "
                        "together instead (`model.base_model.set_adapter([...])`), which adds them at weight 1."
                    )
                layers[name] = layer
        return self._config_for_layers(configs, set(layers)), list(layers.values())

    def _config_for_layers(self, sources: list[NeuroAdaConfig], layer_names: set[str]) -> NeuroAdaConfig:
        """The first source's config, with every source's `modules_to_save`, targeting exactly `layer_names`: by the
        first source's own targets where they do, else by the layers' exact names."""
        config = copy.deepcopy(sources[0])
        saved = [module for source in sources for module in source.modules_to_save or ()]
        config.modules_to_save = list(dict.fromkeys(saved)) or None
        inside_layers = tuple(f"{name}." for name in layer_names)
        targeted = {name for name, _ in targeted_modules(self.model, config) if not name.startswith(inside_layers)}
        if targeted != layer_names:
            config.target_modules = "|".join(re.escape(name) for name in sorted(layer_names))
            config.exclude_modules = config.layers_to_transform = config.layers_pattern = None
        return config

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """Mixed-batch inference (`adapter_names=[...]` in forward/generate) the way peft's LoRA offers it.

        NeuroAda layers read the names from a context variable, so concurrent calls in other threads are unaffected;
        peft's `modules_to_save` wrappers get them through forward pre-hooks, as with LoRA.
        """
        adapter_names = kwargs.pop("adapter_names", None)
        if adapter_names is None:
            yield
            return
        if self.training:
            raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
        known = set()
        for module in self.model.modules():
            if isinstance(module, NeuroAdaLayer):
                known |= module.neuroada_delta.keys()
        unexpected = {name for name in adapter_names if name != BASE_ADAPTER_NAME} - known
        if unexpected:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unexpected))}")
        mixed = MixedBatch(list(adapter_names))
        num_beams = kwargs.get("num_beams")
        if isinstance(num_beams, int) and num_beams > 1:
            # Beam search repeats every input num_beams times, except in an encoder.
            encoder = _get_encoder(self.model)
            mixed = MixedBatch(
                [name for name in adapter_names for _ in range(num_beams)],
                list(adapter_names),
                frozenset(id(m) for m in encoder.modules()) if encoder is not None else frozenset(),
            )
        hooks = [
            module.register_forward_pre_hook(
                partial(_pass_adapter_names, adapter_names=mixed.for_layer(module)), with_kwargs=True
            )
            for module in self.model.modules()
            if isinstance(module, AuxiliaryTrainingWrapper)
        ]
        try:
            with serving(mixed):
                yield
        finally:
            for hook in hooks:
                hook.remove()

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        # An explicit delta_dtype is the user's choice and must survive peft's float32 upcast.
        if self.peft_config[adapter_name].delta_dtype is None:
            super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype)

    @classmethod
    def _get_adapter_state_dict(
        cls,
        model: nn.Module,
        config: NeuroAdaConfig,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
        unwanted_adapter_names: list[str],
    ) -> dict[str, torch.Tensor]:
        """The adapter's tensors, index buffers as the layers hold them (index_storage.py: what transformers' own
        adapter loading can assign back by name)."""
        selected = super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        selected.update(_entries_of_wrapped_layers(model, adapter_name, state_dict))
        return selected

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls, model: nn.Module, config: NeuroAdaConfig, adapter_name: str, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        remapped = super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        for name, module in model.named_modules():
            if isinstance(module, NeuroAdaLayer) and adapter_name in module.neuroada_indices:
                module.check_saved_tensors(name, adapter_name, remapped)
        return remapped


def targeted_modules(model: nn.Module, config: NeuroAdaConfig) -> list[tuple[str, nn.Module]]:
    """The modules `config` adapts in `model`, resolving default and "all-linear" targets as injection does."""
    config = copy.deepcopy(config)
    if config.target_modules is None:
        config.target_modules = default_targets(getattr(getattr(model, "config", None), "model_type", None))
    config = _maybe_include_all_linear_layers(config, model)
    return [(name, module) for name, module in model.named_modules() if check_target_module_exists(config, name)]


def trained_biases(model: nn.Module, bias: str) -> list[nn.Parameter]:
    """The biases a config's `bias` option trains, chosen as peft's BaseTuner chooses them."""
    if bias == "all":
        return [p for n, p in model.named_parameters() if n == "bias" or n.endswith(".bias")]
    return [m.bias for m in model.modules() if isinstance(m, NeuroAdaLayer) and m.bias is not None]


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


def _pass_adapter_names(module: nn.Module, args: tuple, kwargs: dict, adapter_names: list[str]):
    return args, {**kwargs, "adapter_names": adapter_names}


def _get_encoder(model: nn.Module) -> nn.Module | None:
    """The encoder of an encoder-decoder model, None otherwise (transformers 5 returns the model itself then)."""
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else None
    return None if encoder is model else encoder


def _storage_key(tensor: torch.Tensor) -> tuple:
    """Tensors with equal keys share memory (for tensors without plain storage: only the tensor itself)."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        pointer = 0
    return (tensor.device, pointer) if pointer else ("object", id(tensor))


def mark_shared_weights(model: nn.Module) -> None:
    """Record on every NeuroAda layer which other modules hold its base weight (the same tensor, or its memory)."""
    holders: dict[tuple, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for tensor in itertools.chain(module._parameters.values(), module._buffers.values()):
            if tensor is not None:
                holders.setdefault(_storage_key(tensor), []).append((name, module))
    for module in model.modules():
        if isinstance(module, NeuroAdaLayer):
            base = module.get_base_layer()
            others = {name for name, holder in holders.get(_storage_key(base.weight), []) if holder is not base}
            module.weight_shared_with = tuple(sorted(others))


def _entries_of_wrapped_layers(
    model: nn.Module, adapter_name: str, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The adapter's entries for layers inside FSDP1 or activation-checkpointing wrappers.

    peft maps tuner layers to state-dict keys by module name and drops FSDP1's wrapper name only where it leads the
    name; auto-wrapping puts it in the middle (`layers.0._fsdp_wrapped_module.self_attn.q_proj`), and peft would
    save an empty adapter.
    """
    entries = {}
    for name, module in model.named_modules():
        key_prefix = _without_wrapper_names(name)
        if key_prefix == name or not isinstance(module, NeuroAdaLayer):
            continue
        for attribute in SAVED_TENSORS:
            key = f"{key_prefix}.{attribute}.{adapter_name}"
            if key in state_dict:
                entries[key] = state_dict[key]
    return entries


def _check_tensors_before_load(model: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *_) -> None:
    """Refuse, before anything loads, a state dict that would copy invalid indices into an adapter's index buffers
    (what `load_state_dict` does in accelerate, DeepSpeed and FSDP resumes; kernels and merges would write other
    weight entries), or change a merged adapter's deltas or indices (the merged weights would go on serving the old
    values). `load_state_dict` and `set_peft_model_state_dict` both run this first: it is a load pre-hook of the
    tuner model, which holds every adapter layer."""
    for name, layer in model.named_modules():
        if isinstance(layer, NeuroAdaLayer):
            _check_layer_tensors_before_load(layer, f"{prefix}{name}", state_dict)


def _check_layer_tensors_before_load(layer: NeuroAdaLayer, name: str, state_dict: dict[str, torch.Tensor]) -> None:
    for adapter in layer.neuroada_delta:
        shape = layer.neuroada_delta[adapter].shape
        loaded = {attribute: state_dict.get(f"{name}.{attribute}.{adapter}") for attribute in SAVED_TENSORS}
        if problem := layer.placement_problem(shape, loaded["neuroada_indices"], loaded["neuroada_rows"]):
            raise ValueError(
                f"Refusing to load adapter '{adapter}' at layer '{name}': {problem}. Nothing was loaded. The state "
                "dict does not hold this adapter as saved from this model (damaged, edited, or from another adapter "
                "or base model): load a checkpoint of this model, or load the adapter from its saved files."
            )
        if adapter in layer.merged_adapters and any(
            tensor is not None and not _same_values(tensor, getattr(layer, attribute)[adapter])
            for attribute, tensor in loaded.items()
            if adapter in getattr(layer, attribute)
        ):
            raise ValueError(
                f"Cannot load new values into adapter '{adapter}' (layer '{name}'): it is merged into the base "
                "weights, which would keep serving its old values. Unmerge it first (`model.unmerge_adapter()`), "
                "load, then merge again if you want it merged."
            )


def _same_values(loaded: torch.Tensor, current: torch.Tensor) -> bool:
    if loaded.shape != current.shape or loaded.is_meta:
        return False
    return torch.equal(loaded.to(device=current.device, dtype=current.dtype), current.detach())


def _without_wrapper_names(name: str) -> str:
    """A module's name as state-dict keys give it: without FSDP1 or activation-checkpointing wrapper names."""
    for wrapper in _WRAPPER_NAMES:
        name = name.replace(wrapper, "")
    return name
