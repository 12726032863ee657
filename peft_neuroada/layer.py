"""NeuroAda tuner layer: a frozen linear layer plus k trainable deltas per neuron."""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
    weight_lock,
    write_placed_,
)
from .index_storage import buffer_problem, checked_indices, from_buffer, index_problem, saved_columns, to_buffer
from .quantized import FULL_PRECISION_HINT, QuantizedLinear, Snapshot, keep_standard_layout, quantized_linear
from .selection import INDEX_DTYPE, layer_generator, select_inputs, select_neurons

# Small but clearly non-zero, so tests with `init_weights=False` see the adapter's effect in any dtype.
_TEST_INIT_STD = 0.05
BASE_ADAPTER_NAME = "__base__"
# Per layer and adapter: (index buffer, rows, deltas' shape, the placement made from them). Weak in the layer, so
# copies of a model make their own and nothing is kept alive, saved or pickled with it.
_PLACEMENTS: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple]] = weakref.WeakKeyDictionary()
LOAD_WEIGHTS_HINT = (
    "NeuroAda selects each neuron's inputs from the base weights, so they must be in memory: load the model without "
    "CPU/disk offloading (for a model too large for your GPU, load it quantized instead)."
)


class MixedBatch(NamedTuple):
    """peft's `adapter_names` of the current forward/generate call: the adapter of each row (`"__base__"`: none).

    Set by `NeuroAdaModel` in a context variable, so it reaches exactly the layers this thread (or task) runs, and no
    other thread's call. Encoder layers of an encoder-decoder model under beam search see the unrepeated names.
    """

    names: list[str]
    encoder_names: list[str] | None = None
    encoder_layers: frozenset[int] = frozenset()

    def for_layer(self, layer: nn.Module) -> list[str]:
        return self.encoder_names if id(layer) in self.encoder_layers else self.names


_MIXED_BATCH: ContextVar[MixedBatch | None] = ContextVar("neuroada_mixed_batch", default=None)
# Calls serving a mixed batch right now, in any thread. torch.compile cannot trace `ContextVar.get` (a graph break,
# an error under fullgraph), but reads and guards on this plain global: layers look at the context variable only
# while some mixed batch is served, so graphs without one never meet it, and compiled mixed batches are served.
_mixed_batches_in_progress = [0]
_mixed_batches_lock = threading.Lock()


def _new_mixed_batches_lock() -> None:
    """In a forked child: a thread that held the lock at the fork does not exist there (its count stays, which only
    makes layers look at the context variable)."""
    global _mixed_batches_lock
    _mixed_batches_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_mixed_batches_lock)


@contextmanager
def serving(mixed: MixedBatch) -> Iterator[None]:
    """Make `mixed` the batch this thread's NeuroAda layers serve, for the duration of the block."""
    with _mixed_batches_lock:
        _mixed_batches_in_progress[0] += 1
    token = _MIXED_BATCH.set(mixed)
    try:
        yield
    finally:
        _MIXED_BATCH.reset(token)
        with _mixed_batches_lock:
            _mixed_batches_in_progress[0] -= 1


def served_mixed_batch() -> MixedBatch | None:
    """The mixed batch of the current call, if any (see `serving`)."""
    return _MIXED_BATCH.get() if _mixed_batches_in_progress[0] else None


def unreadable_weight(base: nn.Module) -> str | None:
    """Why the values of `base`'s weight cannot be read to select inputs (None: they can)."""
    hook = getattr(base, "_hf_hook", None)
    if isinstance(hook, AlignDevicesHook) and hook.offload:
        return "it is offloaded by accelerate"
    if base.weight.is_meta:
        return "it is on the meta device (not loaded)"
    return None


# What an adapter saves per layer (state-dict keys `{layer}.{attribute}.{adapter}`): its deltas and index buffers.
SAVED_TENSORS = ("neuroada_delta", "neuroada_indices", "neuroada_rows")


class NeuroAdaLayer(BaseTunerLayer):
    """Adapter state of one layer, per adapter name: `neuroada_delta` (n, k) trainable values at input columns
    `placement(name).cols` (n, k) of the n tuned neurons, stored compactly in `neuroada_indices` (see
    index_storage.py); `neuroada_rows` (n,) lists those neurons only when not all d_out of them are tuned."""

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
        # Per merged adapter, where it was merged and the weight entries it overwrote: unmerge writes them back.
        self._merge_originals: dict[str, tuple[Placement, torch.Tensor]] = {}
        # Quantized bases: per merged adapter, the quantized weight its merge replaced (unmerge puts it back), and the
        # torchao config a merged torchao weight is quantized with again (set by NeuroAdaModel).
        self._quantized_originals: dict[str, Snapshot] = {}
        self.requantize_with: Any = None
        # Other modules holding this layer's base weight (kept up to date by NeuroAdaModel). The in-place path never
        # writes a shared weight, and merging into one is refused: it would change those modules too.
        self.weight_shared_with: tuple[str, ...] = ()
        self._frozen_kept: FrozenLinear | None = None  # see `frozen`
        self._disable_adapters = False
        self.merged_adapters = []
        self.layer_name = ""  # the module's name in the model, for messages (set by update_layer)
        self.in_features, self.out_features = _get_in_out_features(self.get_base_layer())

    def weight_out_in(self) -> torch.Tensor:
        """The frozen weight as a (d_out, d_in) view, whatever the layer's storage layout."""
        weight = self.get_base_layer().weight
        return weight.T if self.fan_in_fan_out else weight

    def base_weight(self) -> torch.Tensor:
        """The (d_out, d_in) weight without the merged adapters: selection reads the base weights, merged or not (a
        copy with the merged entries put back while some are merged)."""
        weight = self.weight_out_in()
        if not self._merge_originals:
            return weight
        weight = weight.detach().clone()
        for name in reversed(self.merged_adapters):
            write_placed_(weight, *self._merged_entries(name, weight))
        return weight

    def _merged_entries(self, name: str, weight: torch.Tensor) -> tuple[Placement, torch.Tensor]:
        """Where merged adapter `name` sits and the entries it overwrote, on `weight`'s device and in its dtype: the
        model may have been cast or moved since the merge (the originals round as the cast rounded the weight)."""
        placement, originals = self._merge_originals[name]
        device = weight.device
        rows = None if placement.rows is None else placement.rows.to(device)
        return Placement(placement.cols.to(device), rows), originals.to(device=device, dtype=weight.dtype)

    def quantized(self) -> QuantizedLinear | None:
        """The base layer seen as its dequantized weight if it is quantized (None for a plain float weight)."""
        return quantized_linear(self.get_base_layer(), self.requantize_with)

    def frozen(self) -> FrozenLinear:
        """The frozen layer as `functional` takes it. Every visit asks for it, so it is kept while the base layer, its
        weight and `weight_shared_with` are the same objects (checking costs a fifth of remaking it). A Conv1D's
        (d_out, d_in) view is remade each time: a kept view would not follow a change of the weight's data."""
        compiling = torch.compiler.is_compiling()  # dynamo would guard on what is kept, and recompile once it is set
        kept, base = None if compiling else self._frozen_kept, self.base_layer
        if (
            kept is not None
            and kept.module is base
            and kept.weight is base.weight
            and kept.shared_with is self.weight_shared_with
        ):
            return kept
        frozen = FrozenLinear(self.get_base_layer(), self.weight_out_in(), self.weight_shared_with)
        if not compiling:
            self._frozen_kept = None if self.fan_in_fan_out else frozen
        return frozen

    def update_layer(self, adapter_name: str, config: NeuroAdaConfig, layer_name: str = "", **kwargs: Any) -> None:
        """Add adapter `adapter_name`: select each neuron's inputs on the frozen weight and create its deltas.

        `layer_name` (the module's name in the model) seeds random choices, so every process picks the same ones.
        """
        k = config.k
        if k > self.in_features:
            warnings.warn(
                f"NeuroAda k={k} exceeds the {self.in_features} inputs of a {type(self.get_base_layer()).__name__} "
                f"layer; using k={self.in_features} (every input) for it.",
                stacklevel=2,
            )
            k = self.in_features
        self.layer_name = layer_name or self.layer_name
        generator = layer_generator(config.selection_seed, self.layer_name)
        rows = select_neurons(self.out_features, config.neuron_fraction, generator)
        strategy = "magnitude" if config.selection == "gradient" else config.selection
        if reason := unreadable_weight(self.get_base_layer()):
            raise ValueError(
                f"NeuroAda cannot select inputs for layer '{self.layer_name}': {reason}. {LOAD_WEIGHTS_HINT}"
            )
        quantized = self.quantized()
        if quantized is not None:
            keep_standard_layout(self.get_base_layer())
        # ZeRO-3 partitions weights; selection needs each neuron's whole row, so gather it for the duration.
        # Quantized weights are read dequantized, a block of rows at a time.
        with gather_params_ctx(self.get_base_layer().weight, modifier_rank=None):
            weight = self.base_weight() if quantized is None else quantized
            tuned_weight = weight if rows is None else weight[rows.long()]
            cols = select_inputs(tuned_weight, k, strategy, generator)
            self.neuroada_indices[adapter_name] = to_buffer(cols, self.in_features)
            weight_dtype = weight.dtype
        if rows is not None:
            self.neuroada_rows[adapter_name] = rows
        if config.delta_dtype is not None:
            dtype = DTYPES[config.delta_dtype]
        else:
            dtype = weight_dtype if weight_dtype.is_floating_point else torch.float32
        neurons = self.out_features if rows is None else rows.numel()
        self.init_weights[adapter_name] = config.init_weights
        self.neuroada_delta[adapter_name] = nn.Parameter(self._initial_delta(adapter_name, neurons, k, dtype))
        self.inplace_forward[adapter_name] = config.inplace_forward
        self._move_adapter_to_device_of_base_layer(adapter_name)
        if config.delta_dtype is not None:
            self.neuroada_delta[adapter_name] = nn.Parameter(self.neuroada_delta[adapter_name].to(dtype))
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _initial_delta(self, adapter_name: str, neurons: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        delta = torch.zeros(neurons, k, dtype=dtype, device=self.get_base_layer().weight.device)
        return delta if self.init_weights[adapter_name] else delta.normal_(std=_TEST_INIT_STD)

    def placement(self, adapter_name: str) -> Placement:
        """The adapter's placement: the same objects from call to call while its index buffer, its rows and its deltas'
        shape are unchanged, so that what backward derives from the columns (`functional.COLUMN_COMPACTIONS`) is kept.

        Index buffers are checked whenever they may have changed, before a kernel or a merge reads them: a new buffer
        (from selection, from peft's loading, or from a loader that assigns tensors by name, like transformers'
        load_adapter), and one written in place (`load_state_dict` copying into it, as accelerate, DeepSpeed and FSDP
        resumes do; a `copy_`), which its version counter shows. Writes through `.data` bypass version counters, and
        so this check, as they bypass autograd's own."""
        # Read from the containers' own dicts: ParameterDict's and BufferDict's lookups cost 1-1.5 us each, and this
        # runs at every visit of every layer.
        shape = self.neuroada_delta._parameters[adapter_name].shape
        buffer, rows = self.neuroada_indices._buffers[adapter_name], self.neuroada_rows._buffers.get(adapter_name)
        if torch.compiler.is_compiling():  # dynamo would guard on the cache's contents
            return Placement(from_buffer(buffer, shape), rows)
        if buffer.is_inference() or (rows is not None and rows.is_inference()):
            buffer = _versioned(self.neuroada_indices, adapter_name)
            rows = _versioned(self.neuroada_rows, adapter_name)
        state = (_tensor_state(buffer), _tensor_state(rows), shape)
        kept = _PLACEMENTS.get(self)
        if kept is None:
            kept = _PLACEMENTS[self] = {}
        made = kept.get(adapter_name)
        if made is None or made[2] != state:
            # (the tensors themselves are kept in the entry, so an id in `state` is never reused while it is kept)
            with torch.inference_mode(False):  # views made in inference mode would have no version counter
                placement = self._checked_placement(adapter_name, shape, buffer, rows)
            made = kept[adapter_name] = (buffer, rows, state, placement)
        return made[3]

    def _checked_placement(
        self, adapter_name: str, shape: torch.Size, buffer: torch.Tensor, rows: torch.Tensor | None
    ) -> Placement:
        if problem := self.placement_problem(shape, buffer, rows):
            raise ValueError(
                f"NeuroAda adapter '{adapter_name}' cannot run at layer '{self.layer_name}': {problem}. They were "
                "loaded or changed after the adapter was made (load_state_dict or a checkpoint resume copying other "
                "tensors in, a write into the buffer, a conversion of every tensor such as `model.type(...)`), or the "
                "adapter was trained on another base model. Nothing was computed or written: load the adapter again "
                "from its saved files (PeftModel.from_pretrained / load_adapter) on the base model it was trained on."
            )
        return Placement(from_buffer(buffer, shape), rows)

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

    def _check_unmerged(self, adapter_name: str) -> None:
        if adapter_name in self.merged_adapters:
            raise ValueError(f"Adapter '{adapter_name}' is merged; unmerge it before selecting its inputs again.")

    def check_saved_tensors(self, name: str, adapter_name: str, state_dict: dict[str, torch.Tensor]) -> None:
        """Validate this layer's tensors in `state_dict` (keys `{name}.{attribute}.{adapter_name}`) before any of them
        loads, and turn saved index tensors (any layout `saved_columns` reads) into this layer's buffers, in place."""
        index_bounds = {"neuroada_indices": self.in_features, "neuroada_rows": self.out_features}
        if f"{name}.neuroada_delta.{adapter_name}" in state_dict:
            for attribute in index_bounds:
                if adapter_name in getattr(self, attribute) and f"{name}.{attribute}.{adapter_name}" not in state_dict:
                    raise ValueError(
                        f"The NeuroAda adapter holds deltas but no {attribute} for layer '{name}': the deltas would "
                        "land on entries chosen again here, not the trained ones. The file is damaged or incomplete; "
                        "save the adapter again from the model it was trained in."
                    )
        fits = f"this layer ({self.out_features} outputs, {self.in_features} inputs) needs"
        for attribute in SAVED_TENSORS:
            key = f"{name}.{attribute}.{adapter_name}"
            container = getattr(self, attribute)
            if key not in state_dict or adapter_name not in container:
                continue
            saved, expected = state_dict[key], container[adapter_name]
            if attribute == "neuroada_indices":
                expected = self.placement(adapter_name).cols
                try:
                    saved = saved_columns(saved, tuple(expected.shape))
                except ValueError as error:
                    raise ValueError(
                        f"The NeuroAda adapter does not fit the base model at layer '{name}': its {attribute} {error} "
                        f"that {fits} for this config. Load the adapter on the base model it was trained on."
                    ) from None
            if saved.shape != expected.shape:
                if self._only_k_differs(attribute, saved, expected):
                    raise ValueError(
                        f"The NeuroAda adapter's tensors do not match its config at layer '{name}': its {attribute} "
                        f"holds {saved.shape[1]} per neuron, but the config's k gives {expected.shape[1]}. They come "
                        "from an adapter with another k (for a saved adapter: its config and weights files do not "
                        "belong together; save it again from the model it was trained in), or from one trained on a "
                        "base model with fewer inputs here."
                    )
                raise ValueError(
                    f"The NeuroAda adapter does not fit the base model at layer '{name}': its {attribute} has shape "
                    f"{tuple(saved.shape)}, but {fits} {tuple(expected.shape)} for this config. Load the adapter on "
                    "the base model it was trained on."
                )
            if attribute in index_bounds:
                checked = checked_indices(name, attribute, saved, index_bounds[attribute]).to(INDEX_DTYPE)
                state_dict[key] = to_buffer(checked, self.in_features) if attribute == "neuroada_indices" else checked

    def _only_k_differs(self, attribute: str, saved: torch.Tensor, expected: torch.Tensor) -> bool:
        """Whether saved deltas have this layer's neurons but another k that this layer could hold: the config's k
        disagrees with the file rather than the base model with the adapter (unless k was cut to a smaller layer's
        inputs where it was trained)."""
        return (
            attribute == "neuroada_delta"
            and saved.dim() == expected.dim() == 2
            and saved.shape[0] == expected.shape[0]
            and saved.shape[1] <= self.in_features
        )

    def merged_into_quantized_weight(self) -> bool:
        """Whether adapters are merged into this layer's quantized weight (requantized: its base values are gone)."""
        return bool(self._quantized_originals)

    def check_reselectable(self, adapter_name: str) -> None:
        """Raise if the adapter's inputs cannot be selected again here: it is merged, or its deltas do not train (so
        no gradient would reach them)."""
        self._check_unmerged(adapter_name)
        if not self.neuroada_delta[adapter_name].requires_grad:
            raise ValueError(
                f"Adapter '{adapter_name}' does not train (loaded for inference, or not the active adapter); "
                "selecting its inputs by gradient needs gradients through its deltas: load it with "
                "`PeftModel.from_pretrained(..., is_trainable=True)` or make it the active adapter."
            )

    def reselect(self, adapter_name: str, cols: torch.Tensor) -> None:
        """Move an adapter to new input columns (same tuned neurons) and restart its deltas from initialisation."""
        self._check_unmerged(adapter_name)
        delta = self.neuroada_delta[adapter_name]
        self.neuroada_indices[adapter_name] = to_buffer(cols, self.in_features)
        with torch.no_grad():
            delta.copy_(self._initial_delta(adapter_name, *delta.shape, delta.dtype))

    def placement_conflict(self, adapters: Sequence[str]) -> str | None:
        """Why the deltas of `adapters` in this layer do not sit on the same weight entries, or None (they do, or at
        most one of them adapts this layer): only then does a weighted sum of them stay exactly a NeuroAda adapter."""
        present = [name for name in adapters if name in self.neuroada_delta]
        for other in present[1:]:
            if not _same_placement(self.placement(present[0]), self.placement(other)):
                return f"adapters '{present[0]}' and '{other}' tune different input connections"
        return None

    def set_weighted_sum(self, adapter_name: str, adapters: Sequence[str], weights: Sequence[float]) -> None:
        """Make adapter `adapter_name` (already added here) `Σ weights[i] · adapters[i]`: their shared placement and
        the weighted sum of their deltas, summed in at least float32 and stored in the first source's dtype (adapters
        this layer lacks add nothing)."""
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
        base = self.get_base_layer()
        return weight_lock(base, base.weight.device)

    def _weight_writes(self, weight: torch.Tensor):
        """Writes into the weight: inference tensors accept them only inside inference mode."""
        return torch.inference_mode() if weight.is_inference() else torch.no_grad()

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the deltas into the base weight, keeping the overwritten entries for an exact unmerge.

        All or nothing: if any adapter fails (with `safe_merge=True`, one whose merge would put NaN or inf into the
        weight), the adapters merged by this call are unmerged again before the error propagates.
        """
        names = [name for name in check_adapters_to_merge(self, adapter_names) if name in self.neuroada_delta]
        if not names:
            return
        self.check_mergeable()
        if self.quantized() is not None:
            self._merge_quantized(names, safe_merge)
            return
        weight = self.weight_out_in()
        if weight.is_meta:
            raise ValueError(f"Cannot merge NeuroAda deltas into a weight on the meta device. {LOAD_WEIGHTS_HINT}")
        merged_before = len(self.merged_adapters)
        try:
            with self._weight_lock(), self._weight_writes(weight):
                for name in names:
                    placement = self.placement(name)
                    originals = placed_entries(weight, placement)
                    merged = originals + self.neuroada_delta[name].detach().to(originals.dtype)
                    _check_finite(name, merged, safe_merge)
                    self._merge_originals[name] = (_owned(placement), originals)
                    self.merged_adapters.append(name)
                    write_placed_(weight, placement, merged)
        except BaseException:
            self.unmerge_to(merged_before)
            raise

    def _merge_quantized(self, names: list[str], safe_merge: bool) -> None:
        """Per adapter: dequantize the layer, add the deltas, quantize again; the replaced weight is kept for unmerge.

        Like peft's LoRA on quantized layers, the merged weight is rounded to the quantization grid, which warns.
        """
        merged_before = len(self.merged_adapters)
        try:
            with self._weight_lock(), torch.no_grad():
                for name in names:
                    quantized = self.quantized()  # the layer as the previous adapter left it
                    warnings.warn(
                        f"Merge NeuroAda deltas into a {quantized.kind} layer may get different generations due to "
                        "rounding errors: the merged weight is quantized again (unmerge restores the original "
                        f"exactly). {FULL_PRECISION_HINT}",
                        stacklevel=3,
                    )
                    weight = quantized.dense()
                    placement = self.placement(name)
                    merged = placed_entries(weight, placement) + self.neuroada_delta[name].detach().float()
                    _check_finite(name, merged, safe_merge)
                    write_placed_(weight, placement, merged)
                    self._quantized_originals[name] = quantized.snapshot()
                    self.merged_adapters.append(name)
                    quantized.replace(weight)
        except BaseException:
            self.unmerge_to(merged_before)
            raise

    def check_mergeable(self) -> None:
        """Raise before anything changes if the deltas cannot be merged into this layer's base weight (shared, or a
        quantized weight that cannot be quantized again)."""
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
        """Unmerge the most recently merged adapters until `count` remain merged.

        All or nothing on a float weight: if a write fails, the adapters this call already unmerged are written back
        as they were. On a quantized layer each step puts back one snapshot (the layer as it was before that adapter
        merged) and only then forgets it, so a failure leaves the layer as `merged_adapters` says.
        """
        if self._quantized_originals:
            with self._weight_lock():
                while len(self.merged_adapters) > count:
                    name = self.merged_adapters[-1]
                    self._quantized_originals[name].restore()
                    del self._quantized_originals[name]
                    self.merged_adapters.pop()
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
    """`container[name]` (None if absent), made an ordinary tensor if it is an inference tensor (created or loaded
    under `torch.inference_mode()`): those have no version counter, so a write into them could not be seen."""
    tensor = container._buffers.get(name)
    if tensor is not None and tensor.is_inference():
        with torch.inference_mode(False):
            tensor = container[name] = tensor.clone()
    return tensor


def _tensor_state(tensor: torch.Tensor | None) -> tuple | None:
    """What changes when a tensor is replaced, re-pointed (`.data = ...`) or written in place (its version)."""
    return None if tensor is None else (id(tensor), tensor.data_ptr(), tensor._version)


def _check_finite(adapter_name: str, merged: torch.Tensor, safe_merge: bool) -> None:
    """`safe_merge`: refuse merged entries that are NaN or inf, before anything is written."""
    if safe_merge and not torch.isfinite(merged).all():
        raise ValueError(
            f"Refusing to merge adapter '{adapter_name}': it would put NaN/inf values into the base weight, "
            "so its deltas are broken (check the training loss and learning rate)."
        )


def _owned(placement: Placement) -> Placement:
    """A copy that owns its indices: the entries an unmerge writes back are the ones the merge changed, even if the
    adapter's index buffer (which `placement` views) is written meanwhile."""
    return Placement(placement.cols.clone(), None if placement.rows is None else placement.rows.clone())


def _same_placement(first: Placement, second: Placement) -> bool:
    if first.rows is None or second.rows is None:
        same_rows = first.rows is second.rows
    else:
        same_rows = torch.equal(first.rows.long(), second.rows.long())
    return same_rows and torch.equal(first.cols.long(), second.cols.long())


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
        if adapter_names is None and (mixed := served_mixed_batch()) is not None:
            adapter_names = mixed.for_layer(self)
        if adapter_names is not None:
            return self._mixed_batch_forward(x, adapter_names, *args, **kwargs)
        active = [name for name in self.active_adapters if name in self.neuroada_delta]
        if self.merged or not active:  # (read under the lock: another thread's visit may have the weight patched)
            return frozen_output(self.frozen(), x, *args, **kwargs)
        return self._adapted(x, active, *args, **kwargs)

    def _adapted(self, x: torch.Tensor, adapters: list[str], *args: Any, **kwargs: Any) -> torch.Tensor:
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
