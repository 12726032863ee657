"""NeuroAda tuner layer: a frozen linear layer plus k trainable deltas per neuron."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
from accelerate.hooks import AlignDevicesHook
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features, check_adapters_to_merge
from peft.utils.integrations import gather_params_ctx
from torch import nn

from .config import DTYPES, NeuroAdaConfig
from .functional import (
    FrozenLinear,
    Placement,
    WeightLock,
    adapted_linear,
    frozen_output,
    placed_entries,
    write_placed_,
)
from .index_storage import buffer_problem, from_buffer, index_problem, to_buffer
from .quantized import FULL_PRECISION_HINT, QuantizedLinear, Snapshot, keep_standard_layout, quantized_linear
from .selection import layer_generator, select_inputs, select_neurons

# Small but clearly non-zero, so tests with `init_weights=False` see the adapter's effect in any dtype.
_TEST_INIT_STD = 0.05
BASE_ADAPTER_NAME = "__base__"
LOAD_WEIGHTS_HINT = (
    "NeuroAda selects each neuron's inputs from the base weights, so they must be in memory: load the model without "
    "CPU/disk offloading (for a model too large for your GPU, load it quantized, or load it on the CPU, add the "
    "adapter, and then offload the PeftModel with accelerate's dispatch_model, cpu_offload or disk_offload)."
)


class MixedBatch(NamedTuple):
    """peft's `adapter_names` of a forward/generate call, per row (`"__base__"`: none); under beam search the encoder
    layers of an encoder-decoder model see the unrepeated names."""

    names: list[str]
    encoder_names: list[str] | None = None
    encoder_layers: frozenset[int] = frozenset()

    def for_layer(self, layer: nn.Module) -> list[str]:
        return self.encoder_names if id(layer) in self.encoder_layers else self.names


# The batch a call serves reaches exactly the layers its own thread (or task) runs. torch.compile cannot trace
# `ContextVar.get`, but guards on the plain list of calls serving one (append and remove are atomic): graphs without
# one never read the context variable.
_MIXED_BATCH: ContextVar[MixedBatch | None] = ContextVar("neuroada_mixed_batch", default=None)
_SERVING: list[object] = []


@contextmanager
def serving(mixed: MixedBatch) -> Iterator[None]:
    """Make `mixed` the batch this thread's NeuroAda layers serve, for the duration of the block."""
    token = _MIXED_BATCH.set(mixed)
    _SERVING.append(token)
    try:
        yield
    finally:
        _SERVING.remove(token)
        _MIXED_BATCH.reset(token)


def unreadable_weight(base: nn.Module) -> str | None:
    """Why the values of `base`'s weight cannot be read to select inputs (None: they can)."""
    hook = getattr(base, "_hf_hook", None)
    if isinstance(hook, AlignDevicesHook) and hook.offload:
        return "it is offloaded by accelerate"
    if base.weight.is_meta:
        return "it is on the meta device (offloaded or not loaded)"
    return None


# The containers of an adapter's tensors: the layer reads them, it never calls them.
_CONTAINERS = ("neuroada_delta", "neuroada_indices", "neuroada_rows")


@contextmanager
def onloaded(containers: Sequence[nn.Module]) -> Iterator[None]:
    """accelerate's hooks of `containers` run around the block as around a call: their tensors are in memory (on
    the hooks' execution device) within it and offloaded again after it."""
    for container in containers:
        container._hf_hook.pre_forward(container)
    try:
        yield
    finally:
        for container in containers:
            container._hf_hook.post_forward(container, None)


class LayerRuntime:
    """What a layer keeps for the process it runs in: its weight's lock and its placements. Copies and pickles of the
    layer start with a fresh one: nothing of it is saved or shared."""

    def __init__(self) -> None:
        self.lock = WeightLock()
        self.placements: dict[str, tuple] = {}

    def __reduce__(self) -> tuple:
        return (LayerRuntime, ())


class NeuroAdaLayer(BaseTunerLayer):
    """Adapter state of one layer, per adapter name: `neuroada_delta` (n, k) trainable values at input columns
    `placement(name).cols` (n, k) of the n tuned neurons, stored compactly in `neuroada_indices` (index_storage.py);
    `neuroada_rows` (n,) lists those neurons only when not all d_out of them are tuned."""

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
        # Per merged adapter, what unmerge writes back: the entries it overwrote, or the quantized weight it replaced.
        self._merge_originals: dict[str, tuple[Placement, torch.Tensor]] = {}
        self._quantized_originals: dict[str, Snapshot] = {}
        self.requantize_with: Any = None  # the torchao config a merged torchao weight is quantized with again
        # Other modules holding this layer's base weight (kept up to date by NeuroAdaModel): never written in place.
        self.weight_shared_with: tuple[str, ...] = ()
        self._runtime = LayerRuntime()
        self._disable_adapters = False
        self.merged_adapters = []
        self.layer_name = ""  # the module's name in the model, for messages (set by update_layer)
        self.in_features, self.out_features = self.in_out_features()

    def in_out_features(self) -> tuple[int, int]:
        """d_in and d_out of the frozen weight (every neuron a row)."""
        return _get_in_out_features(self.get_base_layer())

    def offloaded_containers(self) -> list[nn.Module]:
        """The adapter's containers accelerate hooked (`cpu_offload`, `disk_offload`, `dispatch_model` after the
        adapter was added): its hooks bring a module's tensors in when the module is called, and these are only
        read, so visits run the hooks themselves (`onloaded`)."""
        modules = self._modules  # (not `self.neuroada_delta`: nn.Module.__getattr__, at every visit)
        return [modules[name] for name in _CONTAINERS if "_hf_hook" in vars(modules[name])]

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

    def quantized(self) -> QuantizedLinear | None:
        """The base layer seen as its dequantized weight (None for a plain float weight)."""
        return quantized_linear(self.get_base_layer(), self.requantize_with)

    def frozen(self) -> FrozenLinear:
        """The frozen layer as `functional` takes it."""
        base = self.base_layer  # (`get_base_layer()` asks `hasattr` twice, at every visit)
        base = base.get_base_layer() if isinstance(base, BaseTunerLayer) else base
        weight = base.weight.T if self.fan_in_fan_out else base.weight
        return FrozenLinear(base, weight, self.weight_shared_with, self._runtime.lock)

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
            dtype = DTYPES[config.delta_dtype]
        elif not dtype.is_floating_point:
            dtype = torch.float32
        self.init_weights[adapter_name] = config.init_weights
        self.neuroada_delta[adapter_name] = nn.Parameter(self._initial_delta(adapter_name, neurons, k, dtype))
        self.inplace_forward[adapter_name] = config.inplace_forward
        self._move_adapter_to_device_of_base_layer(adapter_name)
        if config.delta_dtype is not None:
            self.neuroada_delta[adapter_name] = nn.Parameter(self.neuroada_delta[adapter_name].to(dtype))
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _select(self, adapter_name: str, config: NeuroAdaConfig, k: int) -> tuple[int, torch.dtype]:
        """Choose the neurons and k inputs each; returns how many neurons, and the dtype the weight was read in."""
        generator = layer_generator(config.selection_seed, self.layer_name)
        rows = select_neurons(self.out_features, config.neuron_fraction, generator)
        strategy = "magnitude" if config.selection == "gradient" else config.selection
        quantized = self.quantized()
        if quantized is not None:
            keep_standard_layout(self.get_base_layer())
        # ZeRO-3 partitions weights; selection needs each neuron's whole row, so gather it for the duration.
        with gather_params_ctx(self.weight_out_in(), modifier_rank=None):
            weight = self.base_weight().reshape(-1, self.in_features) if quantized is None else quantized
            cols = select_inputs(weight if rows is None else weight[rows.long()], k, strategy, generator)
            self.neuroada_indices[adapter_name] = to_buffer(cols, self.in_features)
        if rows is not None:
            self.neuroada_rows[adapter_name] = rows
        return (self.out_features if rows is None else rows.numel()), weight.dtype

    def _initial_delta(self, adapter_name: str, neurons: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        delta = torch.zeros(neurons, k, dtype=dtype, device=self.weight_out_in().device)
        return delta if self.init_weights[adapter_name] else delta.normal_(std=_TEST_INIT_STD)

    def placement(self, adapter_name: str) -> Placement:
        """The adapter's placement: the same object while its index buffer, rows and deltas' shape are unchanged, and
        checked again before a kernel or merge reads indices that may have changed: a new buffer (selection, loading)
        or one written in place (`load_state_dict` in a resume, `copy_`: its version counter shows it; writes through
        `.data` bypass it, as they bypass autograd's own check)."""
        # The containers' own dicts: ParameterDict/BufferDict lookups cost 1-1.5 us each, at every visit.
        shape = self.neuroada_delta._parameters[adapter_name].shape
        buffer, rows = self.neuroada_indices._buffers[adapter_name], self.neuroada_rows._buffers.get(adapter_name)
        if torch.compiler.is_compiling():  # dynamo would guard on what is kept
            return Placement(from_buffer(buffer, shape), rows)
        if buffer.is_inference() or (rows is not None and rows.is_inference()):
            buffer = _versioned(self.neuroada_indices, adapter_name)
            rows = _versioned(self.neuroada_rows, adapter_name)
        state = (_tensor_state(buffer), _tensor_state(rows), shape)
        kept = self._runtime.placements.get(adapter_name)
        if kept is None or kept[2] != state:
            # (the tensors stay in the entry, so an id in `state` is never reused while it is kept)
            with torch.inference_mode(False):  # views made in inference mode would have no version counter
                if problem := self.placement_problem(shape, buffer, rows):
                    raise ValueError(
                        f"NeuroAda adapter '{adapter_name}' cannot run at layer '{self.layer_name}': {problem}. They "
                        "were loaded or changed after the adapter was made (load_state_dict or a checkpoint resume "
                        "copying other tensors in, a write into the buffer, a conversion of every tensor such as "
                        "`model.type(...)`), or the adapter was trained on another base model. Nothing was computed "
                        "or written: load the adapter again from its saved files (PeftModel.from_pretrained / "
                        "load_adapter) on the base model it was trained on."
                    )
                kept = (buffer, rows, state, Placement(from_buffer(buffer, shape), rows))
            self._runtime.placements[adapter_name] = kept
        return kept[3]

    def delete_adapter(self, adapter_name: str) -> None:
        """peft deletes what `adapter_layer_names` and `other_param_names` name; the kept placement holds the index
        tensors too, so it goes with them (peft refuses to delete a merged adapter, whose merge record must stay)."""
        super().delete_adapter(adapter_name)
        self._runtime.placements.pop(adapter_name, None)

    def placement_problem(
        self, shape: torch.Size, buffer: torch.Tensor | None, rows: torch.Tensor | None
    ) -> str | None:
        """What makes an index buffer or rows (held, or about to be loaded; None: not given) unfit for deltas of
        `shape` in this layer ("its neuroada_indices ..."), or None."""
        if buffer is not None:
            problem = buffer_problem(buffer, shape, self.in_features)
            if problem := problem or index_problem(from_buffer(buffer, shape), self.in_features):
                return f"its neuroada_indices {problem}"
        if rows is not None:
            problem = "is not an (n,) integer tensor" if rows.shape != shape[:1] else None
            if problem := problem or index_problem(rows, self.out_features, "neuroada_rows"):
                return f"its neuroada_rows {problem}"
        return None

    def merged_into_quantized_weight(self) -> bool:
        """Whether adapters are merged into its quantized weight (requantized: the base values are gone)."""
        return bool(self._quantized_originals)

    def check_reselectable(self, adapter_name: str) -> None:
        """Raise if the adapter's inputs cannot be selected again: it is merged, or its deltas do not train."""
        self._check_unmerged(adapter_name)
        if not self.neuroada_delta[adapter_name].requires_grad:
            raise ValueError(
                f"Adapter '{adapter_name}' does not train (loaded for inference, or not the active adapter); "
                "selecting its inputs by gradient needs gradients through its deltas: load it with "
                "`PeftModel.from_pretrained(..., is_trainable=True)` or make it the active adapter."
            )

    def _check_unmerged(self, adapter_name: str) -> None:
        if adapter_name in self.merged_adapters:
            raise ValueError(f"Adapter '{adapter_name}' is merged; unmerge it before selecting its inputs again.")

    def reselect(self, adapter_name: str, cols: torch.Tensor) -> None:
        """Move an adapter to new input columns (same neurons) and restart its deltas from initialisation."""
        self._check_unmerged(adapter_name)
        delta = self.neuroada_delta[adapter_name]
        self.neuroada_indices[adapter_name] = to_buffer(cols, self.in_features)
        with torch.no_grad():
            delta.copy_(self._initial_delta(adapter_name, *delta.shape, delta.dtype))

    def placement_conflict(self, adapters: Sequence[str]) -> str | None:
        """Why the deltas of `adapters` here sit on different entries (no weighted sum of them is exact), or None."""
        present = [name for name in adapters if name in self.neuroada_delta]
        for other in present[1:]:
            for held in (self.neuroada_indices, self.neuroada_rows):
                first, second = held._buffers.get(present[0]), held._buffers.get(other)
                if (first is None) != (second is None) or (first is not None and not torch.equal(first, second)):
                    return f"adapters '{present[0]}' and '{other}' tune different input connections"
        return None

    def set_weighted_sum(self, adapter_name: str, adapters: Sequence[str], weights: Sequence[float]) -> None:
        """Make adapter `adapter_name` (added already) `Σ weights[i] · adapters[i]` on their shared placement, summed
        in at least float32, stored in the first source's dtype (adapters this layer lacks add nothing)."""
        sources = [(name, w) for name, w in zip(adapters, weights, strict=True) if name in self.neuroada_delta]
        deltas = [self.neuroada_delta[name].detach() for name, _ in sources]
        dtype = functools.reduce(torch.promote_types, (delta.dtype for delta in deltas), torch.float32)
        total = sum(weight * delta.to(dtype) for (_, weight), delta in zip(sources, deltas, strict=True))
        first = sources[0][0]
        self.neuroada_indices[adapter_name] = self.neuroada_indices[first].clone()
        if first in self.neuroada_rows:
            self.neuroada_rows[adapter_name] = self.neuroada_rows[first].clone()
        requires_grad = self.neuroada_delta[adapter_name].requires_grad
        self.neuroada_delta[adapter_name] = nn.Parameter(total.to(deltas[0].dtype), requires_grad=requires_grad)

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The adapter as a dense weight-shaped tensor (for inspection and tests; training never builds it)."""
        delta = self.neuroada_delta[adapter_name].detach()
        dense = torch.zeros(self.out_features, self.in_features, dtype=delta.dtype, device=delta.device)
        write_placed_(dense, self.placement(adapter_name), delta)
        return dense.T if self.fan_in_fan_out else dense

    def _weight_lock(self) -> WeightLock:
        return self._runtime.lock.on(self.weight_out_in().device)

    def _weight_writes(self, weight: torch.Tensor):  # inference tensors accept writes only in inference mode
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
            with self._weight_lock(), self._weight_writes(weight):
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
        _check_finite(name, merged, safe_merge)
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
            with self._weight_lock():
                while len(self.merged_adapters) > count:
                    self._quantized_originals[self.merged_adapters[-1]].restore()
                    del self._quantized_originals[self.merged_adapters.pop()]
            return
        weight = self.weight_out_in()
        undone = []
        try:
            with self._weight_lock(), self._weight_writes(weight):
                while len(self.merged_adapters) > count:
                    name = self.merged_adapters[-1]
                    placement, originals = self._merged_entries(name, weight)
                    undone.append((name, placement, originals, placed_entries(weight, placement)))
                    write_placed_(weight, placement, originals)
                    del self._merge_originals[name]
                    self.merged_adapters.pop()
        except BaseException:
            with self._weight_lock(), self._weight_writes(weight):
                for name, placement, originals, merged in reversed(undone):
                    write_placed_(weight, placement, merged)
                    self._merge_originals[name] = (placement, originals)
                    if name not in self.merged_adapters:
                        self.merged_adapters.append(name)
            raise


def _versioned(container: BufferDict, name: str) -> torch.Tensor | None:
    """`container[name]` (None if absent), not an inference tensor: those have no version counter."""
    tensor = container._buffers.get(name)
    if tensor is not None and tensor.is_inference():
        with torch.inference_mode(False):
            tensor = container[name] = tensor.clone()
    return tensor


def _tensor_state(tensor: torch.Tensor | None) -> tuple | None:
    """What changes when a tensor is replaced, re-pointed (`.data = ...`) or written in place (its version)."""
    return None if tensor is None else (id(tensor), tensor.data_ptr(), tensor._version)


def _check_finite(adapter_name: str, merged: torch.Tensor, safe_merge: bool) -> None:
    if safe_merge and not torch.isfinite(merged).all():
        raise ValueError(
            f"Refusing to merge adapter '{adapter_name}': it would put NaN/inf values into the base weight, "
            "so its deltas are broken (check the training loss and learning rate)."
        )


class Linear(nn.Module, NeuroAdaLayer):
    """NeuroAda around `nn.Linear` (weight d_out x d_in) or transformers' `Conv1D` (weight d_in x d_out)."""

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
        NeuroAdaLayer.__init__(self, base_layer, fan_in_fan_out=fan_in_fan_out)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_name=layer_name)

    def forward(self, x: torch.Tensor, *args: Any, adapter_names: list[str] | None = None, **kwargs: Any):
        if self.disable_adapters:  # before adapter_names, as LoRA: `disable_adapter()` serves the base model
            if self.merged:
                self.unmerge()
            return frozen_output(self.frozen(), x, *args, **kwargs)
        if adapter_names is None and _SERVING and (mixed := _MIXED_BATCH.get()) is not None:
            adapter_names = mixed.for_layer(self)
        if adapter_names is not None:
            return self._mixed_batch_forward(x, adapter_names, *args, **kwargs)
        active = [name for name in self.active_adapters if name in self.neuroada_delta]
        if self.merged or not active:
            return frozen_output(self.frozen(), x, *args, **kwargs)
        return self._adapted(x, active, *args, **kwargs)

    def _adapted(self, x: torch.Tensor, adapters: list[str], *args: Any, **kwargs: Any) -> torch.Tensor:
        offloaded = self.offloaded_containers()
        with onloaded(offloaded) if offloaded else nullcontext():
            placements = [self.placement(name) for name in adapters]
            deltas = [self.neuroada_delta[name] for name in adapters]
            inplace = all(self.inplace_forward[name] for name in adapters)
            return adapted_linear(self.frozen(), x, placements, deltas, self.out_features, inplace, *args, **kwargs)

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
            return frozen_output(self.frozen(), x, *args, **kwargs)
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
                out = frozen_output(self.frozen(), sub_batch, *args, **kwargs)
            if result is None:
                result = out.new_empty((len(x), *out.shape[1:]))
            result.index_copy_(0, index, out.to(result.dtype))
        return result

    def __repr__(self) -> str:
        return "neuroada." + super().__repr__()
