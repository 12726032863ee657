"""NeuroAdaModel: NeuroAda layers in a model's linear layers and, through `target_parameters`, expert parameters;
mixed batches served as LoRA's model serves them."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

from peft.tuners.lora.model import _adapter_names_pre_forward_hook, _get_encoder
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import get_quantization_kwargs, resolve_quantization_backend
from peft.utils.other import AuxiliaryTrainingWrapper
from peft.utils.quantization_utils import ForwardOnlyQuantizationBackend
from torch import nn
from transformers.pytorch_utils import Conv1D

from .config import PREFIX, TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING, NeuroAdaConfig
from .experts import ParamWrapper, expert_projections
from .layer import Linear, NeuroAdaLayer
from .selection import STRATEGIES

BASE_ADAPTER_NAME = "__base__"
TARGETS_REQUIRED = "Please specify `target_modules` or `target_parameters` in `peft_config`"  # LoRA's refusal
MIXED_BATCH_REFUSAL = (
    "NeuroAda target_parameters (expert weights) do not serve mixed batches (`adapter_names`), as peft's LoRA "
    "ParamWrapper does not: run one adapter per call, or merge it."
)


class MixedBatch(NamedTuple):
    """peft's `adapter_names` of a forward/generate call, per row; under beam search the encoder layers of an
    encoder-decoder model see the unrepeated names."""

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
    linear_layer_cls = Linear  # what wraps a linear layer
    target_module_mapping = TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING

    def _prepare_adapter_config(self, peft_config: NeuroAdaConfig, model_config: dict) -> NeuroAdaConfig:
        """peft's defaults (the architecture's projections), and the model's expert projections; as LoRA's, an
        architecture without defaults takes `target_parameters` alone."""
        defaulted = peft_config.target_modules is None
        if defaulted and model_config.get("model_type") not in self.target_module_mapping:
            if not peft_config.target_parameters:
                raise ValueError(TARGETS_REQUIRED)
            return peft_config
        peft_config = super()._prepare_adapter_config(peft_config, model_config)
        if defaulted and peft_config.target_parameters is None:
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
        """A NeuroAda layer in place of `target`, or a new adapter on one already there (of the same parameter)."""
        if isinstance(target, NeuroAdaLayer) and getattr(target, "parameter_name", None) == optional_kwargs.get(
            "parameter_name"
        ):
            target.update_layer(adapter_name, config, layer_name=current_key)
            return
        new_module = self._create_new_module(config, adapter_name, target, current_key, self, **optional_kwargs)
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
        **components: Any,
    ) -> NeuroAdaLayer:
        """A `ParamWrapper` around an expert parameter, else a `linear_layer_cls`; refuses a module NeuroAda cannot
        adapt. `components`: the layer's (`NeuroAdaLayer.COMPONENTS`), where other than the plain ones."""
        if parameter_name is not None:
            return ParamWrapper(target, adapter_name, parameter_name, config, layer_name=current_key, **components)
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
                f"Target module '{current_key}' of type {type(base).__name__} is not supported: NeuroAda adapts "
                "only torch.nn.Linear, transformers' Conv1D and the quantized linear layers peft knows. Remove it "
                "from target_modules or add it to exclude_modules."
            )
        fan_in_fan_out = isinstance(base, Conv1D)
        if fan_in_fan_out != config.fan_in_fan_out:
            warnings.warn(
                f"fan_in_fan_out={config.fan_in_fan_out} does not match {type(base).__name__} layers; "
                f"using fan_in_fan_out={fan_in_fan_out} for them.",
                stacklevel=2,
            )
            config.fan_in_fan_out = fan_in_fan_out  # as LoRA does: the saved config then loads without the warning
        layer_kwargs = {"fan_in_fan_out": fan_in_fan_out, "layer_name": current_key, **kwargs, **components}
        return cls.linear_layer_cls(target, adapter_name, config, **layer_kwargs)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """peft's float32 upcast, but not of deltas whose `delta_dtype` the saved config fixes (the paper's bf16)."""
        if self.peft_config[adapter_name].delta_dtype is None:
            super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype)

    def _post_injection_hook(self, model: nn.Module, config: NeuroAdaConfig, adapter_name: str) -> None:
        """Says what a selection strategy needs before training (`Strategy.then`), once per new adapter."""
        super()._post_injection_hook(model, config, adapter_name)
        if (then := STRATEGIES[config.selection].then) is not None and not config.inference_mode:
            warnings.warn(f"Adapter '{adapter_name}' uses selection='{config.selection}': {then}.", stacklevel=2)

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """Mixed batches (`adapter_names=[...]` in forward/generate) as LoRA's."""
        mixed = self._mixed_batch(kwargs.pop("adapter_names", None), kwargs.get("num_beams"))
        if mixed is None:
            yield
            return
        with self._serving(mixed):
            yield

    @contextmanager
    def _serving(self, mixed: MixedBatch) -> Iterator[None]:
        """Within the block, forward pre-hooks hand each layer its rows' adapter names, as LoRA's do."""
        hooks = [  # (a layer given a `mixed_batch_names` component reads the names itself)
            module.register_forward_pre_hook(
                partial(_adapter_names_pre_forward_hook, adapter_names=mixed.for_layer(module)), with_kwargs=True
            )
            for module in self.model.modules()
            if isinstance(module, AuxiliaryTrainingWrapper)
            or (isinstance(module, Linear) and module.mixed_batch_names is None)
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
