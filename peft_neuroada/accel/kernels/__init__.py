"""NeuroAda's three sparse products, each by the fastest backend available for its tensors.

For a weight (d_out, d_in) and n tuned neurons with k deltas at input columns `cols[i]` (output rows `rows[i]`, or
every row with `rows=None`): `sampled_grad`, the weight gradient at the placement (SDDMM); `bypass_forward`,
`(P ⊙ Θ) x` (SpMM); `bypass_input_grad`, its transpose. The bypass products add into `out=` in place (the base
layer's output or input gradient), which saves an addition. `entry_patch` patches a CPU weight's entries for the
in-place path, one threaded pass each way where torch's gather and scatter_ take two single-threaded ones.

`backend="auto"` takes the C kernels ("cpu") or Triton ("triton", CUDA) for float32/bfloat16/float16 tensors, else
the torch ops: also while `torch.compile` traces, where the C kernels do not build, and for the input gradient under
deterministic algorithms (Triton's adds with atomics); rules measured in docs/design.md, "Compiled kernels". Every
backend reads any strides and int16/32/64 indices, accumulates in float32 and keeps no state (thread-safe); a
neuron's k columns must be distinct.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ...tuner import products as torch_ops
from . import cpu, triton_ops

Backend = Literal["auto", "cpu", "triton", "torch"]
BACKENDS = ("cpu", "triton", "torch")
_MODULES = {"cpu": cpu, "triton": triton_ops, "torch": torch_ops}
INDEX_DTYPES = tuple(cpu.INDEX_CODES)

__all__ = [
    "BACKENDS",
    "available_backends",
    "bypass_forward",
    "bypass_input_grad",
    "choose_backend",
    "entry_patch",
    "patches_entries",
    "sampled_grad",
]


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The backends that can run on `device` here (the C kernels are built on first call)."""
    name = {"cpu": "cpu", "cuda": "triton"}.get(torch.device(device).type)
    return [name, "torch"] if name and _MODULES[name].available() else ["torch"]


def _compiled_dtypes(values: tuple[Tensor, ...]) -> bool:
    return all(t.dtype in cpu.DTYPE_CODES for t in values)


def choose_backend(op: str, *values: Tensor) -> str:
    """The backend `backend="auto"` uses for `op` on these value tensors (see the module docstring)."""
    device = values[0].device.type
    if torch.compiler.is_compiling() or not _compiled_dtypes(values):
        return "torch"
    if device == "cpu" and cpu.available():
        return "cpu"
    deterministic = op == "bypass_input_grad" and torch.are_deterministic_algorithms_enabled()
    return "triton" if device == "cuda" and not deterministic and triton_ops.available() else "torch"


def _check(op: str, cols: Tensor, rows, d_out: int, values: dict[str, Tensor], out=None, out_shape=None) -> None:
    """Refuse, before anything runs, what no backend computes correctly (the C kernels use raw pointers)."""
    for name, t in values.items():
        if t.dim() != 2 or t.device != cols.device or not t.is_floating_point():
            raise (ValueError if t.is_floating_point() else TypeError)(
                f"{op}: {name} must be a 2-D floating tensor on cols' device {cols.device}, got {t.dtype} "
                f"{tuple(t.shape)} on {t.device}"
            )
    if cols.dim() != 2 or cols.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: cols must be an (n, k) int16/32/64 tensor, got {cols.dtype} {tuple(cols.shape)}")
    if rows is None and cols.shape[0] != d_out:
        raise ValueError(f"{op}: rows=None means every neuron, but cols has {cols.shape[0]} rows for {d_out} outputs")
    if rows is not None and not (rows.dim() == 1 and rows.dtype in INDEX_DTYPES and rows.shape == cols.shape[:1]):
        raise ValueError(f"{op}: rows must be (n,) int16/32/64, n = {len(cols)}, got {rows.dtype} {tuple(rows.shape)}")
    if rows is not None and rows.device != cols.device:
        raise ValueError(f"{op}: rows is on {rows.device} but cols is on {cols.device}")
    if "delta" in values and values["delta"].shape != cols.shape:
        raise ValueError(f"{op}: delta {tuple(values['delta'].shape)} and cols {tuple(cols.shape)} differ in shape")
    if out is None:
        return
    if tuple(out.shape) != out_shape or out.device != cols.device or not out.is_floating_point():
        raise ValueError(f"{op}: out must be a floating {out_shape} tensor on {cols.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")  # fmt: skip
    # (an empty storage has no memory: its address is 0, the same as every other empty one's)
    address = out.untyped_storage().data_ptr()
    if address and any(t.untyped_storage().data_ptr() == address for t in values.values()):
        raise ValueError(f"{op}: out shares memory with an input; pass a separate tensor")


def _module(op: str, backend: Backend, *values: Tensor):
    name = choose_backend(op, *values) if backend == "auto" else backend
    if name not in _MODULES:
        raise ValueError(f"unknown backend {backend!r}; choose 'auto' or one of {BACKENDS}")
    return _MODULES[name]


def sampled_grad(
    x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None = None, *, backend: Backend = "auto"
) -> Tensor:
    """`(grad2d.T @ x2d)[rows[i], cols[i, j]]` as an (n, k) float32 tensor, without forming the product."""
    _check("sampled_grad", cols, rows, grad2d.shape[1], {"x2d": x2d, "grad2d": grad2d})
    if x2d.shape[0] != grad2d.shape[0]:
        raise ValueError(f"sampled_grad: x2d has {x2d.shape[0]} tokens but grad2d has {grad2d.shape[0]}")
    if cols.numel() == 0 or x2d.shape[0] == 0:
        return torch.zeros(cols.shape, dtype=torch.float32, device=x2d.device)
    return _module("sampled_grad", backend, x2d, grad2d).sampled_grad(x2d, grad2d, cols, rows)


def bypass_forward(
    x2d: Tensor,
    cols: Tensor,
    rows: Tensor | None,
    delta: Tensor,
    d_out: int,
    *,
    out: Tensor | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """`y[t, rows[i]] = sum_j x2d[t, cols[i, j]] * delta[i, j]`, (T, d_out) in x2d's dtype, zero elsewhere."""
    _check("bypass_forward", cols, rows, d_out, {"x2d": x2d, "delta": delta}, out, (x2d.shape[0], d_out))
    return _bypass("bypass_forward", backend, (x2d if out is None else out).dtype, out, x2d, cols, rows, delta, d_out)


def bypass_input_grad(
    grad2d: Tensor,
    cols: Tensor,
    rows: Tensor | None,
    delta: Tensor,
    d_in: int,
    dtype: torch.dtype | None = None,
    *,
    out: Tensor | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """`gx[t, c] = sum over cols[i, j] == c of grad2d[t, rows[i]] * delta[i, j]`, (T, d_in) in `dtype` (default:
    out's, else grad2d's)."""
    values = {"grad2d": grad2d, "delta": delta}
    _check("bypass_input_grad", cols, rows, grad2d.shape[1], values, out, (grad2d.shape[0], d_in))
    if out is not None and dtype not in (None, out.dtype):
        raise ValueError(f"bypass_input_grad: dtype {dtype} differs from out's {out.dtype}")
    dtype = (grad2d if out is None else out).dtype if dtype is None else dtype
    return _bypass("bypass_input_grad", backend, dtype, out, grad2d, cols, rows, delta, d_in, dtype)


def _bypass(op: str, backend: Backend, dtype, out, source: Tensor, cols, rows, delta: Tensor, *args) -> Tensor:
    """No entry or no token: zeros (or `out`) before any backend runs; with `out`, the product is added into it."""
    if cols.numel() == 0 or source.shape[0] == 0:
        return source.new_zeros(source.shape[0], args[0], dtype=dtype) if out is None else out
    probe = torch.empty(0, dtype=dtype, device=source.device)  # the output's dtype must be supported too
    compute = getattr(_module(op, backend, source, delta, probe), op)
    if out is not None and out.stride(1) != 1:  # the kernels add into rows of unit feature stride
        return out.add_(compute(source, cols, rows, delta, *args))
    return compute(source, cols, rows, delta, *args, out)


def patches_entries(weight: Tensor, delta: Tensor) -> bool:
    """Whether `entry_patch` serves here; the in-place path uses torch's gather and scatter_ otherwise."""
    on_cpu = weight.device.type == delta.device.type == "cpu"
    return on_cpu and _compiled_dtypes((weight, delta)) and not torch.compiler.is_compiling() and cpu.available()


def entry_patch(weight: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor) -> cpu.EntryPatch:
    """`cpu.EntryPatch`: `weight[rows[i], cols[i, j]] += delta[i, j]` (`.apply()`) and its exact undo (`.restore()`).
    Whatever the C kernels would write out of bounds is refused before any write: here, or a bad column by `.apply()`.
    Visits of one weight must not run concurrently."""
    _check("entry_patch", cols, rows, weight.shape[0], {"weight": weight, "delta": delta})
    if not (weight.device.type == delta.device.type == "cpu" and _compiled_dtypes((weight, delta))):
        raise TypeError("entry_patch: weight and delta must be float32/bfloat16/float16 CPU tensors")
    return cpu.EntryPatch(weight, cols, rows, delta)
