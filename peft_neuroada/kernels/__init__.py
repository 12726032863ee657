"""NeuroAda's three sparse products, each computed by the fastest backend available for its tensors.

For a layer with weight (d_out, d_in) and n tuned neurons, each with k trainable deltas at input columns
`cols[i]` (`rows[i]` the neuron's output row; `rows=None` means every neuron, rows = arange(d_out)):

* `sampled_grad(x2d, grad2d, cols, rows)`: the dense weight gradient `grad2d.T @ x2d` at the placement, (n, k)
  float32: `out[i, j] = sum_t grad2d[t, rows[i]] * x2d[t, cols[i, j]]` (SDDMM).
* `bypass_forward(x2d, cols, rows, delta, d_out)`: `(P ⊙ Θ) x`, (T, d_out) in x's dtype, zero at untuned rows (SpMM).
* `bypass_input_grad(grad2d, cols, rows, delta, d_in, dtype)`: its transpose, (T, d_in) in `dtype`; duplicated
  columns across neurons sum.

And for the in-place path of `functional.py`, on CPU weights with the C kernels built (`patches_entries`):
`entry_patch` adds the deltas into the selected entries of the weight, keeping the overwritten ones, and writes those
back: one pass each over the (cold) weight's entries, split across threads, where torch's gather and scatter_ take
two single-threaded passes (a k=20 SmolLM2 step: 1.16x -> 1.08x of the frozen model's, docs/performance-history.md).

The two bypass products take `out=`: the product is then added into that tensor in place (the base layer's output
or input gradient), which saves the separate addition. A neuron's k columns must be distinct (as placements are):
the torch fallback's sparse kernels assume it.

Backends (`BACKENDS`): "cpu" (the compiled C kernels, `cpu.py`), "triton" (CUDA), "torch" (plain ops, the reference
and the fallback everywhere). `backend="auto"` picks, by rules measured in docs/design.md ("Compiled kernels"):

* while `torch.compile` traces: torch (the others are opaque calls it cannot trace);
* CPU tensors of float32/bfloat16/float16: cpu, whenever the C kernels build here (no compiler: torch, logged once).
  They beat or tie the torch ops on every measured shape, k and token count, from decoding (T = 1) to training;
* CUDA tensors of those dtypes with triton installed: triton, except the input gradient under
  `torch.use_deterministic_algorithms` (triton's uses float32 atomics): torch;
* anything else (float64, other devices): torch.

Every product accumulates in float32, reads inputs of any strides, takes int16, int32 or int64 indices (layers keep
int16 columns, see index_storage.py), and is a plain function of its arguments (no autograd, no state): safe to call
from several threads at once. With no entry or no token the answer is zeros (or `out` as given), before any backend
runs.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import cpu, torch_ops, triton_ops

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
    device = torch.device(device)
    found = ["torch"]
    if device.type == "cpu" and cpu.available():
        found.insert(0, "cpu")
    if device.type == "cuda" and triton_ops.available():
        found.insert(0, "triton")
    return found


def _compiled_dtypes(values: tuple[torch.Tensor, ...]) -> bool:
    """float32/bfloat16/float16: what the C and Triton kernels read. They compute in float32, so float64 goes to the
    torch ops rather than losing precision."""
    return all(t.dtype in cpu.DTYPE_CODES for t in values)


def choose_backend(op: str, *values: torch.Tensor) -> str:
    """The backend `backend="auto"` uses for `op` on these value tensors (see the module docstring)."""
    device = values[0].device.type
    if torch.compiler.is_compiling():
        return "torch"
    if device == "cpu" and _compiled_dtypes(values) and cpu.available():
        return "cpu"
    if device == "cuda" and _compiled_dtypes(values) and triton_ops.available():
        deterministic = op == "bypass_input_grad" and torch.are_deterministic_algorithms_enabled()
        return "torch" if deterministic else "triton"
    return "torch"


def _validate(
    op: str, cols: torch.Tensor, rows: torch.Tensor | None, d_out: int, values: dict[str, torch.Tensor]
) -> None:
    """Refuse what no backend computes correctly, before anything runs."""
    for name, t in values.items():
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.device != cols.device:
            raise ValueError(f"{op}: {name} is on {t.device} but cols is on {cols.device}")
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
    if cols.dim() != 2 or cols.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: cols must be an (n, k) int16/32/64 tensor, got {cols.dtype} {tuple(cols.shape)}")
    if rows is None:
        if cols.shape[0] != d_out:
            raise ValueError(f"{op}: rows=None means every neuron is tuned, but cols has {cols.shape[0]} rows "
                             f"for {d_out} outputs")  # fmt: skip
    elif rows.dim() != 1 or rows.dtype not in INDEX_DTYPES or rows.shape[0] != cols.shape[0]:
        raise ValueError(f"{op}: rows must be an (n,) int16/32/64 tensor matching cols {tuple(cols.shape)}, "
                         f"got {rows.dtype} {tuple(rows.shape)}")  # fmt: skip
    elif rows.device != cols.device:
        raise ValueError(f"{op}: rows is on {rows.device} but cols is on {cols.device}")
    if "delta" in values and values["delta"].shape != cols.shape:
        raise ValueError(f"{op}: delta {tuple(values['delta'].shape)} and cols {tuple(cols.shape)} differ in shape")


def _module(op: str, backend: Backend, *values: torch.Tensor):
    name = choose_backend(op, *values) if backend == "auto" else backend
    if name not in _MODULES:
        raise ValueError(f"unknown backend {backend!r}; choose 'auto' or one of {BACKENDS}")
    return _MODULES[name]


def sampled_grad(
    x2d: torch.Tensor,
    grad2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """`(grad2d.T @ x2d)[rows[i], cols[i, j]]` as an (n, k) float32 tensor, without forming the product."""
    _validate("sampled_grad", cols, rows, grad2d.shape[1], {"x2d": x2d, "grad2d": grad2d})
    if x2d.shape[0] != grad2d.shape[0]:
        raise ValueError(f"sampled_grad: x2d has {x2d.shape[0]} tokens but grad2d has {grad2d.shape[0]}")
    if cols.numel() == 0 or x2d.shape[0] == 0:
        return torch.zeros(cols.shape, dtype=torch.float32, device=x2d.device)
    return _module("sampled_grad", backend, x2d, grad2d).sampled_grad(x2d, grad2d, cols, rows)


def _check_out(op: str, out: torch.Tensor, shape: tuple[int, int], *inputs: torch.Tensor) -> None:
    """`out` must have the product's shape and device, and must not share memory with an input it would overwrite
    while that input is still being read."""
    like = inputs[0]
    if tuple(out.shape) != shape or out.device != like.device or not out.is_floating_point():
        raise ValueError(f"{op}: out must be a floating {shape} tensor on {like.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")  # fmt: skip
    storage = out.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in inputs):
        raise ValueError(f"{op}: out shares memory with an input; pass a separate tensor")


def bypass_forward(
    x2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_out: int,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """`y[t, rows[i]] = sum_j x2d[t, cols[i, j]] * delta[i, j]`, (T, d_out) in x2d's dtype, zero elsewhere.

    With `out` (T, d_out), the product is added into it in place (untuned outputs untouched) and `out` returned:
    `bypass_forward(x, ..., out=base(x))` saves the separate addition (0.05 of a matmul at 576 -> 1536)."""
    _validate("bypass_forward", cols, rows, d_out, {"x2d": x2d, "delta": delta})
    if out is not None:
        _check_out("bypass_forward", out, (x2d.shape[0], d_out), x2d, delta)
    if cols.numel() == 0 or x2d.shape[0] == 0:
        return x2d.new_zeros(x2d.shape[0], d_out) if out is None else out
    module = _module("bypass_forward", backend, x2d, delta, *([] if out is None else [out]))
    if out is None:
        return module.bypass_forward(x2d, cols, rows, delta, d_out)
    if out.stride(1) != 1:  # the kernels add into rows of unit feature stride
        return out.add_(module.bypass_forward(x2d, cols, rows, delta, d_out))
    return module.bypass_forward(x2d, cols, rows, delta, d_out, out)


def bypass_input_grad(
    grad2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_in: int,
    dtype: torch.dtype | None = None,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """`gx[t, c] = sum over cols[i, j] == c of grad2d[t, rows[i]] * delta[i, j]`, (T, d_in) in `dtype` (default:
    grad2d's, or out's).

    With `out` (T, d_in), the product is added into it in place and `out` returned (e.g. into `grad @ W`)."""
    _validate("bypass_input_grad", cols, rows, grad2d.shape[1], {"grad2d": grad2d, "delta": delta})
    if out is not None:
        _check_out("bypass_input_grad", out, (grad2d.shape[0], d_in), grad2d, delta)
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"bypass_input_grad: dtype {dtype} differs from out's {out.dtype}")
        dtype = out.dtype
    dtype = grad2d.dtype if dtype is None else dtype
    if cols.numel() == 0 or grad2d.shape[0] == 0:
        return grad2d.new_zeros(grad2d.shape[0], d_in, dtype=dtype) if out is None else out
    probe = torch.empty(0, dtype=dtype, device=grad2d.device)  # the output's dtype must be supported too
    module = _module("bypass_input_grad", backend, grad2d, delta, probe)
    if out is not None and out.stride(1) != 1:
        return out.add_(module.bypass_input_grad(grad2d, cols, rows, delta, d_in, dtype))
    return module.bypass_input_grad(grad2d, cols, rows, delta, d_in, dtype, out)


def patches_entries(weight: torch.Tensor, delta: torch.Tensor) -> bool:
    """Whether `entry_patch` (the C kernels) handles this weight and these deltas: float32, bfloat16 or float16 CPU
    tensors in eager mode, with the C kernels built here. The in-place path uses torch's gather/scatter_ otherwise."""
    return (
        weight.device.type == delta.device.type == "cpu"
        and _compiled_dtypes((weight, delta))
        and not torch.compiler.is_compiling()
        and cpu.available()
    )


# Prepared entry patches by `cpu.patch_facts`; emptied when full (a model's layers take one entry per adapter).
_PREPARED: dict[tuple, cpu.EntryPatch] = {}
_PREPARED_MAX = 4096


def entry_patch(weight: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor):
    """`weight[rows[i], cols[i, j]] += delta[i, j]` in place (`.apply()`) and its exact undo (`.restore()`), by the C
    kernels (`cpu.EntryPatch`). The kernels write through raw pointers, so anything they would read or write out of
    bounds is refused here, before anything runs (a column outside the weight: by `.apply()`, before it writes).

    A layer's visits hand the same tensors here again and again, so the prepared patch is kept and handed out again
    for tensors with the same `cpu.patch_facts` (what its calls depend on, the memory addresses included): checking
    those costs a few microseconds where preparing costs tens in a model. A patch still in use (not restored) is
    never handed out twice. Visits of one weight must not run concurrently (`functional` holds the weight's lock)."""
    facts = cpu.patch_facts(weight, cols, rows, delta)
    patch = _PREPARED.get(facts)
    if patch is None or patch.in_use:
        _validate("entry_patch", cols, rows, weight.shape[0], {"weight": weight, "delta": delta})
        if not (weight.device.type == delta.device.type == "cpu" and _compiled_dtypes((weight, delta))):
            raise TypeError("entry_patch: weight and delta must be float32/bfloat16/float16 CPU tensors (see "
                            "patches_entries)")  # fmt: skip
        patch = cpu.EntryPatch(weight, cols, rows, delta)
        if patch.reusable:
            if len(_PREPARED) >= _PREPARED_MAX:
                _PREPARED.clear()
            _PREPARED[facts] = patch
    return patch.hold(weight, cols, rows, delta)
