"""The plugin's NeuroAda layers: the tuner's, with the plugin's guard rails.

On top of the tuner's layers they keep each adapter's placement for reuse and check its indices whenever they change
(before a sparse kernel or a merge reads them), keep only the input columns k=1's deltas read for backward (found once
per kept placement), run the CPU's sparse products, refuse the merged copy while global module hooks are registered,
serve mixed batches per thread (a context variable where peft's forward hooks would reach every thread's calls), and
read quantized weights a block of rows at a time.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.modules.module as module_hooks
from peft.tuners._buffer_dict import BufferDict

from .accel import sparse_products
from .quantized import QuantizedLinear, keep_standard_layout, quantized_linear
from .tuner import experts, forward, layer, merged_copy
from .tuner.forward import Placement, transformed
from .tuner.guards import placement_problem
from .tuner.mixed_batch import MixedBatch
from .weighted_adapters import WeightedLayer

# The batch a call serves reaches exactly the layers its own thread (or task) runs. torch.compile cannot trace
# `ContextVar.get`, but guards on the plain list of calls serving one (append and remove are atomic): graphs without
# one never read the context variable.
_MIXED_BATCH: ContextVar[MixedBatch | None] = ContextVar("neuroada_mixed_batch", default=None)
_SERVING: list[object] = []
# Backward keeps only the input columns the deltas read when they are at most this share of the input.
COMPACT_INPUT_MAX_SHARE = 0.5
# torch's registries of global module hooks (no public API tells whether one is registered): the copy path skips the
# base layer's call, so it must know whether a global hook would have seen it.
_GLOBAL_HOOKS = (
    module_hooks._global_forward_hooks,
    module_hooks._global_forward_pre_hooks,
    module_hooks._global_backward_hooks,
    module_hooks._global_backward_pre_hooks,
)


def copy_refusal(base: torch.nn.Module, weight: torch.Tensor, x: torch.Tensor) -> str | None:
    """The tuner's `copy_refusal`, and hooks registered for every module, which would see the base layer's call."""
    return merged_copy.copy_refusal(base, weight, x) or (
        "global module hooks would see the base layer's call" if any(_GLOBAL_HOOKS) else None
    )


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


class KeptPlacements(dict):
    """A layer's placements by adapter, kept for the process it runs in: copies and pickles start empty."""

    def __reduce__(self) -> tuple:
        return (KeptPlacements, ())

    def __deepcopy__(self, memo: dict) -> KeptPlacements:
        return KeptPlacements()


class PluginLayer(WeightedLayer):
    """What the plugin adds to a tuner layer (mixed in before it)."""

    requantize_with: Any = None  # the torchao config a merged torchao weight is quantized with again
    copy_refusal = staticmethod(copy_refusal)
    # The CPU's sparse products (measured faster there; docs/performance.md), the tuner's elsewhere.
    kernels = forward.Kernels(
        sparse_products.sampled_grad, sparse_products.bypass_forward, sparse_products.bypass_input_grad
    )

    def _select(self, adapter_name: str, config: Any, k: int) -> tuple[int, torch.dtype]:
        """'gradient' starts from the magnitude selection, until `select_by_gradient` re-selects."""
        if config.selection == "gradient":
            config = copy.copy(config)
            config.selection = "magnitude"
        return super()._select(adapter_name, config, k)

    def placement(self, adapter_name: str) -> Placement:
        """The adapter's placement: the same object while its index buffer, rows and deltas' shape are unchanged, and
        checked again before a kernel or merge reads indices that may have changed: a new buffer (selection, loading)
        or one written in place (`load_state_dict` in a resume, `copy_`: its version counter shows it; writes through
        `.data` bypass it, as they bypass autograd's own check)."""
        # The containers' own dicts: ParameterDict/BufferDict lookups cost 1-1.5 us each, at every visit.
        shape = self.neuroada_delta._parameters[adapter_name].shape
        buffer, rows = self.neuroada_indices._buffers[adapter_name], self.neuroada_rows._buffers.get(adapter_name)
        if torch.compiler.is_compiling() or transformed(buffer):  # dynamo would guard on what is kept; a
            return Placement(buffer, rows)  # buffer vmapped (stack_module_state) has no storage
        if buffer.is_inference() or (rows is not None and rows.is_inference()):
            buffer = _versioned(self.neuroada_indices, adapter_name)
            rows = _versioned(self.neuroada_rows, adapter_name)
        state = (_tensor_state(buffer), _tensor_state(rows), shape)
        placements = vars(self).get("_placements")
        if placements is None:
            placements = vars(self).setdefault("_placements", KeptPlacements())
        kept = placements.get(adapter_name)
        if kept is None or kept[2] != state:
            # (the tensors stay in the entry, so an id in `state` is never reused while it is kept)
            with torch.inference_mode(False):  # views made in inference mode would have no version counter
                if problem := placement_problem(self, shape, buffer, rows):
                    raise ValueError(
                        f"NeuroAda adapter '{adapter_name}' cannot run at layer '{self.layer_name}': {problem}. They "
                        "were loaded or changed after the adapter was made (load_state_dict or a checkpoint resume "
                        "copying other tensors in, a write into the buffer, a conversion of every tensor such as "
                        "`model.type(...)`), or the adapter was trained on another base model. Nothing was computed "
                        "or written: load the adapter again from its saved files (PeftModel.from_pretrained / "
                        "load_adapter) on the base model it was trained on."
                    )
                kept = (buffer, rows, state, with_read_columns(Placement(buffer, rows).prepared(), self.in_features))
            if kept[3].neurons is not None:  # prepared: nothing in it was made under a torch.func transform
                placements[adapter_name] = kept
        return kept[3]

    def delete_adapter(self, adapter_name: str) -> None:
        """peft's, also dropping the adapter's kept placement (a merged adapter cannot be deleted: peft refuses, as its
        merge record must stay)."""
        super().delete_adapter(adapter_name)
        vars(self).get("_placements", {}).pop(adapter_name, None)


class Linear(PluginLayer, layer.Linear):
    __doc__ = layer.Linear.__doc__

    def forward(self, x: torch.Tensor, *args: Any, adapter_names: list[str] | None = None, **kwargs: Any):
        if adapter_names is None and _SERVING and (mixed := _MIXED_BATCH.get()) is not None:
            adapter_names = mixed.for_layer(self)
        return super().forward(x, *args, adapter_names=adapter_names, **kwargs)

    def quantized(self) -> QuantizedLinear | None:
        """The base layer seen as its dequantized weight, read a block of rows at a time (None: a float weight)."""
        return quantized_linear(self.get_base_layer(), self.requantize_with)

    def requantize_refusal(self, quantized: QuantizedLinear) -> str | None:
        return quantized.merge_refusal()

    def snapshot(self, quantized: QuantizedLinear) -> Callable[[], None]:
        return quantized.snapshot()

    def requantize(self, quantized: QuantizedLinear, weight: torch.Tensor) -> None:
        quantized.replace(weight)

    def _select(self, adapter_name: str, config: Any, k: int) -> tuple[int, torch.dtype]:
        if self.quantized() is not None:
            keep_standard_layout(self.get_base_layer())
        return super()._select(adapter_name, config, k)


class CallLock:
    """Serialises the calls of one expert wrapper, whose parametrization changes the experts module for the call.
    Copies and pickles get their own lock, and a forked child a fresh one: a lock another thread held at the fork
    would never be released there."""

    def __init__(self) -> None:
        self._pid, self._lock = os.getpid(), threading.Lock()

    def __enter__(self) -> None:
        if self._pid != os.getpid():
            self._pid, self._lock = os.getpid(), threading.Lock()
        self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()

    def __reduce__(self) -> tuple:
        return (CallLock, ())

    def __deepcopy__(self, memo: dict) -> CallLock:
        return CallLock()


class ParamWrapper(PluginLayer, experts.ParamWrapper):
    __doc__ = (
        experts.ParamWrapper.__doc__ + "\n\n    The plugin's serves calls from any number of threads, one at a time."
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._call_lock = CallLock()
        super().__init__(*args, **kwargs)

    @contextmanager
    def _deltas_added(self, adapters: list[str]):
        with self._call_lock, super()._deltas_added(adapters):
            yield


def with_read_columns(placement: Placement, d_in: int) -> Placement:
    """`placement` with the input columns its deltas read (`read`, sorted; `read_cols`: `cols` as positions among
    them) when they are at most `COMPACT_INPUT_MAX_SHARE` of the input (k=1 reads a small share of most layers'
    inputs), so backward keeps only those columns. Found once per kept placement: `unique` waits on the device."""
    if placement.neurons is None or placement.cols.numel() > 2 * d_in:  # (not prepared: made under a transform)
        return placement
    used, local = torch.unique(placement.cols.reshape(-1).long(), return_inverse=True)
    if used.numel() > COMPACT_INPUT_MAX_SHARE * d_in:
        return placement
    return placement._replace(read=used, read_cols=local.to(placement.cols.dtype).view(placement.cols.shape))


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
