"""NeuroAda tuner layer: a frozen linear layer plus k trainable deltas per neuron."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features, check_adapters_to_merge
from peft.utils.integrations import gather_params_ctx
from torch import nn
from transformers.pytorch_utils import Conv1D

from .config import DELTA_DTYPES
from .functional import (
    InplaceMergedLinear,
    Placement,
    SparseBypass,
    add_deltas_,
    merged_linear,
    placed_entries,
    restore_,
)
from .selection import layer_generator, select_inputs, select_neurons

# Small but clearly non-zero, so tests with `init_weights=False` see the adapter's effect in any dtype.
_TEST_INIT_STD = 0.05


class NeuroAdaLayer(BaseTunerLayer):
    """Adapter state of one layer, per adapter name: `neuroada_delta` (n, k) trainable values at input columns
    `neuroada_indices` (n, k) of the n tuned neurons; `neuroada_rows` (n,) lists those neurons only when not all
    d_out of them are tuned."""

    adapter_layer_names = ("neuroada_delta",)
    other_param_names = ("neuroada_indices", "neuroada_rows", "inplace_forward", "init_weights")

    def __init__(self, base_layer: nn.Module, fan_in_fan_out: bool = False) -> None:
        self.base_layer = base_layer
        self.fan_in_fan_out = fan_in_fan_out
        self.neuroada_delta = nn.ParameterDict({})
        self.neuroada_indices = BufferDict({}, persistent=True)
        self.neuroada_rows = BufferDict({}, persistent=True)
        self.inplace_forward: dict[str, bool] = {}
        self.init_weights: dict[str, bool] = {}
        # Original weight entries overwritten by each merged adapter: unmerge writes them back bit-exactly.
        self._merge_originals: dict[str, torch.Tensor] = {}
        self._disable_adapters = False
        self.merged_adapters = []
        self.in_features, self.out_features = _get_in_out_features(self.get_base_layer())

    def weight_out_in(self) -> torch.Tensor:
        """The frozen weight as a (d_out, d_in) view, whatever the layer's storage layout."""
        weight = self.get_base_layer().weight
        return weight.T if self.fan_in_fan_out else weight

    def update_layer(
        self,
        adapter_name: str,
        k: int,
        init_weights: bool = True,
        delta_dtype: str | None = None,
        inplace_forward: bool = True,
        selection: str = "magnitude",
        neuron_fraction: float = 1.0,
        seed: int = 0,
        layer_name: str = "",
        inference_mode: bool = False,
        **kwargs: Any,
    ) -> None:
        if k > self.in_features:
            warnings.warn(
                f"NeuroAda k={k} exceeds the {self.in_features} inputs of a {type(self.get_base_layer()).__name__} "
                f"layer; using k={self.in_features} (every input) for it.",
                stacklevel=2,
            )
            k = self.in_features
        generator = layer_generator(seed, layer_name)
        rows = select_neurons(self.out_features, neuron_fraction, generator)
        strategy = "magnitude" if selection == "gradient" else selection
        # ZeRO-3 partitions weights; selection needs each neuron's whole row, so gather it for the duration.
        with gather_params_ctx(self.get_base_layer().weight, modifier_rank=None):
            weight = self.weight_out_in()
            tuned_weight = weight if rows is None else weight[rows.long()]
            self.neuroada_indices[adapter_name] = select_inputs(tuned_weight, k, strategy, generator)
            weight_dtype = weight.dtype
        if rows is not None:
            self.neuroada_rows[adapter_name] = rows
        if delta_dtype is not None:
            dtype = DELTA_DTYPES[delta_dtype]
        else:
            dtype = weight_dtype if weight_dtype.is_floating_point else torch.float32
        neurons = self.out_features if rows is None else rows.numel()
        self.init_weights[adapter_name] = init_weights
        self.neuroada_delta[adapter_name] = nn.Parameter(self._initial_delta(adapter_name, neurons, k, dtype))
        self.inplace_forward[adapter_name] = inplace_forward
        self._move_adapter_to_device_of_base_layer(adapter_name)
        if delta_dtype is not None:
            self.neuroada_delta[adapter_name] = nn.Parameter(self.neuroada_delta[adapter_name].to(dtype))
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def _initial_delta(self, adapter_name: str, neurons: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        delta = torch.zeros(neurons, k, dtype=dtype, device=self.get_base_layer().weight.device)
        return delta if self.init_weights[adapter_name] else delta.normal_(std=_TEST_INIT_STD)

    def placement(self, adapter_name: str) -> Placement:
        rows = self.neuroada_rows[adapter_name] if adapter_name in self.neuroada_rows else None
        return Placement(self.neuroada_indices[adapter_name], rows)

    def reselect(self, adapter_name: str, cols: torch.Tensor) -> None:
        """Move an adapter to new input columns (same tuned neurons) and restart its deltas from initialisation."""
        delta = self.neuroada_delta[adapter_name]
        self.neuroada_indices[adapter_name] = cols.to(self.neuroada_indices[adapter_name].dtype)
        with torch.no_grad():
            delta.copy_(self._initial_delta(adapter_name, *delta.shape, delta.dtype))

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The adapter as a dense weight-shaped tensor (for inspection and tests; training never builds it)."""
        delta = self.neuroada_delta[adapter_name].detach()
        dense = torch.zeros(self.out_features, self.in_features, dtype=delta.dtype, device=delta.device)
        add_deltas_(dense, [self.placement(adapter_name)], [delta])
        return dense.T if self.fan_in_fan_out else dense

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the deltas into the base weight, keeping the overwritten entries for an exact unmerge.

        With `safe_merge=True` a merge that would put NaN or inf into the weight is undone exactly and refused.
        """
        weight = self.weight_out_in()
        for name in check_adapters_to_merge(self, adapter_names):
            if name not in self.neuroada_delta:
                continue
            placement = self.placement(name)
            with torch.no_grad():
                (originals,) = add_deltas_(weight, [placement], [self.neuroada_delta[name]])
                if safe_merge and not torch.isfinite(placed_entries(weight, placement)).all():
                    restore_(weight, [placement], [originals])
                    raise ValueError(
                        f"Refusing to merge adapter '{name}': it would put NaN/inf values into the base weight, "
                        "so its deltas are broken (check the training loss and learning rate)."
                    )
            self._merge_originals[name] = originals
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """Restore the exact original weight entries, most recently merged adapter first."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        weight = self.weight_out_in()
        with torch.no_grad():
            while self.merged_adapters:
                name = self.merged_adapters.pop()
                restore_(weight, [self.placement(name)], [self._merge_originals.pop(name)])

    def _inplace_forward_is_safe(self, adapter_names: list[str]) -> bool:
        """Whether the weight can be modified for the duration of one matmul (see `NeuroAdaConfig.inplace_forward`)."""
        base = self.get_base_layer()
        weight = base.weight
        return (
            all(self.inplace_forward[name] for name in adapter_names)
            and (type(base) is nn.Linear or type(base) is Conv1D)
            and type(weight) in (nn.Parameter, torch.Tensor)
            and weight.dtype.is_floating_point
            and not weight.is_meta
            and not weight.requires_grad
            and (base.bias is None or not base.bias.requires_grad)
            and not (base._forward_hooks or base._forward_pre_hooks)
            and not torch.compiler.is_compiling()
        )


class Linear(nn.Module, NeuroAdaLayer):
    """NeuroAda around `nn.Linear` (weight d_out x d_in) or transformers' `Conv1D` (weight d_in x d_out)."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, fan_in_fan_out: bool = False, **kwargs: Any) -> None:
        super().__init__()
        NeuroAdaLayer.__init__(self, base_layer, fan_in_fan_out=fan_in_fan_out)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, **kwargs)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        active = [name for name in self.active_adapters if name in self.neuroada_delta]
        if self.merged or not active:
            return self.base_layer(x, *args, **kwargs)
        placements = tuple(self.placement(name) for name in active)
        deltas = [self.neuroada_delta[name] for name in active]
        if self._inplace_forward_is_safe(active):
            # Under no_grad (inference, generation) autograd.Function still reports the deltas as needing gradients.
            merged = InplaceMergedLinear.apply if torch.is_grad_enabled() else merged_linear
            return merged(x, self.weight_out_in(), self.get_base_layer().bias, placements, *deltas)
        result = self.base_layer(x, *args, **kwargs)
        for placement, delta in zip(placements, deltas, strict=True):
            result = result + SparseBypass.apply(x, placement, self.out_features, delta).to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "neuroada." + super().__repr__()
