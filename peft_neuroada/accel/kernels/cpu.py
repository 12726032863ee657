"""The C kernels of `neuroada_cpu.c`: built on first use with the system C compiler, cached, called through ctypes.

Plain C, not a torch C++ extension: without torch headers a build takes seconds, not minutes (CI builds on every clean
machine), and ctypes releases the GIL. `dlopen` runs a library's constructors before any check of its results could,
so the cache is used only where it passes the trust rule of `..cache` (its root, the kernels folder, the library and
its record owned by this user, not writable by group or others, no symbolic links; checked on opened descriptors).
A cache folder that breaks it is neither read nor written: the kernels are built for this process alone, after a
warning that names the path and what to do. A trusted cache can still hold damage (a full disk, a killed process),
and a compiler can be broken, so a library serves only once its bytes match the size and sha256 recorded beside it
(checked before `dlopen`, which a truncated library crashes) and `_self_test` passed; else it is rebuilt, once per
process at most. What is loaded is always a copy of the checked bytes in a fresh private folder (`_loaded`). Where
nothing works, `library()` is None (one warning) and the torch ops serve.
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
from torch import Tensor

from ...cache import UntrustedPath, cache_root, open_cache_folder, open_trusted, write_file
from ...tuner import products as torch_ops

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("neuroada_cpu.c")
# Read once at import: the library is built from (and cached by) this text, so it always matches the argument types
# `_trusted` declares, even if the file is edited while a process runs. None in a stripped install: torch ops serve.
try:
    SOURCE_TEXT: str | None = SOURCE.read_text()
except OSError:
    SOURCE_TEXT = None
FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread")
# Each dropped when the compiler refuses it: OpenMP runs the kernels on torch's own OpenMP team (no second pool of
# threads competing with torch's spinning workers); some Apple clang versions do not know -march=native.
OPTIONAL_FLAGS = (("-fopenmp",), ("-march=native",))
TOKEN_BLOCK = 64  # tokens per packed block: x^T of a block stays in L2 (docs/design.md, "Compiled kernels")
GATHER_TOKEN_BLOCK = 16  # the gather layout's: the rows gathered from stay in L1
SAMPLED_GRAD_LAYOUTS = FORWARD_LAYOUTS = {"dot": 0, "gather": 1}
SAMPLED_GRAD_PHASES = ("packing x", "packing grad", "products")  # per token block, timed by `phases=`
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
INDEX_CODES = {torch.int32: 0, torch.int64: 1, torch.int16: 2}
_STATUS = {
    1: "cols has an index outside [0, d_in)",
    2: "out of memory",
    3: "invalid sizes",
    4: "rows has an index outside [0, d_out)",
    5: "the entries are patched already (a nested visit of the same weight)",
}
RECORD_MAX_BYTES = 256  # a valid record is shorter: a longer file is garbage, not read further

_lock = threading.Lock()


def _new_lock_in_child() -> None:
    """A forked child has only the forking thread: a build that another thread ran at the fork never finishes there."""
    global _lock
    _lock = threading.Lock()


_FORK_HANDLER: list[bool] = []


def _register_fork_handler_once() -> None:
    """`_new_lock_in_child` runs in forked children from the first build on (before, no build can be in flight)."""
    if not _FORK_HANDLER:
        os.register_at_fork(after_in_child=_new_lock_in_child)
        _FORK_HANDLER.append(True)


_UNLOADED = object()
_library: ctypes.CDLL | None | object = _UNLOADED


class _Untrusted(Exception):
    """A library that loaded but computes something other than the torch ops."""


def compiler() -> list[str] | None:
    """`$CC` split as a shell splits it (`CC="ccache gcc"`), its first word found on PATH; unset or empty, the first of
    cc, gcc, clang on PATH. None where there is none (or CC has unbalanced quotes)."""
    try:
        words = shlex.split(os.environ.get("CC", "")) or [next(filter(shutil.which, ("cc", "gcc", "clang")), "")]
    except ValueError:
        return None
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
    """Keyed by the source, the compiler and the CPU (-march=native): a shared cache never serves another CPU."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = "\0".join([SOURCE_TEXT, shlex.join(cc), version, repr((FLAGS, OPTIONAL_FLAGS)), _cpu_identity()])
    return f"neuroada_cpu-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _fingerprint(content: bytes) -> bytes:
    return f"{len(content)} {hashlib.sha256(content).hexdigest()}\n".encode()


def _recorded_content(kernels: int, path: Path) -> bytes | None:
    """The bytes of the cached library `path` (in the folder open as `kernels`) where it and its record pass the trust
    rule and agree in size and sha256; None where no library is cached. Raises `UntrustedPath`, `OSError`, or
    `ValueError` where the library does not match its record."""
    try:
        library = open_trusted(path.name, path, kernels)
    except FileNotFoundError:
        return None
    with open(library, "rb") as file:
        record_path = path.with_suffix(".sha256")
        try:
            with open(open_trusted(record_path.name, record_path, kernels), "rb") as record_file:
                record = record_file.read(RECORD_MAX_BYTES)
        except FileNotFoundError:
            record = b""
        size = os.fstat(file.fileno()).st_size
        # the size first: a garbage file is not read whole
        if record.startswith(f"{size} ".encode()) and _fingerprint(content := file.read(size + 1)) == record:
            return content
    raise ValueError(f"the cached {path.name} does not match its record")


def _from_cache(kernels: int, path: Path) -> tuple[ctypes.CDLL | None, str, int]:
    """The cached library, or None, why it was not loaded ("" where none is cached) and the level to log that at:
    WARNING where it broke the trust rule (someone else may have planted it); INFO where it is damaged or fails, as
    then only this user's own processes wrote it (a crash, a full disk, a changed compiler) and the rebuild repairs
    it with nothing for the user to do."""
    try:
        content = _recorded_content(kernels, path)
    except UntrustedPath as error:
        return None, f"{error}, so the cached library was not loaded", logging.WARNING
    except OSError as error:
        return None, f"the cached {path.name} could not be read ({error})", logging.INFO
    except ValueError as error:
        return None, str(error), logging.INFO
    if content is None:
        return None, "", logging.INFO
    try:
        return _loaded(content, path.name), "", logging.INFO
    except Exception as error:  # a wrong library can fail in any way; it is rebuilt
        return None, f"the cached {path.name} failed: {error}", logging.INFO


def _loaded(content: bytes, name: str) -> ctypes.CDLL:
    """`content` loaded and self-tested from a copy in a fresh private folder (`tempfile`: mode 0700 under a random
    name in the temporary folder, which is sticky or the user's own). `dlopen` takes a path, and a path in the cache
    could be swapped between the check of its bytes and the load; the copy's cannot. The copy goes once loaded (its
    mapping stays)."""
    with tempfile.TemporaryDirectory(prefix="peft_neuroada-") as folder:
        path = Path(folder) / name
        path.write_bytes(content)
        return _trusted(ctypes.CDLL(str(path)))


def _build(cc: list[str], name: str, kernels: int | None) -> ctypes.CDLL:
    """Compile, load and self-test in a fresh private folder, then cache the library and its record in the folder
    open as `kernels` (None: a cache that is not trusted, left alone), each written whole under a temporary name:
    other processes never see a partial or failing library."""
    with tempfile.TemporaryDirectory(prefix="peft_neuroada-") as folder:
        source, built = Path(folder) / SOURCE.name, Path(folder) / name
        source.write_text(SOURCE_TEXT)
        command = [*cc, *FLAGS, str(source), "-o", str(built)]
        sizes = range(len(OPTIONAL_FLAGS), -1, -1)  # all the optional flags, then fewer; none of them must build
        for extra in (sum(chosen, ()) for size in sizes for chosen in itertools.combinations(OPTIONAL_FLAGS, size)):
            if subprocess.run([*command, *extra], capture_output=True, timeout=300, check=not extra).returncode == 0:
                break
        content = built.read_bytes()
        lib = _trusted(ctypes.CDLL(str(built)))
    if kernels is not None:
        try:  # the library first: a record never names bytes that are not there yet
            write_file(kernels, name, content, 0o755)
            write_file(kernels, Path(name).with_suffix(".sha256").name, _fingerprint(content), 0o644)
        except OSError as error:  # the next process builds again
            logger.debug("peft-neuroada: could not cache the C kernels (%s)", error)
    return lib


def library() -> ctypes.CDLL | None:
    """The kernels, loaded or built on first use (`CC`, `PEFT_NEUROADA_CACHE` read then); None where impossible."""
    global _library
    if _library is _UNLOADED:
        with _lock:
            if _library is _UNLOADED:
                _register_fork_handler_once()
                _library = _load(compiler())
    return _library


def _torch_ops_serve(reason: str, advice: str = "") -> None:
    logger.warning("peft-neuroada: %s; using the slower torch ops for sparse products%s", reason, advice)


def _load(cc: list[str] | None) -> ctypes.CDLL | None:
    """The cached library where the cache is trusted and it passes its checks, else a new build that does (see the
    module docstring)."""
    if cc is None:
        return _torch_ops_serve(f"no C compiler found (CC={os.environ.get('CC', '')!r}; set CC to one on PATH)")
    if SOURCE_TEXT is None:
        return _torch_ops_serve(f"{SOURCE} is missing")
    try:
        folder = cache_root() / "kernels"
    except RuntimeError as error:  # no $PEFT_NEUROADA_CACHE, and Path.home() finds no home folder
        return _torch_ops_serve(f"no folder to cache the C kernels in ({error}); set PEFT_NEUROADA_CACHE to one")
    uncached = advice = ""  # why the cache is not used, and how to make it usable
    try:
        kernels = open_cache_folder(folder.name)
    except UntrustedPath as error:
        kernels = None
        uncached = f"not using the kernel cache: {error}, so another user could have planted a library there"
        advice = f"{error.advice}, or set PEFT_NEUROADA_CACHE to a folder only you can write"
    except OSError as error:
        kernels, uncached = None, f"not using the kernel cache ({error})"
        advice = "set PEFT_NEUROADA_CACHE to a folder you can write"
    rejected, level = "", logging.INFO
    try:
        name = _library_name(cc)
        lib, rejected, level = (None, "", level) if kernels is None else _from_cache(kernels, folder / name)
        if lib is None:
            lib = _build(cc, name, kernels)
    except Exception as error:  # no failure of a build or a library may escape a dispatch
        output = getattr(error, "stderr", None)  # the compiler's, where it failed
        detail = f"{error} {output.decode(errors='replace')[-2000:]}" if isinstance(output, bytes) else str(error)
        then = f"{uncached or rejected}, then " if uncached or rejected else ""
        reason = f"could not build working C kernels with {shlex.join(cc)} ({then}{detail})"
        return _torch_ops_serve(reason, f". Set CC to a working C compiler, or clear {folder}")
    finally:
        if kernels is not None:
            os.close(kernels)
    if uncached:
        logger.warning(
            "peft-neuroada: %s; built the C kernels for this process only. To cache them: %s", uncached, advice
        )
    elif rejected:
        logger.log(level, "peft-neuroada: rebuilt the C kernels (%s)", rejected)
    return lib


def _trusted(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with its functions declared, once it passed its self-test."""
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    matrix = [p, i64, i64, i]  # data, token (or row) stride, feature (or column) stride, dtype
    placement = [p, i, p, i]  # cols, index dtype, rows, index dtype
    sizes = [i64] * 5  # T, d_in, d_out, n, k
    lib.na_sampled_grad.argtypes = [*matrix, *matrix, *placement, *sizes, p, i, i64, i, p]
    lib.na_bypass_forward.argtypes = [*matrix, *placement, p, i, *sizes, p, i, i64, i, i, i64, i]
    lib.na_bypass_input_grad.argtypes = [*matrix, *placement, p, i, *sizes, p, i, i64, i, i64, i]
    lib.na_patch_entries.argtypes = [*matrix, *placement, p, i, p, i64, i64, i64, i64, i]
    lib.na_restore_entries.argtypes = [*matrix, *placement, p, i64, i64, i]
    for name in ("sampled_grad", "bypass_forward", "bypass_input_grad", "patch_entries", "restore_entries",
                 "vector_width", "uses_openmp"):  # fmt: skip
        getattr(lib, f"na_{name}").restype = ctypes.c_int
    _self_test(lib)
    return lib


def _self_test(lib: ctypes.CDLL) -> None:
    """Raise `_Untrusted` unless `lib` computes what the torch ops do: every product and layout, float32 and bfloat16,
    k = 1 and 3, all neurons and a subset, int16 indices (as layers keep them); the entry patch bit for bit."""
    generator = torch.Generator().manual_seed(0)
    tokens, d_in, d_out = 5, 11, 7
    for dtype, k, subset in itertools.product((torch.float32, torch.bfloat16), (1, 3), (False, True)):
        x, grad, base = (torch.randn(tokens, d, generator=generator).to(dtype) for d in (d_in, d_out, d_out))
        rows = torch.randperm(d_out, generator=generator)[:4].short() if subset else None
        cols = torch.rand(4 if subset else d_out, d_in, generator=generator).argsort(1)[:, :k].short()
        delta = torch.randn(cols.shape, generator=generator).to(dtype)
        sampled, forward = (x, grad, cols, rows), (x, cols, rows, delta, d_out)
        cases = [(f"sampled_grad {layout}", sampled, {"layout": layout}) for layout in SAMPLED_GRAD_LAYOUTS]
        cases += [("bypass_forward", forward, {}), ("bypass_input_grad", (grad, cols, rows, delta, d_in, dtype), {})]
        for label, args, options in cases:
            name = label.split()[0]
            _expect_close(label, globals()[name](*args, lib=lib, **options), getattr(torch_ops, name)(*args))
        ours = bypass_forward(*forward, base.clone(), lib=lib)  # adds into its `out`
        _expect_close("bypass_forward out=", ours, torch_ops.bypass_forward(*forward, base.clone()))
        weight = torch.randn(d_out, d_in, generator=generator).to(dtype)
        at = (torch.arange(d_out) if rows is None else rows.long())[:, None], cols.long()
        original, expected = weight.clone(), weight.clone().index_put_(at, weight[at] + delta)
        patch = EntryPatch(weight, cols, rows, delta, lib=lib)
        patch.apply()
        patched = weight.clone()
        patch.restore()
        bits = [t.view(torch.int16) for t in (patched, expected, weight, original)]
        if not (bits[0].equal(bits[1]) and bits[2].equal(bits[3])):
            raise _Untrusted(f"the entry patch differs from w + delta.to(w.dtype) or its undo ({dtype}, k={k})")


def _expect_close(product: str, got: Tensor, expected: Tensor) -> None:
    """Float32 sums may differ in order, half-precision outputs by a rounding."""
    tolerance = 1e-4 if got.dtype == torch.float32 else 4 * torch.finfo(got.dtype).eps
    scale = expected.double().abs().max().item() + 1
    error = (got.double() - expected.double()).abs().max().item() if got.shape == expected.shape else float("nan")
    if got.dtype != expected.dtype or not error <= tolerance * scale:  # NaN compares false
        raise _Untrusted(f"{product} differs from the torch ops ({expected.dtype}, {tuple(expected.shape)}: {error})")


def available() -> bool:
    return library() is not None


def _required() -> ctypes.CDLL:
    if (lib := library()) is None:
        raise RuntimeError("the NeuroAda C kernels are not available on this machine (no working C compiler)")
    return lib


def _matrix(t: Tensor) -> list:
    return [t.data_ptr(), t.stride(0), t.stride(1), DTYPE_CODES[t.dtype]]


def _placement(cols: Tensor, rows: Tensor | None) -> tuple[list, Tensor, Tensor | None]:
    """The C arguments of a placement, and the contiguous tensors they point into (keep them until the call ends)."""
    cols, rows = cols.contiguous(), None if rows is None else rows.contiguous()
    args = [None, 0] if rows is None else [rows.data_ptr(), INDEX_CODES[rows.dtype]]
    return [cols.data_ptr(), INDEX_CODES[cols.dtype], *args], cols, rows


def _check(status: int) -> None:
    if status:
        error = IndexError if status in (1, 4) else RuntimeError
        raise error(f"NeuroAda sparse product (C kernel): {_STATUS.get(status, status)}")


def layout_for(k: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> str:
    """The forward's and delta gradient's layout: "gather" (from each token's row, no transposes) at k = 1 in float32,
    else "dot" (packed blocks), as gathers lose from k = 2 and on half-precision rows. The two round differently."""
    return "gather" if k <= 1 and all(dtype == torch.float32 for dtype in dtypes) else "dot"


def sampled_grad(
    x2d: Tensor, grad2d: Tensor, cols: Tensor, rows: Tensor | None, phases=None, layout=None, *, lib=None
) -> Tensor:
    """`phases` (a dict) receives the calling thread's seconds per `SAMPLED_GRAD_PHASES`; `layout` forces one; `lib`,
    here and below: a library other than the process's (one being self-tested)."""
    lib = _required() if lib is None else lib
    layout = layout or layout_for(cols.shape[1], (x2d.dtype, grad2d.dtype))
    out = torch.empty(cols.shape, dtype=torch.float32)
    place, cols, rows = _placement(cols, rows)
    seconds = (ctypes.c_double * len(SAMPLED_GRAD_PHASES))() if phases is not None else None
    block = GATHER_TOKEN_BLOCK if layout == "gather" else TOKEN_BLOCK
    _check(lib.na_sampled_grad(
        *_matrix(x2d), *_matrix(grad2d), *place, *x2d.shape, grad2d.shape[1], *cols.shape, out.data_ptr(),
        SAMPLED_GRAD_LAYOUTS[layout], block, torch.get_num_threads(), seconds,
    ))  # fmt: skip
    if phases is not None:
        phases.update(zip(SAMPLED_GRAD_PHASES, seconds, strict=True))
    return out


def _bypass(kernel, source: Tensor, cols, rows, delta: Tensor, sizes, out: Tensor, accumulate, *layout) -> Tensor:
    """What the two bypass kernels' calls share."""
    place, cols, rows = _placement(cols, rows)
    delta = delta.detach().contiguous()
    _check(kernel(
        *_matrix(source), *place, delta.data_ptr(), DTYPE_CODES[delta.dtype], *sizes, *cols.shape, out.data_ptr(),
        DTYPE_CODES[out.dtype], out.stride(0), accumulate, *layout, TOKEN_BLOCK, torch.get_num_threads(),
    ))  # fmt: skip
    return out


def bypass_forward(x2d: Tensor, cols: Tensor, rows, delta: Tensor, d_out: int, out=None, *, lib=None) -> Tensor:
    lib = _required() if lib is None else lib
    accumulate, out = out is not None, torch.empty(x2d.shape[0], d_out, dtype=x2d.dtype) if out is None else out
    layout = FORWARD_LAYOUTS[layout_for(cols.shape[1], (x2d.dtype, out.dtype))]
    return _bypass(lib.na_bypass_forward, x2d, cols, rows, delta, (*x2d.shape, d_out), out, accumulate, layout)


def bypass_input_grad(grad2d: Tensor, cols: Tensor, rows, delta: Tensor, d_in: int, dtype, out=None, *, lib=None):
    lib = _required() if lib is None else lib
    accumulate, out = out is not None, torch.empty(grad2d.shape[0], d_in, dtype=dtype) if out is None else out
    sizes = (grad2d.shape[0], d_in, grad2d.shape[1])
    return _bypass(lib.na_bypass_input_grad, grad2d, cols, rows, delta, sizes, out, accumulate)


class _PatchState(ctypes.Structure):  # neuroada_cpu.c's: whether the entries are patched, their saved values
    _fields_ = [("applied", ctypes.c_int32), ("saved", ctypes.c_void_p)]


class EntryPatch:
    """`weight[rows[i], cols[i, j]] += delta[i, j]` (`apply`, as torch's `w + delta.to(w.dtype)`) and its exact undo
    (`restore`), one C call each. `restore` writes back only what an `apply` patched, so a `finally` may always call
    it. The calls use raw addresses: the patch holds the tensors, and the copies made here, while it lives."""

    def __init__(self, weight: Tensor, cols: Tensor, rows: Tensor | None, delta: Tensor, *, lib=None):
        lib = _required() if lib is None else lib
        place, cols, rows = _placement(cols, rows)
        delta = delta.contiguous()  # (its address only: no autograd)
        self._state, self._held = _PatchState(), (weight, cols, rows, delta)
        at, state, workers = [*_matrix(weight), *place], ctypes.addressof(self._state), torch.get_num_threads()
        self._apply = functools.partial(
            lib.na_patch_entries, *at, delta.data_ptr(), DTYPE_CODES[delta.dtype], state, weight.shape[1],
            weight.shape[0], *cols.shape, workers,
        )  # fmt: skip
        self._restore = functools.partial(lib.na_restore_entries, *at, state, *cols.shape, workers)

    def apply(self) -> None:
        _check(self._apply())

    def restore(self) -> None:
        self._restore()
