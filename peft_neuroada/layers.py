"""The plugin's components for the tuner's layers (`NeuroAdaLayer.COMPONENTS`), given to each layer as it is made
(`components`): the CPU's sparse products; a placement kept per adapter and checked whenever its indices change
(before a sparse kernel or a merge reads them), keeping only the input columns k=1's deltas read for backward; the
merged-copy path (merged_copy.py); quantized weights read a block of rows at a time; checks before a merge; mixed
batches served per thread (a context variable, where peft's forward hooks would reach every thread's calls); and, for
an expert wrapper, a lock serialising its calls.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
from peft.tuners._buffer_dict import BufferDict
from torch import nn

from .accel import sparse_products
from .guards import check_merge, guard_loads, placement_problem
from .merged_copy import merged_forward
from .quantized import QuantizedLinear, keep_standard_layout, quantized_linear
from .tuner import forward, layer
from .tuner.experts import ParamWrapper
from .tuner.forward import Placement, transformed
from .tuner.model import MixedBatch

# The batch a call serves reaches exactly the layers its own thread (or task) runs. torch.compile cannot trace
# `ContextVar.get`, but guards on the plain list of calls serving one (append and remove are atomic): graphs without
# one never read the context variable.
_MIXED_BATCH: ContextVar[MixedBatch | None] = ContextVar("neuroada_mixed_batch", default=None)
_SERVING: list[object] = []
# Backward keeps only the input columns the deltas read when they are at most this share of the input.
COMPACT_INPUT_MAX_SHARE = 0.5
# The CPU's sparse products (measured faster there; docs/performance.md), the tuner's elsewhere.
KERNELS = forward.Kernels(
    sparse_products.sampled_grad, sparse_products.bypass_forward, sparse_products.bypass_input_grad
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


def served_names(layer: nn.Module) -> list[str] | None:
    """The rows' adapter names of the mixed batch this thread serves, for `layer` (None: none)."""
    if _SERVING and (mixed := _MIXED_BATCH.get()) is not None:
        return mixed.for_layer(layer)
    return None


class KeptPlacements:
    """A layer's placements by adapter, kept while its index buffer, rows and deltas' shape are unchanged and checked
    again before a kernel or merge reads indices that may have changed: a new buffer (selection, loading) or one
    written in place (`load_state_dict` in a resume, `copy_`: its version counter shows it; writes through `.data`
    bypass it, as they bypass autograd's own check). Kept for the process it runs in: copies and pickles start
    empty."""

    def __init__(self) -> None:
        self.kept: dict[str, tuple] = {}

    def __reduce__(self) -> tuple:
        return (KeptPlacements, ())

    def __deepcopy__(self, memo: dict) -> KeptPlacements:
        return KeptPlacements()

    def __call__(self, layer: nn.Module, adapter_name: str) -> Placement:
        # The containers' own dicts: ParameterDict/BufferDict lookups cost 1-1.5 us each, at every visit.
        shape = layer.neuroada_delta._parameters[adapter_name].shape
        buffer, rows = layer.neuroada_indices._buffers[adapter_name], layer.neuroada_rows._buffers.get(adapter_name)
        if torch.compiler.is_compiling() or transformed(buffer):  # dynamo would guard on what is kept; a
            return Placement(buffer, rows)  # buffer vmapped (stack_module_state) has no storage
        if buffer.is_inference() or (rows is not None and rows.is_inference()):
            buffer = _versioned(layer.neuroada_indices, adapter_name)
            rows = _versioned(layer.neuroada_rows, adapter_name)
        state = (_tensor_state(buffer), _tensor_state(rows), shape)
        kept = self.kept.get(adapter_name)
        if kept is None or kept[2] != state:
            # (the tensors stay in the entry, so an id in `state` is never reused while it is kept)
            with torch.inference_mode(False):  # views made in inference mode would have no version counter
                if problem := placement_problem(layer, shape, buffer, rows):
                    raise ValueError(
                        f"NeuroAda adapter '{adapter_name}' cannot run at layer '{layer.layer_name}': {problem}. They "
                        "were loaded or changed after the adapter was made (load_state_dict or a checkpoint resume "
                        "copying other tensors in, a write into the buffer, a conversion of every tensor such as "
                        "`model.type(...)`), or the adapter was trained on another base model. Nothing was computed "
                        "or written: load the adapter again from its saved files (PeftModel.from_pretrained / "
                        "load_adapter) on the base model it was trained on."
                    )
                kept = (buffer, rows, state, with_read_columns(Placement(buffer, rows).prepared(), layer.in_features))
            if kept[3].neurons is not None:  # prepared: nothing in it was made under a torch.func transform
                self.kept[adapter_name] = kept
        return kept[3]

    def forget(self, names: set[str]) -> None:
        """Drop what is kept for adapters other than `names` (the layer's adapters after a deletion)."""
        for name in set(self.kept) - names:
            del self.kept[name]


class QuantizedView(NamedTuple):
    """A layer's `quantized_view` component: its quantized base read a block of rows at a time, merged weights
    quantized again with `requantize_with` (the torchao config the model was loaded with, if any)."""

    requantize_with: Any = None

    def __call__(self, layer: nn.Module) -> QuantizedLinear | None:
        base = layer.get_base_layer()
        view = quantized_linear(base, self.requantize_with)
        if view is not None:
            keep_standard_layout(base)
        return view


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


def parameter_components() -> dict[str, Any]:
    """The plugin's components for a new `ParamWrapper`."""
    return {"kernels": KERNELS, "placements": KeptPlacements(), "merge_check": check_merge, "call_guard": CallLock()}


class NeuroAdaLinear(layer.Linear):
    """The tuner's `Linear` with the plugin's components; its loads guarded (guards.py). `requantize_with`: the
    torchao config the model was loaded with, to merge into torchao weights."""

    kernels = KERNELS
    merged_forward = staticmethod(merged_forward)
    merge_check = staticmethod(check_merge)
    mixed_batch_names = staticmethod(served_names)

    def __init__(self, *args: Any, requantize_with: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("placements", KeptPlacements())
        kwargs.setdefault("quantized_view", QuantizedView(requantize_with))
        super().__init__(*args, **kwargs)
        guard_loads(self)


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


__all__ = ["NeuroAdaLinear", "ParamWrapper", "parameter_components", "serving"]
