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


def return_freed_memory_to_os() -> None:
    """Make glibc mmap blocks >= 64 KiB and trim the heap on free, so RSS follows live tensors (not glibc caches)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 0)


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
