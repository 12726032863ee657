"""The C kernels of `neuroada_cpu.c`: built on first use with the system C compiler, cached, called through ctypes.

Why plain C and ctypes rather than a torch C++ extension: the kernels need no torch headers, so a build takes about a
second instead of a minute (the test suite builds them afresh on every clean CI machine), and ctypes releases the
GIL for the duration of each call. The library is compiled with `-march=native` for the machine it runs on, so the
cache key covers the source, the compiler and the CPU's feature flags: a cache shared between machines (a network
home directory) never hands a binary to a CPU it was not built for.

No compiler, a failed build or a library that does not load is not an error: `library()` returns None (logged once)
and the dispatcher uses the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..atomic_file import write_atomically
from ..cache import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("neuroada_cpu.c")
# The source as this module was imported with it: the library is built from (and cached by) this text, so it always
# matches the argument types `_declare` gives its functions, also if the file changes while a process runs (an
# editable install being edited). None where the file is missing (a stripped install): the torch ops serve then.
try:
    SOURCE_TEXT: str | None = SOURCE.read_text()
except OSError:
    SOURCE_TEXT = None
FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread")
# Tried first, each dropped when the compiler refuses it: OpenMP, so that the kernels run on the OpenMP team torch
# uses (libgomp is matched by its soname when the library loads into a torch process: no second pool of threads
# competing with torch's spinning workers), and -march=native (unknown to some Apple clang versions).
OPTIONAL_FLAGS = (("-fopenmp",), ("-march=native",))
# Tokens per packed block: x^T of a block (d_in x 80 floats) stays in L2 for every SmolLM2 and 0.55B shape; 32 and
# 128 measured within a few percent of it on all of them (docs/performance.md, "Compiled kernels").
TOKEN_BLOCK = 64
# The forward gathers each neuron's inputs straight from the token's row (no transposes) at k = 1: 0.5-0.8x the
# time of the transposed layout there for float32; from k = 2 on the transposed layout wins. It converts
# half-precision rows element by element, which made it 2.2-3.6x slower than the transposed layout in bfloat16
# (docs/performance.md, eleventh round): float32 only.
FORWARD_LAYOUTS = {"dot": 0, "gather": 1}
FORWARD_GATHER_MAX_K = 1

# The delta gradient's layouts (neuroada_cpu.c). The gather layout depends on how fast the CPU gathers: on an
# AVX-512 Intel Xeon it took 0.6-0.85x the dot layout's time at k = 1 on SmolLM2's and 576 x 1536 layers, with
# 16-token blocks whose rows stay in L1 (docs/performance.md, ninth round), and from k = 2 on it is even or slower;
# on an AMD EPYC it lost already at k = 1 (fourth round, 1.2-1.3x). So at k = 1 each machine measures the two once
# (`gather_measured_faster`). It converts half-precision rows element by element: float32 inputs only.
SAMPLED_GRAD_LAYOUTS = {"dot": 0, "gather": 1}
SAMPLED_GRAD_GATHER_MAX_K = 1
GATHER_TOKEN_BLOCK = 16

# What the delta gradient's calling thread does per token block, in order (`sampled_grad(..., phases=)`): in the dot
# layout, x^T and grad^T are packed; in the gather layout, only rows that are not float32 are converted.
SAMPLED_GRAD_PHASES = ("packing x", "packing grad", "products")

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Index dtypes and their codes in the C kernels.
INDEX_CODES = {torch.int32: 0, torch.int64: 1, torch.int16: 2}
_STATUS = {
    1: "cols has an index outside [0, d_in)",
    2: "out of memory",
    3: "invalid sizes",
    4: "rows has an index outside [0, d_out)",
    5: "the entries are patched already (a nested visit of the same weight)",
}

_lock = threading.Lock()
_UNLOADED = object()
_library: ctypes.CDLL | None | object = _UNLOADED


def cache_dir() -> Path:
    """The `kernels` folder of the package's cache root (`$PEFT_NEUROADA_CACHE`, else `~/.cache/peft_neuroada`)."""
    return cache_root() / "kernels"


def compiler() -> str | None:
    """`$CC` if set (and found), else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("flags", "features", "model name", "cpu part", "isa")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip().lower() in wanted}))


def _library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE_TEXT, cc, version, repr((FLAGS, OPTIONAL_FLAGS)), _cpu_identity()]).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"neuroada_cpu-{key}.so"


def _optional_flag_choices() -> list[list[str]]:
    """The optional flags to build with, in the order tried: all of them, then every smaller combination, then none."""
    return [
        [flag for group in chosen for flag in group]
        for size in range(len(OPTIONAL_FLAGS), -1, -1)
        for chosen in itertools.combinations(OPTIONAL_FLAGS, size)
    ]


def _build(cc: str, target: Path) -> None:
    """Compile `SOURCE_TEXT` in a temporary folder beside the target and move the library into place: concurrent
    builds never see a partial file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        source, built = Path(folder) / SOURCE.name, Path(folder) / target.name
        source.write_text(SOURCE_TEXT)
        command = [cc, *FLAGS, str(source), "-o", str(built)]
        *preferred, plain = _optional_flag_choices()
        for extra in preferred:
            if subprocess.run([*command, *extra], capture_output=True, timeout=300).returncode == 0:
                break
        else:
            subprocess.run([*command, *plain], check=True, capture_output=True, timeout=300)
        os.replace(built, target)


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    matrix = [p, i64, i64, i]  # data, token stride, feature stride, dtype
    placement = [p, i, p, i]  # cols, index dtype, rows, index dtype
    sizes = [i64] * 5  # T, d_in, d_out, n, k
    lib.na_sampled_grad.argtypes = [*matrix, *matrix, *placement, *sizes, p, i, i64, i, p]
    lib.na_bypass_forward.argtypes = [*matrix, *placement, p, i, *sizes, p, i, i64, i, i, i64, i]
    lib.na_bypass_input_grad.argtypes = [*matrix, *placement, p, i, *sizes, p, i, i64, i, i64, i]
    weight = [p, i64, i64, i]  # data, row stride, column stride, element type
    lib.na_patch_entries.argtypes = [*weight, *placement, p, i, p, i64, i64, i64, i64, i]
    lib.na_restore_entries.argtypes = [*weight, *placement, p, i64, i64, i]
    products = (lib.na_sampled_grad, lib.na_bypass_forward, lib.na_bypass_input_grad)
    entries = (lib.na_patch_entries, lib.na_restore_entries)
    for fn in (*products, *entries, lib.na_vector_width, lib.na_uses_openmp):
        fn.restype = ctypes.c_int


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on first use; None (logged once) when that is not possible here.

    `CC` and `PEFT_NEUROADA_CACHE` are read at that first use: the library then serves the process (this is called
    several times per adapted layer and step, where reading the environment each time measurably costs)."""
    global _library
    if _library is _UNLOADED:
        with _lock:
            if _library is _UNLOADED:
                _library = _load(compiler())
    return _library


def _load(cc: str | None) -> ctypes.CDLL | None:
    if cc is None:
        logger.warning("peft-neuroada: no C compiler found (set CC); using the slower torch ops for sparse products")
        return None
    if SOURCE_TEXT is None:
        logger.warning("peft-neuroada: %s is missing; using the slower torch ops for sparse products", SOURCE)
        return None
    try:
        path = _library_path(cc)
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        return lib
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning(
            "peft-neuroada: could not build the C kernels with %s (%s %s); using the slower torch ops",
            cc,
            error,
            detail.decode(errors="replace")[-2000:],
        )
        return None


def available() -> bool:
    return library() is not None


def _matrix(t: torch.Tensor) -> list:
    return [t.data_ptr(), t.stride(0), t.stride(1), DTYPE_CODES[t.dtype]]


def _placement(cols: torch.Tensor, rows: torch.Tensor | None) -> tuple[list, torch.Tensor, torch.Tensor | None]:
    cols = cols.contiguous()
    rows = None if rows is None else rows.contiguous()
    args = [cols.data_ptr(), INDEX_CODES[cols.dtype]]
    args += [None, 0] if rows is None else [rows.data_ptr(), INDEX_CODES[rows.dtype]]
    return args, cols, rows  # the contiguous copies stay referenced until the call returns


def _check(status: int) -> None:
    if status:
        error = IndexError if status in (1, 4) else RuntimeError
        raise error(f"NeuroAda sparse product (C kernel): {_STATUS.get(status, status)}")


def _required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the NeuroAda C kernels are not available on this machine (no working C compiler)")
    return lib


def sampled_grad(
    x2d: torch.Tensor,
    grad2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    phases: dict[str, float] | None = None,
    layout: str | None = None,
) -> torch.Tensor:
    """`phases`, when given, receives the seconds the calling thread spent in each of `SAMPLED_GRAD_PHASES` (where a
    call's time goes: benchmarks/primitives.py). `layout` ("dot" or "gather", as tests and benchmarks ask for one)
    defaults to `sampled_grad_layout` for k and the inputs' dtypes."""
    lib = _required()
    n, k = cols.shape
    layout = layout or sampled_grad_layout(k, (x2d.dtype, grad2d.dtype))
    out = torch.empty(n, k, dtype=torch.float32)
    place, cols, rows = _placement(cols, rows)
    sizes = [x2d.shape[0], x2d.shape[1], grad2d.shape[1], n, k]
    seconds = (ctypes.c_double * len(SAMPLED_GRAD_PHASES))() if phases is not None else None
    block = GATHER_TOKEN_BLOCK if layout == "gather" else TOKEN_BLOCK
    status = lib.na_sampled_grad(
        *_matrix(x2d), *_matrix(grad2d), *place, *sizes, out.data_ptr(), SAMPLED_GRAD_LAYOUTS[layout], block,
        torch.get_num_threads(), seconds,
    )  # fmt: skip
    _check(status)
    if phases is not None:
        phases.update(zip(SAMPLED_GRAD_PHASES, seconds, strict=True))
    return out


def sampled_grad_layout(k: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> str:
    """The delta gradient's faster layout for k columns per neuron and inputs of `dtypes` on this machine."""
    gather = k <= SAMPLED_GRAD_GATHER_MAX_K and all(dtype == torch.float32 for dtype in dtypes)
    return "gather" if gather and gather_measured_faster() else "dot"


def gather_measured_faster() -> bool:
    """Whether the gather layout beat the dot layout at k = 1 on this machine: measured once per library (SmolLM2's
    576 -> 576 shape, 512 tokens, the faster of five calls each) and recorded beside it, so that every process on the
    machine takes the same layout (the two round differently) and the measurement is not repeated."""
    lib = _required()
    known = vars(lib).get("gather_faster")  # (a plain getattr would look the name up as a C symbol)
    if known is None:
        record = Path(lib._name).with_suffix(".layout")
        try:
            known = record.read_text().split()[0] == "gather"
        except (OSError, IndexError):
            known, detail = _measure_gather()
            _write_quietly(record, f"{'gather' if known else 'dot'} ({detail})\n")
        lib.gather_faster = known
    return known


def _measure_gather() -> tuple[bool, str]:
    generator = torch.Generator().manual_seed(0)
    x, grad = torch.randn(512, 576, generator=generator), torch.randn(512, 576, generator=generator)
    cols = torch.randint(0, 576, (576, 1), generator=generator)
    seconds: dict[str, list[float]] = {layout: [] for layout in SAMPLED_GRAD_LAYOUTS}
    for _ in range(5):
        for layout, times in seconds.items():
            start = time.perf_counter()
            sampled_grad(x, grad, cols, None, layout=layout)
            times.append(time.perf_counter() - start)
    fastest = {layout: min(times) for layout, times in seconds.items()}
    detail = ", ".join(f"{layout} {t * 1e6:.0f} us" for layout, t in fastest.items())
    return fastest["gather"] < fastest["dot"], f"k=1, 512 x 576 -> 576, {torch.get_num_threads()} threads: {detail}"


def _write_quietly(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all; an unwritable cache only means the measurement is repeated in the
    next process."""
    try:
        write_atomically(path, lambda temporary: Path(temporary).write_text(text))
    except OSError:
        logger.debug("peft-neuroada: could not record the measured layout in %s", path)


def bypass_forward(
    x2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_out: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    lib = _required()
    n, k = cols.shape
    accumulate = out is not None
    out = torch.empty(x2d.shape[0], d_out, dtype=x2d.dtype) if out is None else out
    place, cols, rows = _placement(cols, rows)
    delta = delta.detach().contiguous()
    layout = FORWARD_LAYOUTS[bypass_forward_layout(k, (x2d.dtype, out.dtype))]
    sizes = [x2d.shape[0], x2d.shape[1], d_out, n, k]
    status = lib.na_bypass_forward(
        *_matrix(x2d), *place, delta.data_ptr(), DTYPE_CODES[delta.dtype], *sizes,
        out.data_ptr(), DTYPE_CODES[out.dtype], out.stride(0), accumulate, layout, TOKEN_BLOCK,
        torch.get_num_threads(),
    )  # fmt: skip
    _check(status)
    return out


def bypass_forward_layout(k: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> str:
    """The bypass forward's faster layout for k columns per neuron and input/output `dtypes`."""
    return "gather" if k <= FORWARD_GATHER_MAX_K and all(dtype == torch.float32 for dtype in dtypes) else "dot"


def bypass_input_grad(
    grad2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_in: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    lib = _required()
    n, k = cols.shape
    accumulate = out is not None
    out = torch.empty(grad2d.shape[0], d_in, dtype=dtype) if out is None else out
    place, cols, rows = _placement(cols, rows)
    delta = delta.detach().contiguous()
    sizes = [grad2d.shape[0], d_in, grad2d.shape[1], n, k]
    status = lib.na_bypass_input_grad(
        *_matrix(grad2d), *place, delta.data_ptr(), DTYPE_CODES[delta.dtype], *sizes,
        out.data_ptr(), DTYPE_CODES[out.dtype], out.stride(0), accumulate, TOKEN_BLOCK, torch.get_num_threads(),
    )  # fmt: skip
    _check(status)
    return out


class _PatchState(ctypes.Structure):
    """`patch_state` of neuroada_cpu.c: whether the entries are patched, and their saved values while they are."""

    _fields_ = [("applied", ctypes.c_int32), ("saved", ctypes.c_void_p)]


def patch_facts(weight: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor) -> tuple:
    """Everything an `EntryPatch`'s prepared calls depend on: memory addresses, shapes, strides, dtypes and devices of
    the tensors, and the thread count. Two sets of tensors with the same facts get identical prepared calls."""
    tensors = (weight, cols, delta) if rows is None else (weight, cols, delta, rows)
    return (*((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in tensors), torch.get_num_threads())


class EntryPatch:
    """`weight[rows[i], cols[i, j]] += delta[i, j]` (`apply`) and its exact undo (`restore`) for a (d_out, d_in)
    weight and deltas of float32, bfloat16 or float16 (the sum as torch's `w + delta.to(w.dtype)`), each one C call
    with its arguments prepared here once (they run on every visit of a layer, forward and backward, so the Python
    around them is a visible share of a k = 1 step).

    `apply` saves the overwritten entries and marks the patch applied right before writing; `restore` writes them
    back only when it is applied (and clears that), so calling it in a `finally`, also after an `apply` that never ran
    or failed its index check, restores exactly what was patched. The calls read the tensors' memory through raw
    addresses: the storages of the tensors given to `hold` are held from there until `restore` (should one of them be
    given another storage meanwhile), and contiguous copies made here are kept by the object. `reusable` tells whether
    the calls point into the given tensors themselves (no copies), i.e. stay valid for any tensors with the same
    `patch_facts`; such a patch keeps no reference to them between visits (a kept patch never keeps a model's
    deltas or indices alive)."""

    def __init__(self, weight: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor):
        lib = _required()
        n, k = cols.shape
        place, contiguous_cols, contiguous_rows = _placement(cols, rows)
        contiguous_delta = delta.detach().contiguous()
        self.reusable = (
            contiguous_cols is cols and contiguous_rows is rows and contiguous_delta.data_ptr() == delta.data_ptr()
        )
        self._copies = () if self.reusable else (contiguous_cols, contiguous_rows, contiguous_delta)
        self._state = _PatchState()
        self._held: tuple[torch.UntypedStorage, ...] = ()
        self.in_use = False
        at = [weight.data_ptr(), weight.stride(0), weight.stride(1), DTYPE_CODES[weight.dtype], *place]
        state, workers = ctypes.addressof(self._state), torch.get_num_threads()
        self._apply = functools.partial(
            lib.na_patch_entries, *at, contiguous_delta.data_ptr(), DTYPE_CODES[delta.dtype], state, weight.shape[1],
            weight.shape[0], n, k, workers,
        )  # fmt: skip
        self._restore = functools.partial(lib.na_restore_entries, *at, state, n, k, workers)

    def hold(self, *tensors: torch.Tensor | None) -> EntryPatch:
        """Keep the storages of `tensors` (the ones the calls read and write) alive until `restore` and mark the patch
        in use; returns the patch."""
        self._held = tuple(t.untyped_storage() for t in tensors if t is not None)
        self.in_use = True
        return self

    def apply(self) -> None:
        _check(self._apply())

    def restore(self) -> None:
        self._restore()
        self._held = ()
        self.in_use = False
