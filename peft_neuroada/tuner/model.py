"""NeuroAdaModel: wires NeuroAda layers into a model and checks adapters against it on load."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch
from peft.tuners.lora.model import _adapter_names_pre_forward_hook, _get_encoder
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import get_quantization_kwargs, resolve_quantization_backend
from peft.utils.other import AuxiliaryTrainingWrapper
from peft.utils.quantization_utils import ForwardOnlyQuantizationBackend
from torch import nn
from transformers.pytorch_utils import Conv1D

from .config import (
    EXPERT_PROJECTIONS,
    PREFIX,
    TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING,
    NeuroAdaConfig,
    default_targets,
)
from .experts import MIXED_BATCH_REFUSAL, ParamWrapper
from .index_storage import BUFFER_DTYPE
from .layer import BASE_ADAPTER_NAME, Linear, NeuroAdaLayer
from .selection import STRATEGIES
from .state_checks import INDEX_TENSORS, check_layer_state, check_saved_tensors


class MixedBatch(NamedTuple):
    """peft's `adapter_names` of a forward/generate call, per row (`"__base__"`: none); under beam search the encoder
    layers of an encoder-decoder model see the unrepeated names."""

    names: list[str]
    encoder_names: list[str] | None = None
    encoder_layers: frozenset[int] = frozenset()

    def for_layer(self, layer: nn.Module) -> list[str]:
        return self.encoder_names if id(layer) in self.encoder_layers else self.names


class NeuroAdaModel(BaseTuner):
    """Creates a NeuroAda model from a pretrained transformers model: each neuron (output row) of the targeted linear
    layers gets `k` trainable deltas on its inputs of largest magnitude, selected once from the frozen weights. The
    method is described in "NeuroAda: Activating Each Neuron's Potential for Parameter-Efficient Fine-Tuning" (EMNLP
    2025; code: https://github.com/FightingFighting/NeuroAda).

    Args:
        model ([`torch.nn.Module`]): The model to be adapted.
        config ([`NeuroAdaConfig`]): The configuration of the NeuroAda model.
        adapter_name (`str`): The name of the adapter, defaults to `"default"`.
        low_cpu_mem_usage (`bool`, `optional`, defaults to `False`):
            Create empty adapter weights on meta device. Useful to speed up the loading process.

    Returns:
        `torch.nn.Module`: The NeuroAda model.

    Example:
        ```py
        >>> from peft import NeuroAdaConfig, get_peft_model
        >>> model = get_peft_model(base_model, NeuroAdaConfig(k=1))
        >>> model.print_trainable_parameters()
        ```
    """

    prefix: str = PREFIX
    tuner_layer_cls = NeuroAdaLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Checks every layer's indices before any loads, for resumes that call `load_state_dict` (peft does not)."""
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_pre_hook(_check_before_load)

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls, model: nn.Module, config: NeuroAdaConfig, adapter_name: str, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """peft's, with saved indices checked and turned into the layers' buffers; warns if chosen on another base."""
        remapped = super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        elsewhere = [
            name
            for name, module in model.named_modules()
            if isinstance(module, NeuroAdaLayer) and adapter_name in module.neuroada_indices
            if check_saved_tensors(module, name, adapter_name, remapped)
        ]
        if elsewhere and config.selection in STRATEGIES:  # (columns re-selected by gradient are the user's choice)
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

    def _prepare_adapter_config(self, peft_config: NeuroAdaConfig, model_config: dict) -> NeuroAdaConfig:
        """Defaults: the paper's projections the model has, its experts' included."""
        if peft_config.target_modules is None:
            peft_config.target_modules = default_targets(model_config.get("model_type"))
            if peft_config.target_parameters is None:
                peft_config.target_parameters = sorted({short for short, _ in expert_projections(self.model)}) or None
        return peft_config

    def _check_new_adapter_config(self, config: NeuroAdaConfig) -> None:
        """As LoRA's: adapters with target_parameters target the same ones (the saved keys encode the nesting)."""
        super()._check_new_adapter_config(config)
        for name, other in self.peft_config.items():
            if other is not config and other.target_parameters and config.target_parameters:
                if set(other.target_parameters) != set(config.target_parameters):
                    raise ValueError(
                        "NeuroAda adapters with target_parameters must all target the same parameters, but the new "
                        f"adapter targets {sorted(config.target_parameters)} and adapter '{name}' "
                        f"{sorted(other.target_parameters)}. Give it the same target_parameters."
                    )

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        """peft's, then marks shared weights, so that a layer merged directly (`layer.merge()`) refuses one too."""
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        mark_shared_weights(model)

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
        """A NeuroAda layer (or expert wrapper) in place of `target`, or a new adapter on one already there."""
        parameter_name = optional_kwargs.get("parameter_name")
        if isinstance(target, NeuroAdaLayer) and getattr(target, "parameter_name", None) == parameter_name:
            target.update_layer(adapter_name, config, layer_name=current_key)
            return
        new_module = self._create_new_module(config, adapter_name, target, current_key, self, parameter_name)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

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
        if parameter_name is not None:
            return ParamWrapper(target, adapter_name, parameter_name, config, layer_name=current_key)
        return Linear(target, adapter_name, config, **cls._linear_kwargs(config, target, current_key, tuner))

    @staticmethod
    def _linear_kwargs(config: NeuroAdaConfig, target: nn.Module, current_key: str, tuner: BaseTuner) -> dict:
        """What a `Linear` around `target` is built with; refuses a module NeuroAda cannot adapt."""
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        kwargs = get_quantization_kwargs(tuner)
        linear = isinstance(base, (nn.Linear, Conv1D))
        backend = None if linear else resolve_quantization_backend(base, **kwargs)
        if isinstance(backend, ForwardOnlyQuantizationBackend):  # (selection reads the weights, which these hide)
            raise TypeError(
                f"NeuroAda cannot adapt module '{current_key}': peft cannot dequantize {backend.backend_name} "
                "weights, and NeuroAda selects each neuron's inputs on them. Load the base model unquantized or with "
                "bitsandbytes, HQQ or torchao, or leave the module out of target_modules."
            )
        if not linear and getattr(backend, "layer_type", None) != "linear":
            raise TypeError(
                f"NeuroAda cannot adapt module '{current_key}' of type {type(base).__name__}: only torch.nn.Linear, "
                "transformers' Conv1D and the quantized linear layers peft knows are supported. Remove it from "
                "target_modules or add it to exclude_modules."
            )
        fan_in_fan_out = isinstance(base, Conv1D)
        if fan_in_fan_out != config.fan_in_fan_out:
            warnings.warn(
                f"fan_in_fan_out={config.fan_in_fan_out} does not match {type(base).__name__} layers; "
                f"using fan_in_fan_out={fan_in_fan_out} for them.",
                stacklevel=2,
            )
            config.fan_in_fan_out = fan_in_fan_out  # as LoRA does: the saved config then loads without the warning
        return {"fan_in_fan_out": fan_in_fan_out, "layer_name": current_key, **kwargs}

    def _check_merge_allowed(self) -> None:
        """peft's, then which weights are shared now (a merge into one would change its other holders)."""
        super()._check_merge_allowed()
        mark_shared_weights(self.model)

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """Mixed batches (`adapter_names=[...]`) as LoRA's: pre-hooks hand each layer its rows' adapter names."""
        mixed = self._mixed_batch(kwargs.pop("adapter_names", None), kwargs.get("num_beams"))
        if mixed is None:
            yield
            return
        hooks = [
            module.register_forward_pre_hook(
                partial(_adapter_names_pre_forward_hook, adapter_names=mixed.for_layer(module)), with_kwargs=True
            )
            for module in self.model.modules()
            if isinstance(module, (NeuroAdaLayer, AuxiliaryTrainingWrapper))
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _mixed_batch(self, adapter_names: list[str] | None, num_beams: Any) -> MixedBatch | None:
        """The call's `adapter_names` checked, with what beam search repeats (None: no mixed batch)."""
        if adapter_names is None:
            return None
        if self.training:
            raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
        if any(isinstance(module, ParamWrapper) for module in self.model.modules()):
            raise ValueError(MIXED_BATCH_REFUSAL)
        unexpected = {name for name in adapter_names if name != BASE_ADAPTER_NAME} - self.peft_config.keys()
        if unexpected:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unexpected))}")
        if not (isinstance(num_beams, int) and num_beams > 1):
            return MixedBatch(list(adapter_names))
        # Beam search repeats every input num_beams times, except in an encoder.
        encoder = _get_encoder(self.model)
        return MixedBatch(
            [name for name in adapter_names for _ in range(num_beams)],
            list(adapter_names),
            frozenset(id(m) for m in encoder.modules()) if encoder is not None else frozenset(),
        )

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """peft's float32 upcast, but not of deltas whose `delta_dtype` the saved config fixes (the paper's bf16)."""
        if self.peft_config[adapter_name].delta_dtype is None:
            super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype)


def expert_projections(model: nn.Module) -> list[tuple[str, str]]:
    """The model's MoE expert weights that are projections of the paper's set: (e.g. 'experts.gate_up_proj', full
    name) for every 3-D parameter named in EXPERT_PROJECTIONS."""
    return [
        (".".join(name.split(".")[-2:]), name)
        for name, param in _parameters_without_wrappers(model)
        if param.dim() == 3 and name.rpartition(".")[2] in EXPERT_PROJECTIONS
    ]


def _parameters_without_wrappers(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The model's parameters, named as in the model before any NeuroAda layer wrapped them."""
    for name, param in model.named_parameters():
        if PREFIX not in name:
            yield name.replace(".base_layer", "").replace(".parametrizations.", ".").removesuffix(".original"), param


def _check_before_load(model: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
    for name, layer in model.named_modules():
        if isinstance(layer, NeuroAdaLayer):
            check_layer_state(layer, state_dict, f"{prefix}{name}.")


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
        own = itertools.chain(
            module.named_parameters(recurse=False, remove_duplicate=False),
            module.named_buffers(recurse=False, remove_duplicate=False),
        )
        for _, tensor in own:
            if tensor is not None:
                holders.setdefault(_storage_key(tensor), []).append((name, module))
    for module in model.modules():
        if isinstance(module, NeuroAdaLayer):
            base = module.get_base_layer()
            held = holders.get(_storage_key(module.weight_out_in()), [])
            module.weight_shared_with = tuple(sorted({name for name, holder in held if holder is not base}))
