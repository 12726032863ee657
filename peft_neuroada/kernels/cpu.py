"""The C kernels of `neuroada_cpu.c`: built on first use with the system C compiler, cached, called through ctypes.

Why plain C and ctypes rather than a torch C++ extension: the kernels need no torch headers, so a build takes about a
second instead of a minute (the test suite builds them afresh on every clean CI machine), and ctypes releases the
GIL for the duration of each call. The library is compiled with `-march=native` for the machine it runs on, so the
cache key covers the source, the compiler and the CPU's feature flags: a cache shared between machines (a network
home directory) never hands a binary to a CPU it was not built for.

What lies in the cache is untrusted input (a full disk, a killed process or a shared home folder can leave anything
there), and a compiler can be broken, so a library serves a process only after two checks:

* before it is loaded, its bytes must have the size and sha256 recorded beside it (`.sha256`, written once the
  library is in place): `dlopen` of a truncated library kills the process. A missing or unreadable record, or any
  other content, means the library is not loaded but rebuilt;
* once loaded, every product and the entry patch must agree with the torch ops on small random inputs (`_self_test`,
  a few milliseconds once per process): a library that loads but computes wrong numbers is never used.

A cached library that fails either check is rebuilt, at most once per process; a new build is loaded and self-tested
in its build folder and only then moved into the cache. The record may hold any bytes: anything but a valid record
means building again. No compiler, no cache folder (no
`$PEFT_NEUROADA_CACHE` and no home folder), a failed build or a library that fails its checks is not an error:
`library()` returns None (one warning saying what failed and what to do) and the dispatcher uses the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..atomic_file import write_atomically
from ..cache import cache_root
from . import torch_ops

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
# 128 measured within a few percent of it on all of them (docs/design.md, "Compiled kernels").
TOKEN_BLOCK = 64
# Both the forward and the delta gradient have two layouts (neuroada_cpu.c): "dot" (transposed, packed blocks) and
# "gather" (each neuron's inputs gathered straight from the token's row, no transposes). One rule picks for both
# (`layout_for`): gather at k = 1 for float32, dot otherwise. The forward's gather layout takes 0.5-0.8x the time
# at k = 1 in float32; both convert half-precision rows element by element (the forward 2.2-3.6x slower in
# bfloat16), and from k = 2 on the dot layout wins. The delta gradient's gather speed depends on the CPU (0.6-0.85x
# on an AVX-512 Xeon, 1.2-1.3x on an AMD EPYC), either way under 1% of a SmolLM2 training step
# (docs/performance-history.md, ninth round), so the fixed rule, the same on every machine (the two layouts round
# differently), serves there too.
FORWARD_LAYOUTS = {"dot": 0, "gather": 1}
SAMPLED_GRAD_LAYOUTS = {"dot": 0, "gather": 1}
GATHER_MAX_K = 1
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

# The most bytes read of a record beside the library: a valid one is shorter, anything longer is garbage.
RECORD_MAX_BYTES = 256

_lock = threading.Lock()
_UNLOADED = object()
_library: ctypes.CDLL | None | object = _UNLOADED


def _new_lock_in_child() -> None:
    """A forked child has only the forking thread: a build another thread ran at the fork (holding `_lock`) never
    finishes there, so the child gets a free lock and, if nothing was loaded, loads or builds itself."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


class _Untrusted(Exception):
    """A library that loaded but computes something other than the torch ops."""


def cache_dir() -> Path:
    """The `kernels` folder of the package's cache root (`$PEFT_NEUROADA_CACHE`, else `~/.cache/peft_neuroada`)."""
    return cache_root() / "kernels"


def compiler() -> list[str] | None:
    """The command that compiles: `$CC` split as a shell splits it (a compiler and its leading arguments, as in
    `CC="ccache gcc"`), its first word found on PATH; unset or empty, the first of cc, gcc, clang on PATH. None where
    there is none (CC naming no program, or with unbalanced quotes)."""
    try:
        words = shlex.split(os.environ.get("CC", ""))
    except ValueError:
        return None
    if not words:
        return next(([path] for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)
    path = shutil.which(words[0])
    return None if path is None else [path, *words[1:]]


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("flags", "features", "model name", "cpu part", "isa")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip().lower() in wanted}))


def _library_name(cc: list[str]) -> str:
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE_TEXT, shlex.join(cc), version, repr((FLAGS, OPTIONAL_FLAGS)), _cpu_identity()]).encode()
    ).hexdigest()[:16]
    return f"neuroada_cpu-{key}.so"


def _fingerprint(content: bytes) -> bytes:
    """A library's integrity record: its size and sha256."""
    return f"{len(content)} {hashlib.sha256(content).hexdigest()}\n".encode()


def _matches_record(library: Path) -> bool:
    """Whether `library` has the size and sha256 its integrity record names; a missing file or any other content of
    either (empty, truncated, not text, another file's record) means no."""
    try:
        with open(library.with_suffix(".sha256"), "rb") as file:
            record = file.read(RECORD_MAX_BYTES)
        with open(library, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            # the size first: a file replaced by something of another length is not read whole
            return record.startswith(f"{size} ".encode()) and _fingerprint(file.read(size + 1)) == record
    except OSError:
        return False


def _optional_flag_choices() -> list[list[str]]:
    """The optional flags to build with, in the order tried: all of them, then every smaller combination, then none."""
    return [
        [flag for group in chosen for flag in group]
        for size in range(len(OPTIONAL_FLAGS), -1, -1)
        for chosen in itertools.combinations(OPTIONAL_FLAGS, size)
    ]


def _build(cc: list[str], target: Path) -> ctypes.CDLL:
    """Compile `SOURCE_TEXT` in a temporary folder beside the target, load and self-test the library there, then move
    it into place and record its size and sha256: other processes never see a partial or failing library (a loaded
    library stays mapped when its file is moved)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        source, built = Path(folder) / SOURCE.name, Path(folder) / target.name
        source.write_text(SOURCE_TEXT)
        command = [*cc, *FLAGS, str(source), "-o", str(built)]
        *preferred, plain = _optional_flag_choices()
        for extra in preferred:
            if subprocess.run([*command, *extra], capture_output=True, timeout=300).returncode == 0:
                break
        else:
            subprocess.run([*command, *plain], check=True, capture_output=True, timeout=300)
        fingerprint = _fingerprint(built.read_bytes())
        lib = _trusted(ctypes.CDLL(str(built)))
        os.replace(built, target)
    _write_quietly(target.with_suffix(".sha256"), fingerprint)
    return lib


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


def _load(cc: list[str] | None) -> ctypes.CDLL | None:
    """The cached library where it passes its checks, else a new build that does (see the module docstring)."""
    if cc is None:
        logger.warning("peft-neuroada: no C compiler found (CC=%r; set CC to one on PATH); using the slower torch ops "
                       "for sparse products", os.environ.get("CC", ""))  # fmt: skip
        return None
    if SOURCE_TEXT is None:
        logger.warning("peft-neuroada: %s is missing; using the slower torch ops for sparse products", SOURCE)
        return None
    try:
        folder = cache_dir()
    except RuntimeError as error:  # no $PEFT_NEUROADA_CACHE, and Path.home() finds no home folder
        logger.warning("peft-neuroada: no folder to cache the C kernels in (%s); set PEFT_NEUROADA_CACHE to one. "
                       "Using the slower torch ops for sparse products", error)  # fmt: skip
        return None
    rejected = ""
    try:
        path = folder / _library_name(cc)
        if _matches_record(path):
            try:
                return _trusted(ctypes.CDLL(str(path)))
            except Exception as error:  # a wrong library can fail in any way; it is rebuilt
                rejected = f"the cached {path.name} failed: {error}"
        elif path.exists():
            rejected = f"the cached {path.name} does not match its record"
        lib = _build(cc, path)
    except Exception as error:  # no failure of a build or a library may escape a dispatch
        output = getattr(error, "stderr", None)  # the compiler's, where it failed
        detail = f"{error} {output.decode(errors='replace')[-2000:]}" if isinstance(output, bytes) else str(error)
        logger.warning(
            "peft-neuroada: could not build working C kernels with %s (%s%s); using the slower torch ops for sparse "
            "products. Set CC to a working C compiler, or clear %s",
            shlex.join(cc), f"{rejected}, then " if rejected else "", detail, folder,
        )  # fmt: skip
        return None
    if rejected:
        logger.info("peft-neuroada: rebuilt the C kernels (%s)", rejected)
    return lib


def _trusted(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with its functions declared, once its self-test passed."""
    _declare(lib)
    _self_test(lib)
    return lib


def _self_test(lib: ctypes.CDLL) -> None:
    """Raise `_Untrusted` unless `lib` computes what the torch ops do: every product and layout on small random
    float32 and bfloat16 inputs with int16 indices (what layers hand it), at k = 1 and k > 1, for every neuron and
    for a subset; the entry patch bit for bit. Float32 sums may differ in order, half-precision outputs by rounding."""
    generator = torch.Generator().manual_seed(0)
    tokens, d_in, d_out = 5, 11, 7
    f32, bf16 = torch.float32, torch.bfloat16
    # every pair of dtype, k and neuron set (all, or a subset) in four cases
    for dtype, k, subset in ((f32, 1, False), (f32, 3, True), (bf16, 1, True), (bf16, 3, False)):
        x, grad, base = (torch.randn(tokens, d, generator=generator).to(dtype) for d in (d_in, d_out, d_out))
        rows = torch.randperm(d_out, generator=generator)[:4].short() if subset else None
        n = d_out if rows is None else rows.shape[0]
        cols = torch.rand(n, d_in, generator=generator).argsort(1)[:, :k].short()
        delta = torch.randn(n, k, generator=generator).to(dtype)
        for layout in SAMPLED_GRAD_LAYOUTS:
            got = sampled_grad(x, grad, cols, rows, layout=layout, lib=lib)
            _expect_close(f"sampled_grad ({layout})", got, torch_ops.sampled_grad(x, grad, cols, rows))
        got = bypass_forward(x, cols, rows, delta, d_out, lib=lib)
        _expect_close("bypass_forward", got, torch_ops.bypass_forward(x, cols, rows, delta, d_out))
        got = bypass_forward(x, cols, rows, delta, d_out, base.clone(), lib=lib)
        expected = torch_ops.bypass_forward(x, cols, rows, delta, d_out, base.clone())
        _expect_close("bypass_forward(out=)", got, expected)
        got = bypass_input_grad(grad, cols, rows, delta, d_in, dtype, lib=lib)
        _expect_close("bypass_input_grad", got, torch_ops.bypass_input_grad(grad, cols, rows, delta, d_in, dtype))
        weight = torch.randn(d_out, d_in, generator=generator).to(dtype)
        original = weight.clone()
        positions = (torch.arange(d_out)[:, None] if rows is None else rows.long()[:, None], cols.long())
        expected = weight.clone().index_put_(positions, weight[positions] + delta.to(dtype))
        patch = EntryPatch(weight, cols, rows, delta, lib=lib)
        patch.apply()
        patched = weight.clone()
        patch.restore()
        if not (_bits(patched).equal(_bits(expected)) and _bits(weight).equal(_bits(original))):
            raise _Untrusted(f"the entry patch differs from w + delta.to(w.dtype) or its undo ({dtype}, k={k})")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _expect_close(product: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = 1e-4 if got.dtype == torch.float32 else 4 * torch.finfo(got.dtype).eps
    scale = expected.double().abs().max().item() + 1
    error = (got.double() - expected.double()).abs().max().item() if got.shape == expected.shape else float("nan")
    if got.dtype != expected.dtype or not error <= tolerance * scale:  # NaN compares false
        raise _Untrusted(f"{product} differs from the torch ops ({expected.dtype}, {tuple(expected.shape)}: {error})")


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
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """`phases`, when given, receives the seconds the calling thread spent in each of `SAMPLED_GRAD_PHASES` (where a
    call's time goes: benchmarks/primitives.py). `layout` ("dot" or "gather", as tests and benchmarks ask for one)
    defaults to `layout_for(k, dtypes of the inputs)`. `lib`: a library other than the process's (one
    being self-tested), here and in the other products."""
    lib = _required() if lib is None else lib
    n, k = cols.shape
    layout = layout or layout_for(k, (x2d.dtype, grad2d.dtype))
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


def layout_for(k: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> str:
    """The layout of the forward and of the delta gradient for k columns per neuron and tensors of `dtypes`."""
    return "gather" if k <= GATHER_MAX_K and all(dtype == torch.float32 for dtype in dtypes) else "dot"


def _write_quietly(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all; an unwritable record only means that the next process builds
    again."""
    try:
        write_atomically(path, lambda temporary: Path(temporary).write_bytes(data))
    except OSError:
        logger.debug("peft-neuroada: could not record the C kernels' size and hash in %s", path)


def bypass_forward(
    x2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_out: int,
    out: torch.Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    lib = _required() if lib is None else lib
    n, k = cols.shape
    accumulate = out is not None
    out = torch.empty(x2d.shape[0], d_out, dtype=x2d.dtype) if out is None else out
    place, cols, rows = _placement(cols, rows)
    delta = delta.detach().contiguous()
    layout = FORWARD_LAYOUTS[layout_for(k, (x2d.dtype, out.dtype))]
    sizes = [x2d.shape[0], x2d.shape[1], d_out, n, k]
    status = lib.na_bypass_forward(
        *_matrix(x2d), *place, delta.data_ptr(), DTYPE_CODES[delta.dtype], *sizes,
        out.data_ptr(), DTYPE_CODES[out.dtype], out.stride(0), accumulate, layout, TOKEN_BLOCK,
        torch.get_num_threads(),
    )  # fmt: skip
    _check(status)
    return out


def bypass_input_grad(
    grad2d: torch.Tensor,
    cols: torch.Tensor,
    rows: torch.Tensor | None,
    delta: torch.Tensor,
    d_in: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    lib = _required() if lib is None else lib
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

    def __init__(
        self,
        weight: torch.Tensor,
        cols: torch.Tensor,
        rows: torch.Tensor | None,
        delta: torch.Tensor,
        *,
        lib: ctypes.CDLL | None = None,
    ):
        lib = _required() if lib is None else lib
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
