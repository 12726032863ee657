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
)
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from transformers.pytorch_utils import Conv1D

from .config import (
    EXPERT_PROJECTIONS,
    FUSED_PROJECTIONS,
    LLAMA_STYLE_TARGETS,
    PREFIX,
    TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING,
    NeuroAdaConfig,
    default_targets,
)
from .experts import MIXED_BATCH_REFUSAL, ParamWrapper
from .layer import BASE_ADAPTER_NAME, LOAD_WEIGHTS_HINT, Linear, MixedBatch, NeuroAdaLayer, serving, unreadable_weight
from .loading import check_saved_deltas, check_saved_tensors
from .peft_compat import PeftCompat, without_wrapper_names
from .quantized import torchao_config_of, unreadable_quantized_weight, unsupported_quantization


class NeuroAdaModel(PeftCompat, BaseTuner):
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

    def _prepare_adapter_config(self, peft_config: NeuroAdaConfig, model_config: dict) -> NeuroAdaConfig:
        """Defaults: the paper's projections the model has, its experts' included; a new adapter that leaves some out
        says which, once."""
        defaulted = peft_config.target_modules is None
        if defaulted:
            peft_config.target_modules = default_targets(model_config.get("model_type"))
            if peft_config.target_parameters is None:
                peft_config.target_parameters = sorted({short for short, _ in expert_projections(self.model)}) or None
        if not peft_config.inference_mode and (left_out := left_out_projections(self.model, peft_config, defaulted)):
            warnings.warn(
                f"NeuroAda leaves these projections of the model unadapted: {', '.join(left_out[:6])}"
                f"{f' and {len(left_out) - 6} more' if len(left_out) > 6 else ''}. To adapt them, add their names to "
                "target_modules (layers) or target_parameters (MoE experts' 3-D weights, e.g. "
                "'experts.gate_up_proj'); to leave them out on purpose, this warning can be ignored.",
                stacklevel=2,
            )
        return peft_config

    def _check_new_adapter_config(self, config: NeuroAdaConfig) -> None:
        """As peft's LoRA: every adapter with target_parameters targets the same ones (their wrappers nest in one
        order, which the saved keys encode)."""
        super()._check_new_adapter_config(config)
        for name, other in self.peft_config.items():
            if other is not config and other.target_parameters and config.target_parameters:
                if set(other.target_parameters) != set(config.target_parameters):
                    raise ValueError(
                        "NeuroAda adapters with target_parameters must all target the same parameters, but the new "
                        f"adapter targets {sorted(config.target_parameters)} and adapter '{name}' "
                        f"{sorted(other.target_parameters)}. Give it the same target_parameters."
                    )

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
        parameter_name = optional_kwargs.get("parameter_name")
        if isinstance(target, NeuroAdaLayer) and getattr(target, "parameter_name", None) == parameter_name:
            target.update_layer(adapter_name, config, layer_name=current_key)
            return
        if parameter_name is not None:
            new_module = ParamWrapper(target, adapter_name, parameter_name, config, layer_name=current_key)
        else:
            new_module = self._create_new_module(config, adapter_name, target, current_key)
        new_module.requantize_with = torchao_config_of(self.model)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    @staticmethod
    def _create_new_module(config: NeuroAdaConfig, adapter_name: str, target: nn.Module, current_key: str) -> Linear:
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if not isinstance(base, (nn.Linear, Conv1D)):
            raise TypeError(
                f"NeuroAda cannot adapt module '{current_key}' of type {type(base).__name__}: only torch.nn.Linear "
                "and transformers' Conv1D are supported. Remove it from target_modules or add it to exclude_modules."
            )
        fan_in_fan_out = isinstance(base, Conv1D)
        if fan_in_fan_out != config.fan_in_fan_out:
            warnings.warn(
                f"fan_in_fan_out={config.fan_in_fan_out} does not match {type(base).__name__} layers; "
                f"using fan_in_fan_out={fan_in_fan_out} for them.",
                stacklevel=2,
            )
            config.fan_in_fan_out = fan_in_fan_out  # as LoRA does: the saved config then loads without the warning
        return Linear(target, adapter_name, config, fan_in_fan_out=fan_in_fan_out, layer_name=current_key)

    def _check_merge_allowed(self) -> None:
        super()._check_merge_allowed()
        mark_shared_weights(self.model)

    def add_weighted_adapter(self, adapters: list[str], weights: list[float], adapter_name: str) -> None:
        """Add adapter `adapter_name` holding `Σ weights[i] · adapters[i]` in every layer any of them adapts: exactly
        what merging each source scaled by its weight would change in the base weights.

        That is exact only where the sources tune the same input connections (one k, neuron_fraction and selection on
        the same base model); anything else is refused before the model changes, naming the layer. `modules_to_save`
        are copied, unweighted, from the one source that saves them. LoRA's `combination_type`s work on low-rank
        factors, which NeuroAda deltas do not have."""
        if refusal := self._weighted_adapter_refusal(adapters, weights, adapter_name):
            raise ValueError(refusal)
        configs = [self.peft_config[name] for name in adapters]
        layers = {
            name: layer
            for name, layer in self.model.named_modules()
            if isinstance(layer, NeuroAdaLayer) and any(adapter in layer.neuroada_delta for adapter in adapters)
        }
        heads = [
            (wrapper, next(name for name in adapters if name in wrapper.modules_to_save))
            for wrapper in self.model.modules()
            if isinstance(wrapper, ModulesToSaveWrapper) and any(name in wrapper.modules_to_save for name in adapters)
        ]
        active = copy.copy(self.active_adapter)
        self.peft_config[adapter_name] = self._config_for_layers(configs, set(layers))
        try:
            self.inject_adapter(self.model, adapter_name)
            for layer in layers.values():
                layer.set_weighted_sum(adapter_name, adapters, weights)
            for wrapper, holder in heads:
                wrapper.modules_to_save[adapter_name].load_state_dict(wrapper.modules_to_save[holder].state_dict())
        except BaseException:
            if adapter_name in self.peft_config:
                self.delete_adapter(adapter_name)
            self.active_adapter = active
            raise

    def _weighted_adapter_refusal(self, adapters: list[str], weights: list[float], adapter_name: str) -> str | None:
        """Why `add_weighted_adapter` cannot combine these exactly, or None."""
        if adapter_name in self.peft_config:
            return f"Adapter with name '{adapter_name}' already exists."
        if not adapters:
            return "add_weighted_adapter needs at least one adapter to combine (got none)."
        if len(weights) != len(adapters):
            got = f"{len(adapters)} adapters and {len(weights)} weights"
            return f"add_weighted_adapter needs one weight per adapter (got {got})."
        if not all(math.isfinite(weight) for weight in weights):
            return f"add_weighted_adapter needs finite weights (got {weights})."
        if missing := [name for name in adapters if name not in self.peft_config]:
            return f"Adapter {missing[0]} does not exist"
        configs = [self.peft_config[name] for name in adapters]
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
        wrappers = [m for m in self.model.modules() if isinstance(m, ModulesToSaveWrapper)]
        if shared := sum(sum(name in wrapper.modules_to_save for name in adapters) > 1 for wrapper in wrappers):
            return (
                "Cannot add weighted adapters if they target the same module with modules_to_save, but found "
                f"{shared} such instance(s)."
            )
        for name, layer in self.model.named_modules():
            if isinstance(layer, NeuroAdaLayer) and (conflict := layer.placement_conflict(adapters)):
                return (
                    f"Cannot combine NeuroAda adapters exactly at layer '{name}': {conflict} (their indices differ), "
                    "so no single set of k deltas per neuron holds their sum. Combine adapters trained with the same "
                    "k, neuron_fraction and selection on the same base model, or activate them together instead "
                    "(`model.base_model.set_adapter([...])`), which adds them at weight 1."
                )
        return None

    def _config_for_layers(self, sources: list[NeuroAdaConfig], layer_names: set[str]) -> NeuroAdaConfig:
        """The first source's config with every source's `modules_to_save`, targeting exactly `layer_names` (by its
        own targets where they do, else by the layers' names)."""
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
        if any(isinstance(module, ParamWrapper) for module in self.model.modules()):
            raise ValueError(MIXED_BATCH_REFUSAL)
        unexpected = {name for name in adapter_names if name != BASE_ADAPTER_NAME} - self.peft_config.keys()
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
    def _remap_adapter_state_dict_for_load(
        cls, model: nn.Module, config: NeuroAdaConfig, adapter_name: str, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        remapped = super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        for name, module in model.named_modules():
            if isinstance(module, NeuroAdaLayer) and adapter_name in module.neuroada_indices:
                check_saved_tensors(module, name, adapter_name, remapped)
        return remapped


def targeted_modules(model: nn.Module, config: NeuroAdaConfig) -> list[tuple[str, nn.Module]]:
    """The modules `config` adapts in `model`, resolving default and "all-linear" targets as injection does."""
    config = copy.deepcopy(config)
    if config.target_modules is None:
        config.target_modules = default_targets(getattr(getattr(model, "config", None), "model_type", None))
    config = _maybe_include_all_linear_layers(config, model)
    return [(name, module) for name, module in model.named_modules() if check_target_module_exists(config, name)]


def targeted_parameters(model: nn.Module, config: NeuroAdaConfig) -> list[tuple[str, nn.Parameter]]:
    """The parameters `config.target_parameters` names in `model`, matched as peft matches them (by full name or
    name suffix), under their names without peft's wrapper levels."""
    targets = config.target_parameters or ()
    return [
        (name, param)
        for name, param in _parameters_without_wrappers(model)
        if any(name == target or name.endswith(f".{target}") for target in targets)
    ]


def expert_projections(model: nn.Module) -> list[tuple[str, str]]:
    """The model's MoE expert weights that are projections of the paper's set: (e.g. 'experts.gate_up_proj', full
    name) for every 3-D parameter named in EXPERT_PROJECTIONS."""
    return [
        (".".join(name.split(".")[-2:]), name)
        for name, param in _parameters_without_wrappers(model)
        if param.dim() == 3 and name.rpartition(".")[2] in EXPERT_PROJECTIONS
    ]


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


def _parameters_without_wrappers(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The model's parameters, named as in the model before any NeuroAda layer wrapped them."""
    for name, param in model.named_parameters():
        if PREFIX not in name:
            yield name.replace(".base_layer", "").replace(".parametrizations.", ".").removesuffix(".original"), param


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
            held = holders.get(_storage_key(module.weight_out_in()), [])
            module.weight_shared_with = tuple(sorted({name for name, holder in held if holder is not base}))
