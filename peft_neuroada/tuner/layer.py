"""NeuroAda layers: a frozen linear layer plus k trainable deltas per neuron, `y = base(x) + (P ⊙ Θ) x`.

`NeuroAdaLayer` holds each adapter's deltas and indices and selects inputs; `Linear` writes out forward, merge and
unmerge. A layer calls components at named points (`NeuroAdaLayer.COMPONENTS`), the plain ones here unless it is
given others (faster products, a cache, checks), as LoRA's layer calls its variants.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from accelerate.hooks import AlignDevicesHook
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features, check_adapters_to_merge
from peft.utils import quantization_extra_repr, resolve_quantization_backend
from peft.utils.integrations import gather_params_ctx
from torch import nn

from . import forward
from .config import DTYPES, NeuroAdaConfig
from .forward import Placement, placed_entries, write_placed_
from .selection import layer_generator, select_inputs, select_neurons

_TEST_INIT_STD = 0.05  # clearly non-zero in any dtype, for tests with `init_weights=False`
LOAD_WEIGHTS_HINT = (
    "NeuroAda selects each neuron's inputs from the base weights, so they must be in memory: load the model without "
    "offloading (or load it quantized, or on the CPU), add the adapter, and then offload the PeftModel (accelerate)."
)
FULL_PRECISION_HINT = (
    "To get a merged model in full precision, load the base model in float32/bfloat16 and call "
    "`PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()`."
)


def unreadable_weight(base: nn.Module) -> str | None:
    """Why the values of `base`'s weight cannot be read to select inputs (None: they can)."""
    hook = getattr(base, "_hf_hook", None)
    if isinstance(hook, AlignDevicesHook) and hook.offload:
        return "it is offloaded by accelerate"
    return "it is on the meta device (offloaded or not loaded)" if base.weight.is_meta else None


class QuantizedWeight:
    """A quantized base as its dequantized (d_out, d_in) float32 weight through peft's backend (`get_base_weight`);
    `replace` quantizes a merged weight again (`set_base_weight`), `snapshot` puts the quantized one back."""

    dtype = torch.float32

    def __init__(self, layer: NeuroAdaLayer, backend: Any) -> None:
        self.layer, self.backend, self.kind = layer, backend, backend.backend_name or type(backend).__name__
        self.base = layer.get_base_layer()
        self.shape, self.device = torch.Size((layer.out_features, layer.in_features)), self.base.weight.device
        self._whole: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: NeuroAdaLayer) -> QuantizedWeight | None:
        backend = layer.quantization_backend or layer.resolved_backend()
        return None if backend is None else cls(layer, backend)

    def __getitem__(self, index: slice | torch.Tensor) -> torch.Tensor:
        return self.dense()[index]

    def dense(self) -> torch.Tensor:
        if self._whole is None:
            weight = self.layer.get_base_weight()
            self.stored_dtype, self._whole = weight.dtype, weight.float().reshape(self.shape)
        return self._whole

    def merge_refusal(self) -> str | None:
        """Why a merged weight cannot be quantized again (None: it can)."""
        if getattr(getattr(self.base.weight, "quant_state", None), "packing_format_for_cpu", False):
            return "bitsandbytes packed this 4-bit weight for CPU inference, a layout it reads back only approximately"
        return None if self.backend.supports_merge else f"peft cannot requantize {self.kind} weights"

    def replace(self, weight: torch.Tensor) -> None:
        self.layer.set_base_weight(weight.to(self.stored_dtype))

    def snapshot(self) -> Callable[[], None]:
        """What puts the quantized weight and its state back as they are now (a backend may replace the module, as
        HQQ's does, and peft's requantizing marks the replaced weight unquantized)."""
        layer, base, weight = self.layer, self.base, self.base.weight
        state = {name: copy.copy(vars(base)[name]) for name in ("state", "quant_state") if name in vars(base)}
        weight_state = dict(vars(weight))

        def restore() -> None:
            layer.base_layer = base
            vars(weight).update(weight_state)
            base.weight = weight
            for name, value in state.items():
                setattr(base, name, value)

        return restore


class NeuroAdaLayer(BaseTunerLayer):
    """Per adapter: `neuroada_delta` (n, k) trainable values at the input columns `neuroada_indices` (n, k) int32 of
    the n tuned neurons; `neuroada_rows` (n,) names those neurons when not all d_out are tuned."""

    adapter_layer_names = ("neuroada_delta",)
    other_param_names = ("neuroada_indices", "neuroada_rows", "neuroada_dropout", "init_weights", "delta_dtype")
    # The components, each replaceable per layer (a keyword of the constructor, or an attribute):
    kernels = forward.Kernels()  # the bypass's products
    placements: Callable[[NeuroAdaLayer, str], Placement] = staticmethod(forward.placement_of)  # where deltas sit
    merged_forward: Callable[..., torch.Tensor] | None = None  # another way to compute base(x) + Σ bypass
    quantized_view: Callable[[NeuroAdaLayer], Any] = QuantizedWeight.of  # a quantized base's dequantized view
    merge_check: Callable[[NeuroAdaLayer, list[str]], None] | None = None  # refuses a merge before anything changes
    mixed_batch_names: Callable[[NeuroAdaLayer], list[str] | None] | None = None  # rows' adapters, if not passed
    COMPONENTS = ("kernels", "placements", "merged_forward", "quantized_view", "merge_check", "mixed_batch_names")

    def __init__(self, base_layer: nn.Module, fan_in_fan_out: bool = False, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self.fan_in_fan_out = fan_in_fan_out
        self.neuroada_delta = nn.ParameterDict({})
        self.neuroada_indices = BufferDict({}, persistent=True)
        self.neuroada_rows = BufferDict({}, persistent=True)
        self.neuroada_dropout = nn.ModuleDict({})
        self.init_weights: dict[str, bool] = {}
        self.delta_dtype: dict[str, torch.dtype] = {}  # per adapter whose config fixes the deltas' dtype
        # Per merged adapter what unmerge writes back: the entries it overwrote, or the replaced quantized weight.
        self._merge_originals: dict[str, tuple[Placement, torch.Tensor]] = {}
        self._quantized_originals: dict[str, Callable[[], None]] = {}
        self.get_apply_tensor_subclass = kwargs.get("get_apply_tensor_subclass")  # for a torchao base's backend
        self.quantization_backend = self.resolved_backend()  # peft's, which get/set_base_weight go through
        for name in self.COMPONENTS:
            if kwargs.get(name) is not None:
                setattr(self, name, kwargs[name])
        self._disable_adapters = False
        self.merged_adapters = []
        self.layer_name = ""  # the module's name in the model, for messages (set by update_layer)
        self.in_features, self.out_features = self.in_out_features()

    def resolved_backend(self) -> Any:
        """peft's quantization backend of the base layer (None: a float weight, or torchao without its config)."""
        try:
            return resolve_quantization_backend(
                self.get_base_layer(), get_apply_tensor_subclass=self.get_apply_tensor_subclass
            )
        except ValueError:
            return None

    def in_out_features(self) -> tuple[int, int]:
        return _get_in_out_features(self.get_base_layer())

    def weight_out_in(self) -> torch.Tensor:
        """The frozen weight as a (d_out, d_in) view, whatever the layer's storage layout."""
        weight = self.get_base_layer().weight
        return weight.T if self.fan_in_fan_out else weight

    def quantized(self) -> Any:
        return self.quantized_view(self)

    def unreadable(self) -> str | None:
        """Why the frozen weight's values cannot be read to select inputs (None: they can)."""
        if self._quantized_originals:
            return "adapters are merged into it"
        return unreadable_weight(self.get_base_layer())

    def base_weight(self) -> torch.Tensor:
        """The (d_out, d_in) weight without merged adapters (a copy while some are), as selection reads it."""
        weight = self.weight_out_in()
        if not self._merge_originals:
            return weight
        weight = weight.detach().clone()
        for name in reversed(self.merged_adapters):
            write_placed_(weight, *self._merged_entries(name, weight))
        return weight

    def _merged_entries(self, name: str, weight: torch.Tensor) -> tuple[Placement, torch.Tensor]:
        """Where a merged adapter sits and what it overwrote, on `weight`'s device and dtype (it may have moved)."""
        placement, originals = self._merge_originals[name]
        return placement.copy(weight.device), originals.to(device=weight.device, dtype=weight.dtype)

    def update_layer(self, adapter_name: str, config: NeuroAdaConfig, layer_name: str = "", **kwargs: Any) -> None:
        """Select each neuron's inputs on the frozen weight and create the adapter's deltas. `layer_name`, the module's
        name, seeds random choices: every process picks the same ones."""
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
        dropout = getattr(config, "neuroada_dropout", 0.0)
        self.neuroada_dropout[adapter_name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.neuroada_delta[adapter_name] = nn.Parameter(self._initial_delta(adapter_name, neurons, k, dtype))
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: torch.device | None = None) -> None:
        """peft's, which casts float adapter tensors to the base's dtype; deltas of a fixed `delta_dtype` keep it."""
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
            tuned = weight if rows is None else weight[rows.long()]
            self.neuroada_indices[adapter_name] = select_inputs(tuned, k, config.selection, generator)
        if rows is not None:
            self.neuroada_rows[adapter_name] = rows
        return (self.out_features if rows is None else rows.numel()), weight.dtype

    def _initial_delta(self, adapter_name: str, neurons: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        delta = torch.zeros(neurons, k, dtype=dtype, device=self.weight_out_in().device)
        return delta if self.init_weights[adapter_name] else delta.normal_(std=_TEST_INIT_STD)

    def placement(self, adapter_name: str) -> Placement:
        """Where the adapter's deltas sit (the `placements` component's answer)."""
        return self.placements(self, adapter_name)

    def _weight_writes(self, weight: torch.Tensor) -> AbstractContextManager:
        """Inference tensors accept writes only in inference mode."""
        return torch.inference_mode() if weight.is_inference() else torch.no_grad()

    def check_mergeable(self, adapter_names: list[str] | None = None) -> None:
        """Refuse a merge before anything changes: a quantized weight peft cannot quantize again, and whatever the
        `merge_check` component refuses."""
        quantized = self.quantized()
        if quantized is not None and (reason := quantized.merge_refusal()):
            name = self.layer_name or "this layer"
            raise ValueError(f"Cannot merge NeuroAda deltas into '{name}': {reason}. {FULL_PRECISION_HINT}")
        if self.merge_check is not None:
            self.merge_check(self, check_adapters_to_merge(self, adapter_names))

    def _merge_adapter(self, name: str, safe_merge: bool) -> None:
        """Add one adapter's deltas into the weight, keeping what they overwrite. A quantized weight is dequantized,
        added to and quantized again through peft's backend (rounded to its grid, as LoRA's merge)."""
        quantized, placement = self.quantized(), self.placement(name)
        weight = self.weight_out_in() if quantized is None else quantized.dense()
        originals = placed_entries(weight, placement)
        merged = originals + self.neuroada_delta[name].detach().to(originals.dtype)
        if safe_merge and not torch.isfinite(merged).all():
            raise ValueError(
                f"NaNs detected in the merged weights. The adapter {name} seems to be broken: merging it would put "
                "NaN/inf values into the base weight (check the training loss and learning rate)."
            )
        if quantized is None:
            self._merge_originals[name] = (placement.copy(), originals)
        else:
            warnings.warn(
                f"Merge NeuroAda deltas into a {quantized.kind} layer may get different generations due to rounding "
                f"errors: the merged weight is quantized again (unmerge restores the original exactly). "
                f"{FULL_PRECISION_HINT}",
                stacklevel=3,
            )
            self._quantized_originals[name] = quantized.snapshot()
        self.merged_adapters.append(name)
        write_placed_(weight, placement, merged)
        if quantized is not None:
            quantized.replace(weight)

    def unmerge_to(self, count: int) -> None:
        """Unmerge the latest adapters until `count` remain, each writing back what it replaced; all or nothing."""
        weight, undone = self.weight_out_in(), []
        try:
            with self._weight_writes(weight):
                while len(self.merged_adapters) > count:
                    name = self.merged_adapters[-1]
                    if name in self._quantized_originals:
                        self._quantized_originals.pop(name)()
                    else:
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

    def offloaded_containers(self) -> list[nn.Module]:
        """The adapter's containers accelerate hooked (the PeftModel offloaded after the adapter was added)."""
        containers = [self.neuroada_delta, self.neuroada_indices, self.neuroada_rows]
        return [container for container in containers if "_hf_hook" in vars(container)]


@contextmanager
def onloaded(containers: Sequence[nn.Module]) -> Iterator[None]:
    """accelerate's hooks of `containers` around the block, as around a call. Not peft's `onload_layer` (a merge's):
    it also rebuilds the base layer's offloaded weights, and writes a disk-offloaded one back, at every call."""
    for container in containers:
        container._hf_hook.pre_forward(container)
    try:
        yield
    finally:
        for container in containers:
            container._hf_hook.post_forward(container, None)


class Linear(nn.Module, NeuroAdaLayer):
    """NeuroAda around `nn.Linear`, transformers' `Conv1D` (weight d_in x d_out), or a quantized linear layer peft has
    a quantization backend for."""

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

    def forward(self, x: torch.Tensor, *args: Any, adapter_names: list[str] | None = None, **kwargs: Any):
        if adapter_names is None and self.mixed_batch_names is not None:
            adapter_names = self.mixed_batch_names(self)
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if adapter_names is not None:
            return self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
        active = [name for name in self.active_adapters if name in self.neuroada_delta]
        if self.merged or not active:
            return self.base_layer(x, *args, **kwargs)
        return self._with_adapters(x, active, *args, **kwargs)

    def _with_adapters(self, x: torch.Tensor, adapters: list[str], *args: Any, **kwargs: Any) -> torch.Tensor:
        """`base(x) + Σ (P ⊙ Θ) dropout(x)`, or the `merged_forward` component's equal (given each adapter's input:
        `x` itself where no dropout acts)."""
        offloaded = self.offloaded_containers()
        with onloaded(offloaded) if offloaded else nullcontext():
            placements = [self.placement(name) for name in adapters]
            deltas = [self.neuroada_delta[name] for name in adapters]
            dropouts = [self.neuroada_dropout[name] for name in adapters]
            inputs = [dropout(x) if _drops(dropout) else x for dropout in dropouts]
            if self.merged_forward is not None:
                return self.merged_forward(self, x, inputs, placements, deltas, *args, **kwargs)
            result = self.base_layer(x, *args, **kwargs)
            return forward.add_bypasses(result, inputs, placements, deltas, self.kernels, self._frozen())

    def _frozen(self) -> list[torch.Tensor]:
        """The base layer's tensors (a `torch.func` transform following them decides the path)."""
        base = self.get_base_layer()
        return [t for t in (getattr(base, "weight", None), getattr(base, "bias", None)) if isinstance(t, torch.Tensor)]

    def _mixed_batch_forward(self, x: torch.Tensor, *args: Any, adapter_names: list[str], **kwargs: Any):
        """Each row through its own adapter (`"__base__"` or an adapter this layer lacks: the base layer alone)."""
        if len(x) != len(adapter_names):
            raise ValueError(
                "Length of `adapter_names` should be the same as the number of inputs, but got "
                f"{len(adapter_names)} and {len(x)} respectively."
            )
        if self.merged:
            raise ValueError(
                "Cannot pass `adapter_names` when there are merged adapters, please call `unmerge_adapter` first."
            )
        if not adapter_names:  # no rows: the base layer's empty output, as LoRA's
            return self.base_layer(x, *args, **kwargs)
        rows_of: dict[str, list[int]] = {}
        for row, name in enumerate(adapter_names):
            rows_of.setdefault(name, []).append(row)
        result = None
        for name, rows in rows_of.items():
            index = torch.tensor(rows, device=x.device)
            sub_batch = x.index_select(0, index)
            if name in self.neuroada_delta:
                out = self._with_adapters(sub_batch, [name], *args, **kwargs)
            else:
                out = self.base_layer(sub_batch, *args, **kwargs)
            if result is None:
                result = out.new_empty((len(x), *out.shape[1:]))
            result.index_copy_(0, index, out.to(result.dtype))
        return result

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the deltas into the base weight, keeping what they overwrite for an exact unmerge; all or nothing."""
        names = [name for name in check_adapters_to_merge(self, adapter_names) if name in self.neuroada_delta]
        if not names:
            return
        self.check_mergeable(names)
        if self.quantized() is None and self.weight_out_in().is_meta:  # (offloaded: `onload_layer` brings it back)
            raise ValueError(
                "Cannot merge NeuroAda deltas into a weight on the meta device (offloaded, or not loaded). Merge "
                "through the model (`merge_adapter()` or `merge_and_unload()`), which brings an offloaded weight back "
                "first, or load the base model without offloading."
            )
        merged_before = len(self.merged_adapters)
        try:
            with self._weight_writes(self.weight_out_in()):
                for name in names:
                    self._merge_adapter(name, safe_merge)
        except BaseException:
            self.unmerge_to(merged_before)
            raise

    def unmerge(self) -> None:
        """Restore the exact original weight entries, most recently merged adapter first."""
        if not self.merged:
            return warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
        self.unmerge_to(0)

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The adapter as a dense weight-shaped tensor (for inspection and tests; training never builds it)."""
        delta = self.neuroada_delta[adapter_name].detach()
        dense = torch.zeros(self.out_features, self.in_features, dtype=delta.dtype, device=delta.device)
        write_placed_(dense, self.placement(adapter_name), delta)
        return dense.T if self.fan_in_fan_out else dense

    def supports_lora_conversion(self, adapter_name: str = "default") -> bool:
        """Additive, so `convert_to_lora` approximates it by the delta's SVD (keeping part of the sparse delta)."""
        return True

    def _get_additive_delta(self, adapter_name: str = "default") -> torch.Tensor:
        return self.get_delta_weight(adapter_name)

    def extra_repr(self) -> str:
        return quantization_extra_repr(self)

    def __repr__(self) -> str:
        return "neuroada." + super().__repr__()


def _drops(dropout: nn.Module) -> bool:
    return isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0
