"""NeuroAdaModel: wires NeuroAda layers into a model."""

from __future__ import annotations

import warnings
from typing import Any

from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import get_quantization_kwargs, resolve_quantization_backend
from peft.utils.quantization_utils import ForwardOnlyQuantizationBackend
from torch import nn
from transformers.pytorch_utils import Conv1D

from .config import PREFIX, TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING, NeuroAdaConfig
from .experts import ExpertsModel
from .guards import GuardedModel
from .layer import Linear, NeuroAdaLayer
from .mixed_batch import MixedBatchModel


class LinearTargets:
    """Which NeuroAda layer replaces a targeted module: a `Linear` around a linear layer; extensions mixed in before
    it create others."""

    @classmethod
    def _create_new_module(
        cls, config: NeuroAdaConfig, adapter_name: str, target: nn.Module, current_key: str, tuner: BaseTuner, **_: Any
    ) -> NeuroAdaLayer:
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
        return {"fan_in_fan_out": fan_in_fan_out, "layer_name": current_key, **kwargs}


class NeuroAdaModel(ExpertsModel, MixedBatchModel, GuardedModel, LinearTargets, BaseTuner):
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

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """peft's float32 upcast, but not of deltas whose `delta_dtype` the saved config fixes (the paper's bf16)."""
        if self.peft_config[adapter_name].delta_dtype is None:
            super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype)
