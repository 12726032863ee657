"""The weight lock of the in-place path: every visit to a layer's weight holds it, and `os.fork` waits for the visits
in flight (the fork handlers are registered with the first lock, not at import)."""

from __future__ import annotations

import os
import threading
import weakref

import torch

from ..tuner.layer import NeuroAdaLayer


class WeightLock:
    """Serialises every visit to one layer's weight: the threads' (a reentrant lock) and, on CUDA, the streams they
    queue work on (a visit on another stream than the last waits for it). A copy or pickle gets a new lock."""

    __slots__ = ("_lock", "_stream", "device", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._stream: torch.cuda.Stream | None = None
        self.device: torch.device | None = None
        with _LOCKS_GUARD:
            _register_fork_handlers_once()
            _LOCKS.add(self)

    def __reduce__(self) -> tuple:
        return (WeightLock, ())

    def on(self, device: torch.device) -> WeightLock:
        self.device = device
        return self

    def __enter__(self) -> WeightLock:
        self._lock.acquire()
        try:
            if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                stream, last = torch.cuda.current_stream(self.device), self._stream
                if last is not None and last != stream:
                    stream.wait_stream(last)
                self._stream = stream
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._lock.release()


class LayerRuntime:
    """What a layer keeps for the process it runs in: its weight's lock. Copies and pickles of the layer start with a
    fresh one: nothing of it is saved or shared."""

    def __init__(self) -> None:
        self.lock = WeightLock()

    def __reduce__(self) -> tuple:
        return (LayerRuntime, ())


def weight_lock(layer: NeuroAdaLayer) -> WeightLock:
    """The layer's lock (`dict.setdefault` is atomic: two threads get the same one). Wrappers of one module's several
    parameters (nested `ParamWrapper`s) share the innermost one's: a visit of the outer one runs the inner one's, and
    one reentrant lock cannot be taken in two orders."""
    while isinstance(layer.base_layer, NeuroAdaLayer):
        layer = layer.base_layer
    runtime = vars(layer).get("_runtime")
    if runtime is None:
        runtime = vars(layer).setdefault("_runtime", LayerRuntime())
    return runtime.lock


# Every live weight lock, for `os.fork` alone (a process-global set because a fork is process-global).
_LOCKS: weakref.WeakSet[WeightLock] = weakref.WeakSet()
_LOCKS_GUARD = threading.Lock()
_HELD_FOR_FORK: list[WeightLock] = []
_FORK_HANDLERS: list[bool] = []


def _register_fork_handlers_once() -> None:
    if not _FORK_HANDLERS:
        os.register_at_fork(
            before=_hold_weights_for_fork,
            after_in_parent=_release_weights_after_fork,
            after_in_child=_release_weights_after_fork,
        )
        _FORK_HANDLERS.append(True)


def _hold_weights_for_fork() -> None:
    """Before `os.fork`: wait for the visits in flight and hold every weight lock (and the guard, so no lock is made
    meanwhile) through the fork, so the child, which has only the forking thread, starts with every weight restored
    and every lock free. Layers make their locks when built, never in a visit: none waits for the guard holding one."""
    _LOCKS_GUARD.acquire()
    for lock in list(_LOCKS):
        lock._lock.acquire()
        _HELD_FOR_FORK.append(lock)


def _release_weights_after_fork() -> None:
    for lock in _HELD_FOR_FORK:
        lock._lock.release()
    _HELD_FOR_FORK.clear()
    _LOCKS_GUARD.release()
