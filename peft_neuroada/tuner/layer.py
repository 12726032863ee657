"""NeuroAda layers: a frozen linear layer plus k trainable deltas per neuron, `y = base(x) + (P ⊙ Θ) x`.

The layers hold the adapters' state (deltas and index buffers), add and remove adapters, and merge and unmerge them
exactly; how the output and gradients are computed is forward.py's.
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

from . import products
from .config import DTYPES, NeuroAdaConfig
from .forward import adapted_linear
from .index_storage import BUFFER_DTYPE
from .placement import Placement, placed_entries, write_placed_
from .selection import layer_generator, select_inputs, select_neurons
from .state_checks import SAVED_TENSORS, check_layer_state, placement_problem

# Small but clearly non-zero, so tests with `init_weights=False` see the adapter's effect in any dtype.
_TEST_INIT_STD = 0.05
BASE_ADAPTER_NAME = "__base__"
LOAD_WEIGHTS_HINT = (
    "NeuroAda selects each neuron's inputs from the base weights, so they must be in memory: load the model without "
    "CPU/disk offloading (for a model too large for your GPU, load it quantized, or load it on the CPU, add the "
    "adapter, and then offload the PeftModel with accelerate's dispatch_model, cpu_offload or disk_offload)."
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
    if base.weight.is_meta:
        return "it is on the meta device (offloaded or not loaded)"
    return None


@contextmanager
def onloaded(containers: Sequence[nn.Module]) -> Iterator[None]:
    """accelerate's hooks of `containers` run around the block as around a call. Not peft's `onload_layer`, which
    also onloads the base layer and writes a disk-offloaded one back: right for a merge, a needless write per call."""
    for container in containers:
        container._hf_hook.pre_forward(container)
    try:
        yield
    finally:
        for container in containers:
            container._hf_hook.post_forward(container, None)


class QuantizedWeight:
    """A quantized base layer's weight through peft's quantization backend (the layer's `get_base_weight` and
    `set_base_weight`), seen as its dequantized (d_out, d_in) float32 weight; merged by requantizing, unmerged by
    putting back the quantized weight the merge replaced."""

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
            self._stored_dtype, self._whole = weight.dtype, weight.float().reshape(self.shape)
        return self._whole

    def merge_refusal(self) -> str | None:
        return None if self.backend.supports_merge else f"peft cannot requantize {self.kind} weights"

    def snapshot(self) -> Callable[[], None]:
        """What puts the quantized weight (and its quantization state) back as it is now."""
        layer, base, weight = self.layer, self.base, self.base.weight
        state = {name: copy.copy(vars(base)[name]) for name in ("state", "quant_state") if name in vars(base)}
        weight_state = dict(vars(weight))  # peft's requantizing marks the replaced weight unquantized

        def restore() -> None:
            if layer.get_base_layer() is not base:  # the backend replaced the module (HQQ)
                layer.base_layer = base
            vars(weight).update(weight_state)
            base.weight = weight
            for name, value in state.items():
                setattr(base, name, value)

        return restore

    def replace(self, weight: torch.Tensor) -> None:
        """Quantize `weight` (a `dense()` with the deltas added) again and install it."""
        self.layer.set_base_weight(weight.to(self._stored_dtype))


class NeuroAdaLayer(BaseTunerLayer):
    """Adapter state of one layer, per adapter name: `neuroada_delta` (n, k) trainable values at input columns
    `placement(name).cols` (n, k) of the n tuned neurons, held as (n, k) int32 in `neuroada_indices`;
    `neuroada_rows` (n,) lists those neurons only when not all d_out of them are tuned."""

    adapter_layer_names = ("neuroada_delta",)
    other_param_names = ("neuroada_indices", "neuroada_rows", "init_weights")
    # The deltas' gradient, a function of tensors (`forward.SampledGrad`); a layer may be given a faster one.
    sampled_grad = staticmethod(products.sampled_grad)

    def __init__(self, base_layer: nn.Module, fan_in_fan_out: bool = False, **kwargs: Any) -> None:
        self.base_layer = base_layer
        self.fan_in_fan_out = fan_in_fan_out
        self.neuroada_delta = nn.ParameterDict({})
        self.neuroada_indices = BufferDict({}, persistent=True)
        self.neuroada_rows = BufferDict({}, persistent=True)
        self.init_weights: dict[str, bool] = {}
        # Per merged adapter, what unmerge writes back: the entries it overwrote, or the quantized weight it replaced.
        self._merge_originals: dict[str, tuple[Placement, torch.Tensor]] = {}
        self._quantized_originals: dict[str, Callable[[], None]] = {}
        self.get_apply_tensor_subclass = kwargs.get("get_apply_tensor_subclass")  # for a torchao base's backend
        # peft's backend for a quantized base, as `get_layer_status` and the repr name it (None: a float weight, or a
        # torchao one without its config, which peft's backend refuses: `quantized` says so where it is needed)
        try:
            self.quantization_backend = self._resolved_backend()
        except ValueError:
            self.quantization_backend = None
        # Other modules holding this layer's base weight (kept up to date by NeuroAdaModel): never written in place.
        self.weight_shared_with: tuple[str, ...] = ()
        self._disable_adapters = False
        self.merged_adapters = []
        self.layer_name = ""  # the module's name in the model, for messages (set by update_layer)
        self.in_features, self.out_features = self.in_out_features()
        self.register_load_state_dict_pre_hook(check_layer_state)  # indices loaded into this layer alone

    def in_out_features(self) -> tuple[int, int]:
        """d_in and d_out of the frozen weight (every neuron a row)."""
        return _get_in_out_features(self.get_base_layer())

    def offloaded_containers(self) -> list[nn.Module]:
        """The adapter's containers accelerate hooked (offloading after the adapter was added): they are read, never
        called, so visits run their hooks themselves (`onloaded`)."""
        containers = [getattr(self, name) for name in SAVED_TENSORS]
        return [container for container in containers if "_hf_hook" in vars(container)]

    def weight_out_in(self) -> torch.Tensor:
        """The frozen weight as a (d_out, d_in) view, whatever the layer's storage layout."""
        weight = self.get_base_layer().weight
        return weight.T if self.fan_in_fan_out else weight

    def unreadable(self) -> str | None:
        """Why the frozen weight's values cannot be read to select inputs (None: they can)."""
        return unreadable_weight(self.get_base_layer())

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
        if reason := self.unreadable() or (self._quantized_originals and "adapters are merged into it"):
            raise ValueError(
                f"NeuroAda cannot select inputs for layer '{self.layer_name}': {reason}. {LOAD_WEIGHTS_HINT}"
            )
        neurons, dtype = self._select(adapter_name, config, k)
        if config.delta_dtype is not None:
            dtype = DTYPES[config.delta_dtype]
        elif not dtype.is_floating_point:
            dtype = torch.float32
        self.init_weights[adapter_name] = config.init_weights
        self.neuroada_delta[adapter_name] = nn.Parameter(self._initial_delta(adapter_name, neurons, k, dtype))
        self._move_adapter_to_device_of_base_layer(adapter_name)
        if config.delta_dtype is not None:
            self.neuroada_delta[adapter_name] = nn.Parameter(self.neuroada_delta[adapter_name].to(dtype))
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _select(self, adapter_name: str, config: NeuroAdaConfig, k: int) -> tuple[int, torch.dtype]:
        """Choose the neurons and k inputs each; returns how many neurons, and the dtype the weight was read in."""
        generator = layer_generator(config.selection_seed, self.layer_name)
        rows = select_neurons(self.out_features, config.neuron_fraction, generator)
        quantized = self.quantized()
        # ZeRO-3 partitions weights; selection needs each neuron's whole row, so gather it for the duration.
        with gather_params_ctx(self.weight_out_in(), modifier_rank=None):
            weight = self.base_weight().reshape(-1, self.in_features) if quantized is None else quantized
            cols = select_inputs(weight if rows is None else weight[rows.long()], k, config.selection, generator)
            self.neuroada_indices[adapter_name] = cols.to(BUFFER_DTYPE)
        if rows is not None:
            self.neuroada_rows[adapter_name] = rows
        return (self.out_features if rows is None else rows.numel()), weight.dtype

    def _initial_delta(self, adapter_name: str, neurons: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        delta = torch.zeros(neurons, k, dtype=dtype, device=self.weight_out_in().device)
        return delta if self.init_weights[adapter_name] else delta.normal_(std=_TEST_INIT_STD)

    def placement(self, adapter_name: str) -> Placement:
        """Where the adapter's deltas sit: its (n, k) columns and its rows. Their values are checked as they enter
        (selection, loading, merge); a cast of the buffers, which may no longer hold the exact columns and costs
        nothing to see, is refused here."""
        buffer = self.neuroada_indices[adapter_name]
        rows = self.neuroada_rows[adapter_name] if adapter_name in self.neuroada_rows else None
        if buffer.dtype != BUFFER_DTYPE or (rows is not None and rows.dtype != BUFFER_DTYPE):
            raise ValueError(
                f"NeuroAda adapter '{adapter_name}' cannot run at layer '{self.layer_name}': its index buffers were "
                f"converted (to {buffer.dtype}), e.g. by `model.type(...)`, and may read as other columns. Nothing "
                "was computed: load the adapter again from its saved files (PeftModel.from_pretrained / load_adapter)."
            )
        return Placement(buffer, rows).prepared(self.in_features)

    def merged_into_quantized_weight(self) -> bool:
        """Whether adapters are merged into its quantized weight (requantized: the base values are gone)."""
        return bool(self._quantized_originals)

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
        for name in names:
            rows = self.neuroada_rows[name] if name in self.neuroada_rows else None
            shape = self.neuroada_delta[name].shape
            if problem := placement_problem(self, shape, self.neuroada_indices[name], rows):
                raise ValueError(
                    f"Cannot merge NeuroAda adapter '{name}' into '{self.layer_name}': {problem}, so it would write "
                    "other weight entries. Nothing was written: load the adapter again from its saved files."
                )
        merged_before = len(self.merged_adapters)
        try:
            with self._weight_writes(weight):
                for name in names:
                    self._merge_one(name, safe_merge)
        except BaseException:
            self.unmerge_to(merged_before)
            raise

    def _merge_one(self, name: str, safe_merge: bool) -> None:
        """Add one adapter's deltas. A quantized weight is dequantized, added to and quantized again (rounded to the
        grid, which warns, as peft's LoRA does); the replaced quantized weight is kept for unmerge."""
        quantized = self.quantized()  # the layer as the previous adapter left it
        weight = self.weight_out_in() if quantized is None else quantized.dense()
        placement = self.placement(name)
        originals = placed_entries(weight, placement)
        merged = originals + self.neuroada_delta[name].detach().to(originals.dtype)
        if safe_merge and not torch.isfinite(merged).all():
            raise ValueError(
                f"Refusing to merge adapter '{name}': it would put NaN/inf values into the base weight, so its deltas "
                "are broken (check the training loss and learning rate)."
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

    def check_mergeable(self) -> None:
        """Refuse a shared weight, or a quantized one that cannot be quantized again, before anything changes."""
        name = self.layer_name or "this layer"
        quantized = self.quantized()
        if quantized is not None and (reason := quantized.merge_refusal()):
            raise ValueError(f"Cannot merge NeuroAda deltas into '{name}': {reason}. {FULL_PRECISION_HINT}")
        if self.weight_shared_with:
            raise ValueError(
                f"Cannot merge NeuroAda deltas into the weight of '{name}': it is shared with "
                f"{', '.join(self.weight_shared_with)}, and merging would change those modules too. Give the layer "
                "its own copy of the weight first, e.g. "
                "`layer.base_layer.weight = torch.nn.Parameter(layer.base_layer.weight.detach().clone(), "
                "requires_grad=False)` (a frozen copy), or keep the adapter unmerged."
            )

    def unmerge(self) -> None:
        """Restore the exact original weight entries, most recently merged adapter first."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        self.unmerge_to(0)

    def unmerge_to(self, count: int) -> None:
        """Unmerge the latest merged adapters until `count` remain: all or nothing on a float weight; on a quantized
        one each step restores one snapshot, then forgets it, so the layer stays as `merged_adapters` says."""
        if self._quantized_originals:
            while len(self.merged_adapters) > count:
                self._quantized_originals[self.merged_adapters[-1]]()
                del self._quantized_originals[self.merged_adapters.pop()]
            return
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


class Linear(nn.Module, NeuroAdaLayer):
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

    def forward(self, x: torch.Tensor, *args: Any, adapter_names: list[str] | None = None, **kwargs: Any):
        if self.disable_adapters:  # before adapter_names, as LoRA: `disable_adapter()` serves the base model
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if adapter_names is not None:
            return self._mixed_batch_forward(x, adapter_names, *args, **kwargs)
        active = [name for name in self.active_adapters if name in self.neuroada_delta]
        if self.merged or not active:
            return self.base_layer(x, *args, **kwargs)
        return self._adapted(x, active, *args, **kwargs)

    def _adapted(self, x: torch.Tensor, adapters: list[str], *args: Any, **kwargs: Any) -> torch.Tensor:
        offloaded = self.offloaded_containers()
        with onloaded(offloaded) if offloaded else nullcontext():
            placements = [self.placement(name) for name in adapters]
            deltas = [self.neuroada_delta[name] for name in adapters]
            base, weight = self.get_base_layer(), self.weight_out_in()
            return adapted_linear(base, weight, x, placements, deltas, self.sampled_grad, *args, **kwargs)

    def _mixed_batch_forward(self, x: torch.Tensor, adapter_names: list[str], *args: Any, **kwargs: Any):
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
        if not adapter_names:  # no rows: the base layer's empty output, shaped and typed as LoRA's
            return self.base_layer(x, *args, **kwargs)
        rows_of: dict[str, list[int]] = {}
        for row, name in enumerate(adapter_names):
            rows_of.setdefault(name, []).append(row)
        result = None
        for name, rows in rows_of.items():
            index = torch.tensor(rows, device=x.device)
            sub_batch = x.index_select(0, index)
            if name in self.neuroada_delta:
                out = self._adapted(sub_batch, [name], *args, **kwargs)
            else:
                out = self.base_layer(sub_batch, *args, **kwargs)
            if result is None:
                result = out.new_empty((len(x), *out.shape[1:]))
            result.index_copy_(0, index, out.to(result.dtype))
        return result

    def extra_repr(self) -> str:
        return quantization_extra_repr(self)

    def __repr__(self) -> str:
        return "neuroada." + super().__repr__()
