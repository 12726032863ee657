"""NeuroAda layers: a frozen linear layer plus k trainable deltas per neuron, `y = base(x) + (P ⊙ Θ) x`.

The layers hold the adapters' state (deltas and index buffers), add and remove adapters, and merge and unmerge them
exactly; how the output and gradients are computed is forward.py's.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features, check_adapters_to_merge
from peft.utils import quantization_extra_repr, resolve_quantization_backend
from peft.utils.integrations import gather_params_ctx
from torch import nn

from . import forward
from .config import DTYPES, NeuroAdaConfig
from .forward import Placement, placed_entries, write_placed_
from .guards import GuardedLayer
from .merged_copy import MergedCopyForward
from .mixed_batch import MixedBatchLinear
from .quantized_merge import Offloaded, QuantizedMerge
from .selection import INDEX_DTYPE, layer_generator, select_inputs, select_neurons

# Small but clearly non-zero, so tests with `init_weights=False` see the adapter's effect in any dtype.
_TEST_INIT_STD = 0.05
LOAD_WEIGHTS_HINT = (
    "NeuroAda selects each neuron's inputs from the base weights, so they must be in memory: load the model without "
    "offloading (or load it quantized, or on the CPU), add the adapter, and then offload the PeftModel (accelerate)."
)


class QuantizedWeight:
    """A quantized base layer's weight as selection reads it: dequantized by peft's backend (`get_base_weight`)."""

    dtype = torch.float32

    def __init__(self, layer: NeuroAdaLayer, backend: Any) -> None:
        self.layer, self.backend, self.kind = layer, backend, backend.backend_name or type(backend).__name__
        self.base = layer.get_base_layer()
        self.shape, self.device = torch.Size((layer.out_features, layer.in_features)), self.base.weight.device
        self._whole: torch.Tensor | None = None

    def __getitem__(self, index: slice | torch.Tensor) -> torch.Tensor:
        return self.dense()[index]

    def dense(self) -> torch.Tensor:
        if self._whole is None:
            weight = self.layer.get_base_weight()
            self.stored_dtype, self._whole = weight.dtype, weight.float().reshape(self.shape)
        return self._whole


class NeuroAdaLayer(BaseTunerLayer):
    """Adapter state of one layer, per adapter name: `neuroada_delta` (n, k) trainable values at input columns
    `placement(name).cols` (n, k) of the n tuned neurons, held as (n, k) int32 in `neuroada_indices`;
    `neuroada_rows` (n,) lists those neurons only when not all d_out of them are tuned."""

    adapter_layer_names = ("neuroada_delta",)
    other_param_names = ("neuroada_indices", "neuroada_rows", "init_weights", "delta_dtype")
    # The forward's products, functions of tensors (`forward.Kernels`); a layer may be given faster ones.
    kernels = forward.Kernels()

    def __init__(self, base_layer: nn.Module, fan_in_fan_out: bool = False, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self.fan_in_fan_out = fan_in_fan_out
        self.neuroada_delta = nn.ParameterDict({})
        self.neuroada_indices = BufferDict({}, persistent=True)
        self.neuroada_rows = BufferDict({}, persistent=True)
        self.init_weights: dict[str, bool] = {}
        self.delta_dtype: dict[str, torch.dtype] = {}  # per adapter whose config fixes the deltas' dtype
        # Per merged adapter, what unmerge writes back: the entries it overwrote.
        self._merge_originals: dict[str, tuple[Placement, torch.Tensor]] = {}
        self.get_apply_tensor_subclass = kwargs.get("get_apply_tensor_subclass")  # for a torchao base's backend
        # peft's backend for a quantized base (None: a float weight, or torchao without its config: `quantized` asks)
        try:
            self.quantization_backend = self._resolved_backend()
        except ValueError:
            self.quantization_backend = None
        self._disable_adapters = False
        self.merged_adapters = []
        self.layer_name = ""  # the module's name in the model, for messages (set by update_layer)
        self.in_features, self.out_features = self.in_out_features()

    def in_out_features(self) -> tuple[int, int]:
        """d_in and d_out of the frozen weight (every neuron a row)."""
        return _get_in_out_features(self.get_base_layer())

    def weight_out_in(self) -> torch.Tensor:
        """The frozen weight as a (d_out, d_in) view, whatever the layer's storage layout."""
        weight = self.get_base_layer().weight
        return weight.T if self.fan_in_fan_out else weight

    def unreadable(self) -> str | None:
        """Why the frozen weight's values cannot be read to select inputs (None: they can)."""
        return "it is on the meta device (offloaded or not loaded)" if self.weight_out_in().is_meta else None

    def base_weight(self) -> torch.Tensor:
        """The (d_out, d_in) weight without merged adapters (a copy while some are): selection reads base weights."""
        weight = self.weight_out_in()
        if not self._merge_originals:
            return weight
        weight = weight.detach().clone()
        for name in reversed(self.merged_adapters):
            write_placed_(weight, *self._merged_entries(name, weight))
        return weight

    def _merged_entries(self, name: str, weight: torch.Tensor) -> tuple[Placement, torch.Tensor]:
        """Where a merged adapter sits and what it overwrote, as `weight` is now (it may have been cast or moved)."""
        placement, originals = self._merge_originals[name]
        return placement.copy(weight.device), originals.to(device=weight.device, dtype=weight.dtype)

    def _resolved_backend(self) -> Any:
        return resolve_quantization_backend(
            self.get_base_layer(), get_apply_tensor_subclass=self.get_apply_tensor_subclass
        )

    def quantized(self) -> QuantizedWeight | None:
        """The base layer seen as its dequantized weight (None for a plain float weight)."""
        backend = self.quantization_backend or self._resolved_backend()
        return None if backend is None else QuantizedWeight(self, backend)

    def update_layer(self, adapter_name: str, config: NeuroAdaConfig, layer_name: str = "", **kwargs: Any) -> None:
        """Add an adapter: select each neuron's inputs on the frozen weight and create its deltas. `layer_name` (the
        module's name in the model) seeds random choices, so every process picks the same ones."""
        k, self.layer_name = min(config.k, self.in_features), layer_name or self.layer_name
        if k < config.k:
            kind = type(self.get_base_layer()).__name__
            message = (
                f"NeuroAda k={config.k} exceeds the {k} inputs of a {kind} layer; using k={k} (every input) for it."
            )
            warnings.warn(message, stacklevel=2)
        if reason := self.unreadable():
            raise ValueError(
                f"NeuroAda cannot select inputs for layer '{self.layer_name}': {reason}. {LOAD_WEIGHTS_HINT}"
            )
        neurons, dtype = self._select(adapter_name, config, k)
        if config.delta_dtype is not None:
            dtype = self.delta_dtype[adapter_name] = DTYPES[config.delta_dtype]
        elif not dtype.is_floating_point:
            dtype = torch.float32
        self.init_weights[adapter_name] = config.init_weights
        self.neuroada_delta[adapter_name] = nn.Parameter(self._initial_delta(adapter_name, neurons, k, dtype))
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: torch.device | None = None) -> None:
        """peft's, which also casts float adapter tensors to the base layer's dtype; deltas whose dtype the config
        fixes (`delta_dtype`) keep it, wherever peft moves them (creation, and `low_cpu_mem_usage` loads, which assign
        the saved tensors and then move them)."""
        dtype = self.delta_dtype.get(adapter_name)
        delta = self.neuroada_delta.get(adapter_name) if dtype is not None else None
        super()._move_adapter_to_device_of_base_layer(adapter_name, device)
        if delta is not None and not delta.is_meta:
            moved = delta.to(device=self.neuroada_delta[adapter_name].device, dtype=dtype)
            self.neuroada_delta[adapter_name] = nn.Parameter(moved, requires_grad=delta.requires_grad)

    def _select(self, adapter_name: str, config: NeuroAdaConfig, k: int) -> tuple[int, torch.dtype]:
        """Choose the neurons and k inputs each; returns how many neurons, and the dtype the weight was read in."""
        generator = layer_generator(config.selection_seed, self.layer_name)
        rows = select_neurons(self.out_features, config.neuron_fraction, generator)
        quantized = self.quantized()
        # ZeRO-3 partitions weights; selection needs each neuron's whole row, so gather it for the duration.
        with gather_params_ctx(self.weight_out_in(), modifier_rank=None):
            weight = self.base_weight().reshape(-1, self.in_features) if quantized is None else quantized
            cols = select_inputs(weight if rows is None else weight[rows.long()], k, config.selection, generator)
            self.neuroada_indices[adapter_name] = cols.to(INDEX_DTYPE)
        if rows is not None:
            self.neuroada_rows[adapter_name] = rows
        return (self.out_features if rows is None else rows.numel()), weight.dtype

    def _initial_delta(self, adapter_name: str, neurons: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        delta = torch.zeros(neurons, k, dtype=dtype, device=self.weight_out_in().device)
        return delta if self.init_weights[adapter_name] else delta.normal_(std=_TEST_INIT_STD)

    def placement(self, adapter_name: str) -> Placement:
        """Where the adapter's deltas sit: its (n, k) columns and its rows."""
        buffer = self.neuroada_indices[adapter_name]
        rows = self.neuroada_rows[adapter_name] if adapter_name in self.neuroada_rows else None
        return Placement(buffer, rows).prepared()

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The adapter as a dense weight-shaped tensor (for inspection and tests; training never builds it)."""
        delta = self.neuroada_delta[adapter_name].detach()
        dense = torch.zeros(self.out_features, self.in_features, dtype=delta.dtype, device=delta.device)
        write_placed_(dense, self.placement(adapter_name), delta)
        return dense.T if self.fan_in_fan_out else dense

    def _weight_writes(self, weight: torch.Tensor) -> AbstractContextManager:
        """Inference tensors accept writes only in inference mode."""
        return torch.inference_mode() if weight.is_inference() else torch.no_grad()

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the deltas into the base weight, keeping what they overwrite for an exact unmerge; all or nothing."""
        names = [name for name in check_adapters_to_merge(self, adapter_names) if name in self.neuroada_delta]
        if not names:
            return
        self.check_mergeable()
        weight = self.weight_out_in()
        if self.quantized() is None and weight.is_meta:
            raise ValueError(f"Cannot merge NeuroAda deltas into a weight on the meta device. {LOAD_WEIGHTS_HINT}")
        merged_before = len(self.merged_adapters)
        try:
            with self._weight_writes(weight):
                for name in names:
                    self._merge_one(name, safe_merge)
        except BaseException:
            self.unmerge_to(merged_before)
            raise

    def _merge_one(self, name: str, safe_merge: bool) -> None:
        """Add one adapter's deltas, keeping the entries they overwrite."""
        weight, placement = self.weight_out_in(), self.placement(name)
        originals = placed_entries(weight, placement)
        merged = originals + self.neuroada_delta[name].detach().to(originals.dtype)
        self.check_finite(name, merged, safe_merge)
        self._merge_originals[name] = (placement.copy(), originals)
        self.merged_adapters.append(name)
        write_placed_(weight, placement, merged)

    def check_finite(self, name: str, merged: torch.Tensor, safe_merge: bool) -> None:
        if safe_merge and not torch.isfinite(merged).all():
            raise ValueError(
                f"NaNs detected in the merged weights. The adapter {name} seems to be broken: merging it would put "
                "NaN/inf values into the base weight (check the training loss and learning rate)."
            )

    def check_mergeable(self) -> None:
        """Refuse a quantized weight before anything changes (a merge would have to quantize it again)."""
        if (quantized := self.quantized()) is not None:
            raise ValueError(
                f"Cannot merge NeuroAda deltas into '{self.layer_name or 'this layer'}': its weight is quantized "
                f"({quantized.kind}). To merge, load the base model in float32/bfloat16 and merge there."
            )

    def unmerge(self) -> None:
        """Restore the exact original weight entries, most recently merged adapter first."""
        if not self.merged:
            return warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
        self.unmerge_to(0)

    def unmerge_to(self, count: int) -> None:
        """Unmerge the latest merged adapters until `count` remain, all or nothing."""
        weight = self.weight_out_in()
        undone = []
        try:
            with self._weight_writes(weight):
                while len(self.merged_adapters) > count:
                    name = self.merged_adapters[-1]
                    placement, originals = self._merged_entries(name, weight)
                    undone.append((name, placement, originals, placed_entries(weight, placement)))
                    write_placed_(weight, placement, originals)
                    del self._merge_originals[name]
                    self.merged_adapters.pop()
        except BaseException:
            with self._weight_writes(weight):
                for name, placement, originals, merged in reversed(undone):
                    write_placed_(weight, placement, merged)
                    self._merge_originals[name] = (placement, originals)
                    if name not in self.merged_adapters:
                        self.merged_adapters.append(name)
            raise


class LinearForward:
    """How a NeuroAda layer runs its active adapters: `forward` chooses between the base layer and `_adapted`, which
    for a linear layer is `forward.bypassed` (a parameter wrapper has its own); extensions mixed in before it add to
    it."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        active = [name for name in self.active_adapters if name in self.neuroada_delta]
        if self.merged or not active:
            return self.base_layer(x, *args, **kwargs)
        return self._adapted(x, active, *args, **kwargs)

    def _adapted(self, x: torch.Tensor, adapters: list[str], *args: Any, **kwargs: Any) -> torch.Tensor:
        placements = [self.placement(name) for name in adapters]
        deltas = [self.neuroada_delta[name] for name in adapters]
        return forward.bypassed(self.get_base_layer(), x, placements, deltas, self.kernels, *args, **kwargs)


class Linear(
    MixedBatchLinear,
    GuardedLayer,
    QuantizedMerge,
    Offloaded,
    MergedCopyForward,
    LinearForward,
    nn.Module,
    NeuroAdaLayer,
):
    """NeuroAda around `nn.Linear` (weight d_out x d_in), transformers' `Conv1D` (weight d_in x d_out), or a quantized
    linear layer peft has a quantization backend for."""

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: NeuroAdaConfig,
        fan_in_fan_out: bool = False,
        layer_name: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        NeuroAdaLayer.__init__(self, base_layer, fan_in_fan_out=fan_in_fan_out, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_name=layer_name)

    def supports_lora_conversion(self, adapter_name: str = "default") -> bool:
        """NeuroAda is additive, so `peft.tuners.lora.convert_to_lora` approximates it by the delta's SVD (the sparse
        delta's rank is not small: a converted adapter keeps only part of it)."""
        return True

    def _get_additive_delta(self, adapter_name: str = "default") -> torch.Tensor:
        return self.get_delta_weight(adapter_name)

    def extra_repr(self) -> str:
        return quantization_extra_repr(self)

    def __repr__(self) -> str:
        return "neuroada." + super().__repr__()
