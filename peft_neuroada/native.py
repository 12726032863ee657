"""Fused CPU kernels (csrc/neuroada_cpu.c), compiled on first use and loaded with ctypes.

torch offers no fused primitive for NeuroAda's two hot spots on CPU: reading and updating k scattered entries per
weight row (gather + add + scatter are three passes), and the sampled product `sum_t g[t, i] x[t, cols[i, j]]`
(`sparse.sampled_addmm` copies both dense inputs first; gathers build a tokens x n x k tensor). The C kernels do each
in one pass. They are compiled once per source version with the system C compiler (`$CC`, else `cc`) into
`$PEFT_NEUROADA_CACHE/kernels` (default `~/.cache/peft_neuroada/kernels`); without a compiler, or with
`PEFT_NEUROADA_NATIVE=0`, everything runs on torch ops, with the same results up to float rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("csrc") / "neuroada_cpu.c"
# Flags tried in order: with OpenMP (threads shared with torch's own runtime), then single-threaded.
_FLAG_SETS = (["-O3", "-fPIC", "-shared", "-fopenmp"], ["-O3", "-fPIC", "-shared"])
# A token block's transposed input slice should stay in a core's L2 cache.
_BLOCK_BYTES = 1 << 18


def _cache_dir() -> Path:
    root = Path(os.environ.get("PEFT_NEUROADA_CACHE", Path.home() / ".cache" / "peft_neuroada"))
    return root / "kernels"


def _compile(source: Path, target: Path) -> str | None:
    """Compile `source` into the shared library `target` (atomically); return the compiler's complaint on failure."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return f"no C compiler '{compiler}' on PATH"
    target.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for flags in _FLAG_SETS:
        with tempfile.TemporaryDirectory(dir=target.parent) as staging:
            built = Path(staging) / target.name
            run = subprocess.run([compiler, *flags, str(source), "-o", str(built)], capture_output=True, text=True)
            if run.returncode == 0:
                os.replace(built, target)
                return None
            error = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit code {run.returncode}"
    return error


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one warning saying why) when they cannot be built here."""
    if os.environ.get("PEFT_NEUROADA_NATIVE", "1") == "0":
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + platform.machine().encode() + os.environ.get("CC", "cc").encode()).hexdigest()
    target = _cache_dir() / f"neuroada_cpu_{key[:16]}.so"
    if not target.exists():
        error = _compile(_SOURCE, target)
        if error is not None:
            warnings.warn(
                f"peft_neuroada: could not build its CPU kernels ({error}); training on CPU uses slower torch ops. "
                "Install a C compiler (e.g. gcc) to speed it up, or set PEFT_NEUROADA_NATIVE=0 to silence this.",
                stacklevel=2,
            )
            return None
    lib = ctypes.CDLL(str(target))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.neuroada_add_deltas.argtypes = [pointer, size, size, pointer, pointer, pointer, pointer, size, size]
    lib.neuroada_write_entries.argtypes = [pointer, size, size, pointer, pointer, pointer, size, size]
    lib.neuroada_sampled_grad.argtypes = [
        *(pointer, size, size, pointer, size, pointer, pointer, pointer, size, size, size, size, pointer, pointer)
    ]
    return lib


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels apply: float32 CPU tensors, outside torch.compile, and the kernels could be built."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not torch.compiler.is_compiling()
        and library() is not None
    )


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _int32(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(torch.int32).contiguous()


def add_deltas_(
    weight: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor
) -> torch.Tensor:
    """`weight[row_i, cols[i, j]] += delta[i, j]` in place (any strides); returns the overwritten entries (n, k)."""
    cols, rows, delta = _int32(cols), _int32(rows), delta.detach().contiguous()
    originals = torch.empty(cols.shape, dtype=weight.dtype)
    library().neuroada_add_deltas(
        _address(weight), weight.stride(0), weight.stride(1), _address(rows), _address(cols), _address(delta),
        _address(originals), *cols.shape,
    )  # fmt: skip
    return originals


def write_entries_(weight: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> None:
    """`weight[row_i, cols[i, j]] = values[i, j]` in place (any strides)."""
    cols, rows, values = _int32(cols), _int32(rows), values.contiguous()
    library().neuroada_write_entries(
        _address(weight), weight.stride(0), weight.stride(1), _address(rows), _address(cols), _address(values),
        *cols.shape,
    )  # fmt: skip


def sampled_weight_grad(
    x2d: torch.Tensor, grad2d: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """`(grad2d.T @ x2d)[row_i, cols[i, j]]` as an (n, k) float32 tensor, without forming the product."""
    x2d = x2d if x2d.stride(1) == 1 else x2d.contiguous()
    grad2d = grad2d if grad2d.stride(1) == 1 else grad2d.contiguous()
    cols, rows = _int32(cols), _int32(rows)
    (tokens, d_in), (n, k) = x2d.shape, cols.shape
    block = max(8, min(256, _BLOCK_BYTES // (4 * d_in)) // 8 * 8)
    out = torch.empty(n, k, dtype=torch.float32)
    x_buffer, g_buffer = torch.empty(d_in * block), torch.empty(n * block)
    library().neuroada_sampled_grad(
        _address(x2d), x2d.stride(0), d_in, _address(grad2d), grad2d.stride(0), _address(rows), _address(cols),
        _address(out), n, k, tokens, block, _address(x_buffer), _address(g_buffer),
    )  # fmt: skip
    return out
