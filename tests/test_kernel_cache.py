"""What lies in the kernel cache is untrusted input, and a compiler can be broken: a damaged or wrong library, or a
garbled record beside one, never crashes a process and never changes a result. The kernels are rebuilt where that
helps; where it does not, the torch ops serve, after one warning. A library that another user could have planted (a
cache folder or file not owned by this user, writable by group or others, or a symbolic link) is never loaded.

The libraries here are built by the system compiler at -O0 (a fifth of the build time: these specs are about what the
loader trusts, not about optimised code). Damaged libraries are loaded in fresh processes: a crash would end pytest."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peft_neuroada.accel import kernels
from peft_neuroada.accel.kernels import cpu
from peft_neuroada.tuner import products as torch_ops

COMPILER = cpu.compiler()
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler")

# Every function neuroada_cpu.c exports, each reporting success without computing anything.
WRONG_SOURCE = """
int na_sampled_grad() { return 0; }
int na_bypass_forward() { return 0; }
int na_bypass_input_grad() { return 0; }
int na_patch_entries() { return 0; }
int na_restore_entries() { return 0; }
int na_vector_width() { return 8; }
int na_uses_openmp() { return 0; }
"""


def products_match_torch_ops() -> str:
    """Check every product, through the dispatcher, against the torch ops (k = 1 in the gather layout, k = 5 on a
    subset of neurons; int16 columns; the entry patch where the C kernels serve); returns the backend that served."""
    generator = torch.Generator().manual_seed(0)
    x, grad = torch.randn(37, 50, generator=generator), torch.randn(37, 70, generator=generator)
    for k, rows in ((1, None), (5, torch.randperm(70, generator=generator)[:40])):
        n = 70 if rows is None else 40
        cols = torch.rand(n, 50, generator=generator).argsort(1)[:, :k].short()
        delta, base = torch.randn(n, k, generator=generator), torch.randn(37, 70, generator=generator)
        pairs = [
            (kernels.sampled_grad(x, grad, cols, rows), torch_ops.sampled_grad(x, grad, cols, rows)),
            (kernels.bypass_forward(x, cols, rows, delta, 70), torch_ops.bypass_forward(x, cols, rows, delta, 70)),
            (
                kernels.bypass_forward(x, cols, rows, delta, 70, out=base.clone()),
                torch_ops.bypass_forward(x, cols, rows, delta, 70, base.clone()),
            ),
            (
                kernels.bypass_input_grad(grad, cols, rows, delta, 50),
                torch_ops.bypass_input_grad(grad, cols, rows, delta, 50, torch.float32),
            ),
        ]
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
        weight = torch.randn(70, 50, generator=generator)
        if kernels.patches_entries(weight, delta):
            original = weight.clone()
            positions = (torch.arange(70)[:, None] if rows is None else rows[:, None], cols.long())
            expected = weight.clone().index_put_(positions, weight[positions] + delta)
            entries = kernels.entry_patch(weight, cols, rows, delta)
            entries.apply()
            assert torch.equal(weight, expected)
            entries.restore()
            assert torch.equal(weight, original)
    return kernels.choose_backend("sampled_grad", x, grad)


def run_in_fresh_process() -> subprocess.CompletedProcess:
    """`products_match_torch_ops` in a new Python process with this process's environment; prints the backend."""
    code = f"""
import sys, types
root = {str(Path(kernels.__file__).parents[2])!r}
for name in ("peft_neuroada", "peft_neuroada.accel", "peft_neuroada.tuner"):  # the kernels without peft: 2 s, not 9
    package = types.ModuleType(name)
    package.__path__ = [root + name.removeprefix("peft_neuroada").replace(".", "/")]
    sys.modules[name] = package
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_kernel_cache import products_match_torch_ops
print(products_match_torch_ops())
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def library_in(cache: Path) -> Path:
    (library,) = (cache / "kernels").glob("neuroada_cpu-*.so")
    return library


def record_of(content: bytes) -> bytes:
    """The integrity record written beside a library: its size and sha256."""
    return f"{len(content)} {hashlib.sha256(content).hexdigest()}\n".encode()


def is_recorded(library: Path) -> bool:
    return library.with_suffix(".sha256").read_bytes() == record_of(library.read_bytes())


def peft_neuroada_warnings(caplog) -> list[str]:
    ours = (r for r in caplog.records if r.name.startswith("peft_neuroada"))
    return [r.getMessage() for r in ours if r.levelno >= logging.WARNING]


def executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def fast_cc(tmp_path_factory) -> str:
    """The system compiler at -O0, as a script to use as `CC`."""
    script = tmp_path_factory.mktemp("fast-cc") / "cc"
    return executable(script, f'#!/bin/sh\nexec {shlex.join(COMPILER)} "$@" -O0\n')


@pytest.fixture(scope="module")
def wrong_cc(tmp_path_factory) -> str:
    """A compiler that builds `WRONG_SOURCE` for any source it is given: a library that loads but computes nothing."""
    folder = tmp_path_factory.mktemp("wrong-cc")
    wrong = folder / "wrong.c"
    wrong.write_text(WRONG_SOURCE)
    swap = f'for arg do shift; case $arg in *.c) arg={shlex.quote(str(wrong))};; esac; set -- "$@" "$arg"; done\n'
    return executable(folder / "cc", f'#!/bin/sh\n{swap}exec {shlex.join(COMPILER)} "$@"\n')


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, fast_cc) -> Path:
    """A kernel cache holding one library built with `fast_cc` and its integrity record."""
    root = tmp_path_factory.mktemp("pristine")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CC", fast_cc)
        patch.setenv("PEFT_NEUROADA_CACHE", str(root))
        patch.setattr(cpu, "_library", cpu._UNLOADED)
        assert cpu.available()
    return root


@pytest.fixture
def first_use(monkeypatch, fast_cc):
    """The kernels not loaded yet in this process (as in a new one), built with `fast_cc` when built."""
    monkeypatch.setenv("CC", fast_cc)
    monkeypatch.setattr(cpu, "_library", cpu._UNLOADED)


@pytest.fixture
def cache(pristine, tmp_path, monkeypatch, first_use) -> Path:
    """A copy of the pristine cache, the one this process and its children use."""
    root = tmp_path / "cache"
    shutil.copytree(pristine, root)
    monkeypatch.setenv("PEFT_NEUROADA_CACHE", str(root))
    return root


@pytest.fixture
def empty_cache(tmp_path, monkeypatch, first_use) -> Path:
    monkeypatch.setenv("PEFT_NEUROADA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def no_home() -> Path:
    raise RuntimeError("Could not determine home directory.")


DAMAGES = {
    "truncated-to-half": lambda data: data[: len(data) // 2],
    "second-half-zeroed": lambda data: data[: len(data) // 2] + bytes(len(data) - len(data) // 2),
    "random-bytes": lambda data: random.Random(0).randbytes(len(data)),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_cached_library_is_never_loaded_but_rebuilt(cache, damage):
    """`dlopen` of a truncated library kills the process (SIGBUS); its bytes differ from the recorded size and hash."""
    library = library_in(cache)
    damaged = DAMAGES[damage](library.read_bytes())
    library.write_bytes(damaged)
    result = run_in_fresh_process()
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "cpu"
    assert library.read_bytes() != damaged and is_recorded(library)


@pytest.mark.parametrize("planted", ["not-a-library", "a-wrong-library"])
def test_a_cached_library_that_matches_its_record_but_fails_to_load_or_to_compute_is_rebuilt(
    cache, planted, wrong_cc, tmp_path
):
    library = library_in(cache)
    if planted == "not-a-library":
        content = random.Random(0).randbytes(5000)
    else:
        subprocess.run([wrong_cc, "-shared", "-fPIC", "any.c", "-o", str(tmp_path / "wrong.so")], check=True)
        content = (tmp_path / "wrong.so").read_bytes()
    library.write_bytes(content)
    library.with_suffix(".sha256").write_bytes(record_of(content))
    assert products_match_torch_ops() == "cpu"
    assert library.read_bytes() != content and is_recorded(library)


GARBAGE = {
    "not-utf8": b"\xff\xfe 1234 \xc0\x80",
    "empty": b"",
    "huge": b"1234 " * 100_000,
    "wrong-words": b"sideways 123 abc\n",
}


@pytest.mark.parametrize("garbage", GARBAGE)
def test_a_garbled_record_beside_the_library_means_building_again(cache, garbage):
    library = library_in(cache)
    library.with_suffix(".sha256").write_bytes(GARBAGE[garbage])
    assert products_match_torch_ops() == "cpu"
    assert is_recorded(library)


def test_a_compiler_that_builds_a_wrong_library_leaves_the_torch_ops_serving_after_one_warning(
    empty_cache, wrong_cc, monkeypatch, caplog
):
    """The library loads but computes nothing: it fails its self-test, is never moved into the cache, and the one
    warning says what to do."""
    monkeypatch.setenv("CC", wrong_cc)
    assert products_match_torch_ops() == "torch"
    assert not list(empty_cache.rglob("*.so"))
    (warning,) = peft_neuroada_warnings(caplog)
    assert "differs from the torch ops" in warning and "Set CC to a working C compiler, or clear" in warning


def test_cc_is_split_as_a_shell_splits_it(empty_cache, fast_cc, tmp_path, monkeypatch):
    """`CC="ccache gcc"`: the first word is the program, found on PATH; the others lead its arguments. The key of the
    cached library covers them."""
    folder = tmp_path / "a folder"
    folder.mkdir()
    log = tmp_path / "launched"
    launcher = executable(folder / "launcher", f'#!/bin/sh\necho "$1" >> {shlex.quote(str(log))}\nexec "$@"\n')
    monkeypatch.setenv("CC", f"{shlex.quote(launcher)} {shlex.quote(fast_cc)}")
    assert cpu.compiler() == [launcher, fast_cc]
    assert products_match_torch_ops() == "cpu"
    assert set(log.read_text().split()) == {fast_cc}
    assert is_recorded(library_in(empty_cache))
    monkeypatch.delenv("CC")
    default = cpu.compiler()
    monkeypatch.setenv("CC", "")
    assert cpu.compiler() == default
    for value in ("no-such-compiler gcc", f"'{launcher}"):  # not on PATH; unbalanced quotes
        monkeypatch.setenv("CC", value)
        assert cpu.compiler() is None


def test_a_named_cache_serves_a_process_without_a_home_folder(cache, monkeypatch, caplog):
    """As in a container whose user has no passwd entry: `Path.home()` raises."""
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    assert products_match_torch_ops() == "cpu"
    assert not peft_neuroada_warnings(caplog)


def test_with_no_cache_folder_at_all_the_torch_ops_serve_after_one_warning(first_use, monkeypatch, caplog):
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("PEFT_NEUROADA_CACHE", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    assert products_match_torch_ops() == "torch"
    (warning,) = peft_neuroada_warnings(caplog)
    assert "set PEFT_NEUROADA_CACHE" in warning


# A library that only announces itself: its constructor runs at `dlopen`, before any self-test could reject it.
PLANTED_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(%s, "w");
    if (marker) fclose(marker);
}
"""
NOBODY = 65534


def plant(library: Path, content: bytes) -> None:
    """`content` as the cached library, with the record that vouches for it."""
    library.unlink()
    library.write_bytes(content)
    library.with_suffix(".sha256").write_bytes(record_of(content))


def root_writable_by_others(cache: Path) -> Path:
    cache.chmod(0o777)
    return cache


def kernels_folder_writable_by_group(cache: Path) -> Path:
    (cache / "kernels").chmod(0o770)
    return cache / "kernels"


def root_owned_by_another_user(cache: Path) -> Path:
    os.chown(cache, NOBODY, NOBODY)
    return cache


def kernels_folder_owned_by_another_user(cache: Path) -> Path:
    os.chown(cache / "kernels", NOBODY, NOBODY)
    return cache / "kernels"


def kernels_folder_is_a_symlink(cache: Path) -> Path:
    elsewhere = cache.with_name("elsewhere")
    (cache / "kernels").rename(elsewhere)
    (cache / "kernels").symlink_to(elsewhere)
    return cache / "kernels"


def library_is_a_symlink(cache: Path) -> Path:
    library, elsewhere = library_in(cache), cache.with_name("planted.so")
    library.rename(elsewhere)
    library.symlink_to(elsewhere)
    return library


def library_owned_by_another_user(cache: Path) -> Path:
    os.chown(library_in(cache), NOBODY, NOBODY)
    return library_in(cache)


def record_writable_by_others(cache: Path) -> Path:
    library_in(cache).with_suffix(".sha256").chmod(0o666)
    return library_in(cache).with_suffix(".sha256")


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
# Each way to make a cache untrusted after the planting, and what the warning says of the path it returns.
UNTRUSTED_FOLDERS = [  # the cache is neither read nor written: the kernels are built for the process alone
    (root_writable_by_others, "is writable by group or others (mode 777)"),
    (kernels_folder_writable_by_group, "is writable by group or others (mode 770)"),
    pytest.param(root_owned_by_another_user, f"is owned by uid {NOBODY}", marks=ROOT_ONLY),
    pytest.param(kernels_folder_owned_by_another_user, f"is owned by uid {NOBODY}", marks=ROOT_ONLY),
    (kernels_folder_is_a_symlink, "is a symbolic link"),
]
UNTRUSTED_FILES = [  # in a trusted folder: the library is rebuilt in its place
    (library_is_a_symlink, "is a symbolic link"),
    pytest.param(library_owned_by_another_user, f"is owned by uid {NOBODY}", marks=ROOT_ONLY),
    (record_writable_by_others, "is writable by group or others (mode 666)"),
]


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory) -> tuple[bytes, Path]:
    """A library whose constructor creates a marker file, and where that marker would appear."""
    folder = tmp_path_factory.mktemp("planted")
    marker, source = folder / "constructor-ran", folder / "planted.c"
    source.write_text(PLANTED_SOURCE % json.dumps(str(marker)))
    subprocess.run([*COMPILER, "-O0", "-shared", "-fPIC", str(source), "-o", str(folder / "planted.so")], check=True)
    return (folder / "planted.so").read_bytes(), marker


def run_with_planted_library(cache: Path, planted_library, untrust) -> tuple[str, Path]:
    """Plant the library, make the cache untrusted by `untrust`, then check the products in a fresh process (the
    planted constructor could run there); returns its one warning (logging's last resort prints it) and the path
    `untrust` made untrusted."""
    content, marker = planted_library
    marker.unlink(missing_ok=True)  # from an earlier spec that failed
    plant(library_in(cache), content)
    untrusted = untrust(cache)
    result = run_in_fresh_process()
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists()
    assert result.stdout.split()[-1] == "cpu"
    (warning,) = [line for line in result.stderr.splitlines() if line.startswith("peft-neuroada:")]
    return warning, untrusted


@pytest.mark.parametrize("untrust, what_was_wrong", UNTRUSTED_FOLDERS)
def test_a_library_planted_in_a_cache_folder_another_user_could_write_is_never_loaded(
    cache, planted_library, untrust, what_was_wrong
):
    """Its record matches, so only the folder's owner, mode or link betrays it. The kernels still serve, built for
    this process only, after one warning that names the folder, what is wrong and what to do; nothing is written
    into that cache."""
    warning, untrusted = run_with_planted_library(cache, planted_library, untrust)
    assert f"{untrusted} {what_was_wrong}" in warning and "for this process only" in warning
    assert "set PEFT_NEUROADA_CACHE to a folder only you can write" in warning
    assert ("chmod go-w" in warning) == ("writable" in what_was_wrong)
    assert library_in(cache).read_bytes() == planted_library[0]


@pytest.mark.parametrize("untrust, what_was_wrong", UNTRUSTED_FILES)
def test_a_planted_library_or_record_in_a_trusted_cache_folder_is_never_loaded_but_replaced_with_a_warning(
    cache, planted_library, untrust, what_was_wrong
):
    """The folder is this user's, but the library or its record is not (a link to a planted file, another owner, a
    record others could rewrite): the library is rebuilt in its place, with a warning rather than the quiet note of
    a damaged library."""
    warning, untrusted = run_with_planted_library(cache, planted_library, untrust)
    assert f"{untrusted} {what_was_wrong}" in warning and "rebuilt the C kernels" in warning
    library = library_in(cache)
    assert not library.is_symlink() and library.stat().st_uid == os.geteuid() and is_recorded(library)


@pytest.fixture
def permissive_umask():
    """As in containers whose umask is 0: the modes of what is created are then exactly the ones asked for."""
    previous = os.umask(0)
    yield
    os.umask(previous)


def test_the_cache_it_creates_is_private_and_is_loaded_again_without_a_rebuild(
    tmp_path, monkeypatch, first_use, permissive_umask, caplog
):
    root = tmp_path / "not-yet" / "cache"
    monkeypatch.setenv("PEFT_NEUROADA_CACHE", str(root))
    assert products_match_torch_ops() == "cpu"
    library = library_in(root)
    created = [root, root / "kernels", library, library.with_suffix(".sha256")]
    assert [stat.S_IMODE(path.stat().st_mode) for path in created] == [0o700, 0o700, 0o755, 0o644]
    assert {path.stat().st_uid for path in created} == {os.geteuid()}
    monkeypatch.setattr(cpu, "_library", cpu._UNLOADED)
    monkeypatch.setattr(cpu, "_build", lambda *args: pytest.fail("rebuilt although cached"))
    assert products_match_torch_ops() == "cpu"
    assert not peft_neuroada_warnings(caplog)
