"""The sparse bypass `(P ⊙ Θ) x`, its gradients, and `adapted_linear`: the one entry point that picks how to run it.

Three paths compute `W x + b + (P ⊙ Θ) x`, each guarded by the preconditions stated beside it:

* **in place** (neither `linear_refusal` nor `write_refusal` finds anything against it): the deltas are added into
  the k selected entries of each row of the frozen weight for the duration of one matmul, and the saved original
  entries are written back bit-exactly afterwards (by the C kernels for one adapter on the CPU, `kernels.entry_patch`;
  by torch's gather/scatter_ otherwise). Forward and input gradient cost exactly one dense matmul each, like a frozen
  layer, and nothing of size d_out x d_in is allocated. Every visit holds the weight's lock (`weight_lock`), so
  threads never see or write each other's patched entries.
* **direct** (`linear_refusal` finds nothing against it: a plain frozen `nn.Linear`/`Conv1D` weight that merely must
  not be written, e.g. shared, an inference tensor, or `inplace_forward=False`): `F.linear(x, W, b)` with the sparse
  products of `kernels` added into its output and into its input gradient, reading the weight under its lock.
* **general**: `base(x) + bypass(x)` for every other base layer (quantized, hooked, offloaded, traced by
  `torch.compile`, ...), which runs the base layer's own forward and never touches its weight.

All keep only the layer input (or just the columns of it the deltas read) for backward; the delta gradient is the
dense weight gradient sampled at the selected positions, `grad[i, j] = sum_t grad_out[t, rows[i]] * x[t, cols[i, j]]`,
computed by `kernels.sampled_grad` without forming it.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.nn.modules.module as module_hooks
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import kernels

# Backward keeps only the input columns the deltas read when they are at most this share of the input.
_COMPACT_INPUT_MAX_SHARE = 0.5


class Placement(NamedTuple):
    """Where one adapter's deltas sit in a (d_out, d_in) weight: delta[i, j] belongs to input `cols[i, j]` of neuron
    `rows[i]`, or of neuron `i` when every neuron is tuned (`rows` is None)."""

    cols: torch.Tensor
    rows: torch.Tensor | None = None


# --- Preconditions of the in-place and direct paths ---------------------------------------------------------------

_LINEAR_MODULES = (nn.Linear, Conv1D)
_PLAIN_WEIGHT_TYPES = (nn.Parameter, torch.Tensor)


def linear_refusal(base: nn.Module, weight: torch.Tensor) -> str | None:
    """Why `F.linear(x, weight, base.bias)` may not stand in for `base(x)`, or None (the direct path's condition).

    It may for a plain `nn.Linear`/`Conv1D` with a frozen weight whose calls nothing observes (no forward or backward
    hooks on it, none registered for every module: only the base layer's own call would run them), with a plain dense
    floating-point weight in memory, outside `torch.compile` and tracing (those see the base layer's own forward). A
    trained bias (`bias="all"`) is fine: both paths return its gradient.
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return "the graph is being traced"
    if type(base) not in _LINEAR_MODULES:
        return f"the base layer is a {type(base).__name__}"
    if type(weight) not in _PLAIN_WEIGHT_TYPES or type(base.weight) not in _PLAIN_WEIGHT_TYPES:
        return f"the weight is a {type(base.weight).__name__}"
    if weight.layout != torch.strided or not weight.dtype.is_floating_point or weight.is_meta:
        return "the weight is not a dense floating-point tensor in memory"
    if weight.requires_grad:
        return "the base layer's weight trains"
    # accelerate's hook is an instance attribute (`module._hf_hook = hook`): a dict lookup, where `hasattr` on a module
    # that lacks it raises and catches an AttributeError on every call.
    if base._forward_hooks or base._forward_pre_hooks or "_hf_hook" in vars(base):
        return "the base layer has forward hooks"
    if base._backward_hooks or base._backward_pre_hooks:
        return "the base layer has backward hooks"
    if _global_module_hooks():
        return "module hooks are registered globally (torch.nn.modules.module.register_module_*_hook)"
    return None


def _global_module_hooks() -> bool:
    """Whether hooks on every module's forward or backward exist: only the base layer's own call runs them."""
    return bool(
        module_hooks._global_forward_hooks
        or module_hooks._global_forward_pre_hooks
        or module_hooks._global_backward_hooks
        or module_hooks._global_backward_pre_hooks
    )


def write_refusal(weight: torch.Tensor, shared_with: Sequence[str] = ()) -> str | None:
    """Why the in-place path must not write into `weight` (the (d_out, d_in) view of a base layer's weight) that
    `linear_refusal` lets the direct path read, or None.

    The weight must be writable and this layer's alone, and the matmul must run in its dtype (not autocast to a
    narrower one): not an inference tensor (read-only outside inference mode), not in shared memory, not shared with
    other modules (they could read the patched entries from another thread; `shared_with` names them as the model
    found them when adapters were added or before a merge), and owning its whole storage (not a view into a larger
    buffer such as an FSDP1 flat parameter).
    """
    if weight.is_inference():
        return "the weight is an inference tensor"
    device = weight.device.type
    if torch.is_autocast_enabled(device) and (narrower := torch.get_autocast_dtype(device)).itemsize < (
        weight.element_size()
    ):
        # The matmul would see W + delta rounded to the autocast dtype, where a delta under half a step of its (the
        # row's largest) weight vanishes; beside the matmul, the bypass counts it as LoRA's product would count.
        return f"autocast runs the matmul in {narrower}"
    storage = weight.untyped_storage()  # (its `is_shared` costs a tenth of the tensor's, which builds a TypedStorage)
    if device == "cpu" and storage.is_shared():  # (CUDA tensors always report shared)
        return "the weight is in shared memory (other processes may read it; `share_memory()`, torch.multiprocessing)"
    if device == "cuda" and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured (its replays could overlap other streams' visits)"
    if shared_with:
        return f"the weight is shared with {', '.join(shared_with)}"
    if weight.storage_offset() != 0 or storage.nbytes() != weight.numel() * weight.element_size():
        return "the weight is a view into a larger buffer"
    return None


class WeightLock:
    """Serialises every visit of the adapter layers to one weight: the threads' (a reentrant lock), and on CUDA also
    the streams they queue the visits' work on.

    Holding the lock orders only the queueing; a GPU runs what two streams queued concurrently, so a visit queued on
    another stream than the last one first makes its stream wait for everything queued on that one (a patch and its
    restore, or a read a patch must not overtake). On one stream, the default one included, that order holds already.
    While a CUDA graph is captured nothing is ordered: its work runs when the graph is replayed (`write_refusal`
    keeps the in-place path out of captures).
    """

    __slots__ = ("_lock", "_stream", "device", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._stream: torch.cuda.Stream | None = None
        self.device: torch.device | None = None  # the weight's, set by `weight_lock`

    def __enter__(self) -> WeightLock:
        self._lock.acquire()
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            stream, last = torch.cuda.current_stream(self.device), self._stream
            if last is not None and last != stream:
                stream.wait_stream(last)
            self._stream = stream
        return self

    def __exit__(self, *exc_info) -> None:
        self._lock.release()


# One lock per patchable base layer (its weight belongs to it alone): held across patch, matmul and restore, and by
# every other read of that weight through the adapter layer, in forward and in backward. Keyed weakly by the module,
# so copies of a model get their own locks and nothing is kept alive or pickled.
_WEIGHT_LOCKS: weakref.WeakKeyDictionary[nn.Module, WeightLock] = weakref.WeakKeyDictionary()
_WEIGHT_LOCKS_GUARD = threading.Lock()


def weight_lock(base: nn.Module, device: torch.device) -> WeightLock:
    """The lock that serialises every visit of the adapter layers to `base`'s weight, which is on `device`."""
    lock = _WEIGHT_LOCKS.get(base)
    if lock is None:
        with _WEIGHT_LOCKS_GUARD:
            lock = _WEIGHT_LOCKS.setdefault(base, WeightLock())
    lock.device = device
    return lock


# Weight locks the forking thread holds from just before a fork until just after it (see `_hold_weights_for_fork`).
_HELD_FOR_FORK: list[WeightLock] = []


def _hold_weights_for_fork() -> None:
    """Before `os.fork`: wait for the visits in flight and hold every weight lock (and the guard, so no new one is
    made) through the fork. A child has only the forking thread: a lock another thread held, or a weight it had
    patched, would stay so in the child forever (servers that fork workers, DataLoader workers started while other
    threads serve). Visits hold one weight lock at a time, so taking them one by one cannot deadlock."""
    while True:
        _WEIGHT_LOCKS_GUARD.acquire()
        held = {id(lock) for lock in _HELD_FOR_FORK}
        pending = [lock for lock in list(_WEIGHT_LOCKS.values()) if id(lock) not in held]
        if not pending:
            return
        _WEIGHT_LOCKS_GUARD.release()
        for lock in pending:
            lock._lock.acquire()
            _HELD_FOR_FORK.append(lock)


def _release_weights_after_fork() -> None:
    """After `os.fork`, in parent and child alike (the child's one thread is the one that took them)."""
    for lock in _HELD_FOR_FORK:
        lock._lock.release()
    _HELD_FOR_FORK.clear()
    _WEIGHT_LOCKS_GUARD.release()


os.register_at_fork(
    before=_hold_weights_for_fork,
    after_in_parent=_release_weights_after_fork,
    after_in_child=_release_weights_after_fork,
)


# --- Reading and writing the selected entries of a weight ---------------------------------------------------------


class _Entries(NamedTuple):
    """Selected entries of one weight, located once per visit and read or written in delta order (n, k)."""

    target: torch.Tensor  # the (d_out, d_in) weight itself (row-wise) or a 1-D view of its storage
    index: torch.Tensor  # int64: (n, k) columns along dim 1 (row-wise), or positions in the storage (any shape)
    row_wise: bool

    def read(self) -> torch.Tensor:
        return self.target.gather(1, self.index) if self.row_wise else self.target[self.index]

    def write(self, values: torch.Tensor) -> None:
        self.writer(values)()

    def writer(self, values: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The write as one call into torch, with nothing in Python between a `finally:` and the write itself."""
        if self.row_wise:
            return functools.partial(self.target.scatter_, 1, self.index, values)
        return functools.partial(self.target.index_put_, (self.index,), values)


def _row_wise(weight: torch.Tensor, placements: Sequence[Placement]) -> bool:
    """Row-wise gather/scatter is fastest for float32/64 with every neuron tuned; elsewhere CPU scatter kernels copy
    a half-precision weight to float32 and back, so positions in the storage are used (this also covers transposed
    views and subsets of neurons)."""
    return weight.dtype in (torch.float32, torch.float64) and all(p.rows is None for p in placements)


def _locate(weight: torch.Tensor, placement: Placement, row_wise: bool) -> _Entries:
    """The entries of `weight` at `placement`, read and written through `weight.data`: the frozen weight's version
    counter never moves, so another autograd graph that saved the weight (a regulariser, a tied use) still runs its
    backward. What any graph reads of it is unchanged: every patch is restored before the visit ends, and a merge is
    the model's new weight, as LoRA's merge (which writes `weight.data`) makes it."""
    weight = weight.data
    cols = placement.cols.long()
    if row_wise:
        return _Entries(weight, cols, row_wise=True)
    rows = torch.arange(cols.shape[0], device=cols.device) if placement.rows is None else placement.rows.long()
    storage = weight.as_strided((weight.numel(),), (1,), weight.storage_offset())
    return _Entries(storage, rows[:, None] * weight.stride(0) + cols * weight.stride(1), row_wise=False)


def _joined(entries: Sequence[_Entries]) -> _Entries:
    """All entries of several placements as one (positions may repeat across adapters)."""
    first = entries[0]
    if first.row_wise:
        return _Entries(first.target, torch.cat([e.index for e in entries], dim=1), row_wise=True)
    return _Entries(first.target, torch.cat([e.index.reshape(-1) for e in entries]), row_wise=False)


def _with_deltas_added(weight: torch.Tensor, placements: Sequence[Placement], deltas: Sequence[torch.Tensor], compute):
    """`compute()` while `weight` holds the deltas at their placements; afterwards every entry is bit-identical.

    The original values of every touched entry are read before anything is written, and the `finally` writes them all
    back in a single torch call (retried once if that call itself is interrupted), so an exception anywhere (including
    KeyboardInterrupt, or a failing second adapter) restores the weight. Placements of different adapters may overlap:
    each one adds to what the previous wrote.
    """
    if len(placements) == 1 and kernels.patches_entries(weight, deltas[0]):
        return _with_delta_added_by_kernel(weight, placements[0], deltas[0], compute)
    row_wise = _row_wise(weight, placements)
    entries = [_locate(weight, placement, row_wise) for placement in placements]
    everything = entries[0] if len(entries) == 1 else _joined(entries)
    with torch.no_grad():
        originals = everything.read()

    @torch.no_grad()
    def patch() -> None:
        if len(entries) == 1:
            entries[0].write(originals + deltas[0].detach().to(originals.dtype))
        else:
            for located, delta in zip(entries, deltas, strict=True):
                located.write(located.read() + delta.detach().to(originals.dtype))

    return _patched(patch, compute, everything.writer(originals))


def _with_delta_added_by_kernel(weight: torch.Tensor, placement: Placement, delta: torch.Tensor, compute):
    """`_with_deltas_added` for one adapter, by the C kernels: one pass saves and patches the entries, one
    writes them back, each split across threads; the restore writes back exactly what the patch wrote, also when an
    exception came before or during the patch (`kernels.entry_patch`)."""
    entries = kernels.entry_patch(weight, placement.cols, placement.rows, delta)
    return _patched(entries.apply, compute, entries.restore)


def _patched(patch: Callable[[], None], compute, restore: Callable[[], object]):
    """`patch()`, then `compute()`; `restore()` in any case, as the one call in a `finally` (retried once if that call
    itself is interrupted), so an exception anywhere, KeyboardInterrupt included, leaves the weight as it was."""
    try:
        patch()
        return compute()
    finally:
        try:
            restore()
        except BaseException:
            restore()
            raise


def placed_entries(weight: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The entries of `weight` (a (d_out, d_in) view) at the placement, shaped like the deltas."""
    return _locate(weight, placement, _row_wise(weight, [placement])).read()


def write_placed_(weight: torch.Tensor, placement: Placement, values: torch.Tensor) -> None:
    """Write `values` (shaped like the deltas) into the entries of `weight` at the placement."""
    _locate(weight, placement, _row_wise(weight, [placement])).write(values)


# --- What backward keeps ------------------------------------------------------------------------------------------


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class InputsKeptWhole:
    """Layer inputs that some NeuroAda layer's backward already keeps whole.

    q/k/v (and gate/up) read the same input. Once one of them keeps it whole, saving a reference in the others is free,
    while a compacted copy of its columns would cost memory; so they reference it too. Entries are weak (keyed by
    `id`, checked by identity, dropped when the tensor dies), so nothing is kept alive and a reused id never matches.
    """

    def __init__(self) -> None:
        self._tensors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def holds(self, x: torch.Tensor) -> bool:
        return self._tensors.get(id(x)) is x

    def add(self, x: torch.Tensor) -> None:
        self._tensors[id(x)] = x


INPUTS_KEPT_WHOLE = InputsKeptWhole()


class ColumnCompactions:
    """The input columns one placement reads (`torch.unique` of its cols) and its cols re-indexed into them, kept per
    cols tensor (layers hand out the same one from step to step, `Linear.placement`): training would otherwise
    recompute them at every visit of every layer.

    A kept value is used only for the very same tensor (checked by identity through a weak reference, dropped when it
    dies), viewed the same way and at the same version counter, so indices changed in place, a new index tensor or a
    reused address never find a stale value (writes through `.data` bypass version counters, and so this check, as they
    bypass autograd's own). Inference tensors (no version counter) are not kept."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[weakref.ref, tuple, torch.Tensor, torch.Tensor]] = {}

    def get(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if cols.is_inference():
            return _unique_columns(cols)
        view = (cols.storage_offset(), cols.shape, cols.stride(), cols.dtype, cols._version)
        kept = self._kept.get(id(cols))
        if kept is not None and kept[0]() is cols and kept[1] == view:
            return kept[2], kept[3]
        used, local = _unique_columns(cols)
        forget = functools.partial(self._forget, id(cols))
        self._kept[id(cols)] = (weakref.ref(cols, forget), view, used, local)
        return used, local

    def _forget(self, key: int, _dead: weakref.ref) -> None:
        self._kept.pop(key, None)


COLUMN_COMPACTIONS = ColumnCompactions()


def _unique_columns(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted distinct columns in `cols` and `cols` as positions among them (shaped like `cols`, in its dtype: a
    kept re-indexing costs no more memory than the index it stands for)."""
    used, local = torch.unique(cols.reshape(-1).long(), return_inverse=True)
    return used, local.to(cols.dtype).view(cols.shape)


def input_for_backward(x: torch.Tensor, placements: Sequence[Placement]) -> tuple[torch.Tensor, list[Placement]]:
    """What backward needs of the layer input: the input itself, or only the columns the deltas read.

    Returns the tensor to save and the placements re-indexed into its columns. The input is kept whole when another
    layer already keeps it (saving a reference is free) or when the deltas read most of its columns.
    """
    d_in = x.shape[-1]
    selected = sum(p.cols.numel() for p in placements)
    if not INPUTS_KEPT_WHOLE.holds(x) and selected <= 2 * d_in:
        if len(placements) == 1:
            used, local = COLUMN_COMPACTIONS.get(placements[0].cols)
        else:
            used, local = _unique_columns(torch.cat([p.cols.reshape(-1) for p in placements]))
        if used.numel() <= _COMPACT_INPUT_MAX_SHARE * d_in:
            local_cols = local.reshape(-1).split([p.cols.numel() for p in placements])
            compact = [Placement(c.view_as(p.cols), p.rows) for c, p in zip(local_cols, placements, strict=True)]
            x2d = _flatten(x)
            return torch.gather(x2d, 1, used.expand(x2d.shape[0], -1)), compact
    INPUTS_KEPT_WHOLE.add(x)
    return x, list(placements)


# --- Autograd functions -------------------------------------------------------------------------------------------


def _delta_grads(ctx, x_saved: torch.Tensor | None, grad2d: torch.Tensor, deltas, needs: Sequence[bool]) -> list:
    """The deltas' gradients: the dense weight gradient sampled at each placement (None where not needed)."""
    return [
        kernels.sampled_grad(_flatten(x_saved), grad2d, placement.cols, placement.rows).to(delta.dtype)
        if need
        else None
        for placement, delta, need in zip(ctx.saved_placements, deltas, needs, strict=True)
    ]


def _keep_for_backward(ctx, x, weight, bias, lock, placements: Sequence[Placement], deltas) -> None:
    """What the in-place and direct paths' backward reads: the input (or the columns of it the deltas read) and the
    deltas as saved tensors. The weight is kept as a plain reference, not saved: in-place visits change its version
    on every call, and backward reads it under its lock."""
    needs_delta_grads = any(ctx.needs_input_grad[5:])
    x_saved, ctx.saved_placements = input_for_backward(x, placements) if needs_delta_grads else (None, placements)
    ctx.save_for_backward(x_saved, *deltas)
    ctx.weight, ctx.lock, ctx.placements, ctx.input_dtype = weight, lock, placements, x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _times_weight(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad_out @ weight.to(grad_out.dtype)


def _bias_grad(ctx, grad2d: torch.Tensor) -> torch.Tensor | None:
    """The gradient of a trained base bias (`bias="all"`): the output gradient summed over tokens."""
    return grad2d.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None


def merged_linear(x, weight, bias, lock, placements: Sequence[Placement], *deltas: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, W + scatter(deltas), b)` on the frozen weight's own storage, with no autograd bookkeeping."""
    with lock:
        return _with_deltas_added(weight, placements, deltas, lambda: F.linear(x, weight, bias))


class InplaceMergedLinear(torch.autograd.Function):
    """`merged_linear` with the deltas' gradient (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lock, placements, *deltas):
        out = merged_linear(x, weight, bias, lock, placements, *deltas)
        _keep_for_backward(ctx, x, weight, bias, lock, placements, deltas)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_saved, *deltas = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            with ctx.lock:
                input_grad = functools.partial(_times_weight, grad_out, ctx.weight)
                grad_x = _with_deltas_added(ctx.weight, ctx.placements, deltas, input_grad)
            grad_x = grad_x.to(ctx.input_dtype)
        grad2d = _flatten(grad_out)
        grad_deltas = _delta_grads(ctx, x_saved, grad2d, deltas, ctx.needs_input_grad[5:])
        return grad_x, None, _bias_grad(ctx, grad2d), None, None, *grad_deltas


def direct_linear(x, weight, bias, lock, placements: Sequence[Placement], *deltas: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, W, b) + Σ (P ⊙ Θ) x`, the bypasses added into the matmul's own output; the weight is only read."""
    with lock:
        out = F.linear(x, weight, bias)
    out2d, x2d = _flatten(out), _flatten(x)
    for placement, delta in zip(placements, deltas, strict=True):
        kernels.bypass_forward(x2d, placement.cols, placement.rows, delta.detach(), out.shape[-1], out=out2d)
    return out


class DirectLinear(torch.autograd.Function):
    """`direct_linear` with gradients: the input gradient `grad @ W` (read under the lock, and without autograd's
    version check, which in-place visits of other threads would trip) plus each bypass's transpose, added in place."""

    @staticmethod
    def forward(ctx, x, weight, bias, lock, placements, *deltas):
        out = direct_linear(x, weight, bias, lock, placements, *deltas)
        _keep_for_backward(ctx, x, weight, bias, lock, placements, deltas)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_saved, *deltas = ctx.saved_tensors
        grad2d = _flatten(grad_out)
        grad_x = None
        if ctx.needs_input_grad[0]:
            with ctx.lock:
                grad_x = _times_weight(grad_out, ctx.weight).to(ctx.input_dtype)
            grad_x2d, d_in = _flatten(grad_x), grad_x.shape[-1]
            for placement, delta in zip(ctx.placements, deltas, strict=True):
                kernels.bypass_input_grad(grad2d, placement.cols, placement.rows, delta, d_in, out=grad_x2d)
        grad_deltas = _delta_grads(ctx, x_saved, grad2d, deltas, ctx.needs_input_grad[5:])
        return grad_x, None, _bias_grad(ctx, grad2d), None, None, *grad_deltas


@torch.library.custom_op("neuroada::bypass_input_grad", mutates_args=())
def bypass_input_grad(
    grad2d: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor, d_in: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """`kernels.bypass_input_grad` as an opaque op to `torch.compile`, so compiled graphs run the compiled kernels
    (traced, the torch-op fallback's index_add_ loop is fused by inductor into code that writes out of bounds)."""
    return kernels.bypass_input_grad(grad2d, cols, rows, delta, d_in, dtype)


@bypass_input_grad.register_fake
def _(grad2d, cols, rows, delta, d_in, dtype):
    return grad2d.new_empty(grad2d.shape[0], d_in, dtype=dtype)


def bypass_alone(x: torch.Tensor, placement: Placement, out_features: int, delta: torch.Tensor) -> torch.Tensor:
    """`(P ⊙ Θ) x` alone, for adding to an untouched base layer's output."""
    if torch.is_grad_enabled():
        return SparseBypass.apply(x, placement, out_features, delta)
    out = kernels.bypass_forward(_flatten(x), placement.cols, placement.rows, delta.detach(), out_features)
    return out.view(*x.shape[:-1], out_features)


class SparseBypass(torch.autograd.Function):
    """`bypass_alone` with gradients. Backward keeps what the other paths keep: the layer input or just the columns
    of it the delta reads (whole when traced: the compaction's bookkeeping is Python state), nothing of it when the
    delta is frozen."""

    @staticmethod
    def forward(ctx, x, placement, out_features, delta):
        out = kernels.bypass_forward(_flatten(x), placement.cols, placement.rows, delta, out_features)
        if not ctx.needs_input_grad[3]:
            x_saved, ctx.saved_placements = None, [placement]
        elif torch.compiler.is_compiling():
            x_saved, ctx.saved_placements = x, [placement]
        else:
            x_saved, ctx.saved_placements = input_for_backward(x, [placement])
        ctx.save_for_backward(x_saved, delta)
        ctx.placement, ctx.input_shape, ctx.input_dtype = placement, x.shape, x.dtype
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        x_saved, delta = ctx.saved_tensors
        grad2d = _flatten(grad_out)
        grad_x = grad_delta = None
        if ctx.needs_input_grad[0]:
            cols, rows, (*_, d_in) = ctx.placement.cols, ctx.placement.rows, ctx.input_shape
            grad_x = bypass_input_grad(grad2d, cols, rows, delta, d_in, ctx.input_dtype).view(ctx.input_shape)
        if ctx.needs_input_grad[3]:
            (grad_delta,) = _delta_grads(ctx, x_saved, grad2d, [delta], [True])
        return grad_x, None, None, grad_delta


# --- The entry point ----------------------------------------------------------------------------------------------


class FrozenLinear(NamedTuple):
    """The frozen layer an adapter sits on, as `adapted_linear` needs it."""

    module: nn.Module  # nn.Linear, Conv1D, or any module computing a linear map (quantized, hooked, ...)
    weight: torch.Tensor  # its weight as a (d_out, d_in) view
    shared_with: tuple[str, ...] = ()  # other modules holding the same weight

    def refusal(self, *args, **kwargs) -> str | None:
        """Why the in-place path must not run for a call with these extra base-layer arguments, or None."""
        return self.direct_refusal(*args, **kwargs) or self.write_refusal()

    def direct_refusal(self, *args, **kwargs) -> str | None:
        """Why the direct path must not run for a call with these extra base-layer arguments, or None."""
        if args or kwargs:
            return "the base layer gets extra arguments"
        return linear_refusal(self.module, self.weight)

    def write_refusal(self) -> str | None:
        """Why a weight the direct path may read must still not be written in place, or None."""
        return write_refusal(self.weight, self.shared_with)


def _linear(frozen: FrozenLinear, x: torch.Tensor, placements, deltas, inplace: bool) -> torch.Tensor:
    lock = weight_lock(frozen.module, frozen.weight.device)
    if inplace:
        function, plain = InplaceMergedLinear, merged_linear
    else:
        function, plain = DirectLinear, direct_linear
    # Under no_grad (inference, generation) autograd.Function still reports the deltas as needing gradients.
    if torch.is_grad_enabled():
        return function.apply(x, frozen.weight, frozen.module.bias, lock, tuple(placements), *deltas)
    return plain(x, frozen.weight, frozen.module.bias, lock, placements, *deltas)


def frozen_output(frozen: FrozenLinear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The base layer's own output, read under the weight's lock (an in-place visit of another thread or stream may
    have that weight patched). With gradients a plain linear layer runs as `DirectLinear`, whose backward reads the
    weight under the lock too; without, the base layer's own forward runs under it. Traced, it is the base layer's
    own forward (`torch.compile` does not trace a lock, and the traced visits never patch weights)."""
    if torch.compiler.is_compiling():
        return frozen.module(x, *args, **kwargs)
    if torch.is_grad_enabled() and frozen.direct_refusal(*args, **kwargs) is None:
        return _linear(frozen, x, (), (), inplace=False)
    with weight_lock(frozen.module, frozen.weight.device):
        return frozen.module(x, *args, **kwargs)


def adapted_linear(
    frozen: FrozenLinear,
    x: torch.Tensor,
    placements: Sequence[Placement],
    deltas: Sequence[torch.Tensor],
    out_features: int,
    inplace: bool,
    *args,
    **kwargs,
) -> torch.Tensor:
    """`W x + b + Σ (P ⊙ Θ) x` over the given adapters, on the first path whose preconditions hold: in place (if
    `inplace` is wanted), direct, general (see the module docstring). Extra arguments go to the base layer."""
    if frozen.direct_refusal(*args, **kwargs) is None:  # each precondition is evaluated once per call
        inplace = inplace and frozen.write_refusal() is None
        return _linear(frozen, x, placements, deltas, inplace)
    result = frozen.module(x, *args, **kwargs)
    for placement, delta in zip(placements, deltas, strict=True):
        result = result + bypass_alone(x, placement, out_features, delta).to(result.dtype)
    return result
