"""Memory meters: the process's RSS and its peak, and the bytes autograd keeps for backward."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import torch
from torch import nn

MIB = 2**20


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_bytes() -> int:
    return _proc_status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _proc_status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS (Linux >= 4.0) so the peak covers training only, not loading."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def fault_in(model: nn.Module) -> None:
    """Read every weight once, so that weights mapped from their file (safetensors loads through mmap: SmolLM2 in
    float32) are in RSS before the baseline is taken; otherwise the first step faults them in and every variant's
    growth counts the weights too (500 MiB of SmolLM2's)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and tensor.numel():
                tensor.sum()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _set_glibc_thresholds(mmap_threshold: int, trim_threshold: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)


def return_freed_memory_to_os() -> None:
    """Make glibc mmap blocks >= 64 KiB and trim the heap on free, so RSS follows live tensors (not glibc caches)."""
    _set_glibc_thresholds(64 * 1024, 0)


def keep_freed_memory() -> None:
    """Make glibc keep freed memory for reuse (no blocks of its own mapping, no trimming), as jemalloc, tcmalloc or
    CUDA's caching allocator do: a step then re-uses the pages of the step before instead of faulting in new ones."""
    _set_glibc_thresholds(2**30, 2**31 - 1)


def _storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    if tensor.layout == torch.sparse_coo:
        yield from (t.untyped_storage() for t in (tensor._indices(), tensor._values()))
    elif tensor.layout == torch.sparse_csr:
        yield from (t.untyped_storage() for t in (tensor.crow_indices(), tensor.col_indices(), tensor.values()))
    elif tensor.layout == torch.strided:
        yield tensor.untyped_storage()


class SavedTensorMeter:
    """Bytes autograd keeps for backward: each storage counted once; the model's own parameters/buffers excluded."""

    def __init__(self, model: nn.Module) -> None:
        self.exclude = {s.data_ptr() for t in [*model.parameters(), *model.buffers()] for s in _storages(t)}
        self.sizes: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for storage in _storages(tensor):
            if storage.data_ptr() not in self.exclude:
                self.sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
