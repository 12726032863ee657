"""Where peft-neuroada keeps what it builds once per machine (compiled kernels, converted models).

What the cache holds is used only where no other user could have written it. The trust rule: the cache root and every
folder and file below it that is read must be owned by this user (the effective uid), not writable by group or
others, and not a symbolic link. The folders above the root are not checked (a world-writable sticky /tmp holds a
root as safely as a home folder does): everything below the root is reached through a descriptor of the root opened
once and checked, so whoever swaps a folder above it can at most point it at another folder that passes the rule
(this user's own), and once opened, that folder can only be changed by this user or the superuser.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """`$PEFT_NEUROADA_CACHE` (unless empty), else `~/.cache/peft_neuroada`: a process without a home can name one."""
    configured = os.environ.get("PEFT_NEUROADA_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "peft_neuroada"


def save_model_folder_once(target: Path, save: Callable[[Path], None]) -> None:
    """Run `save(folder)` on a new folder beside `target` and rename it into place, so that no process (the test
    suite's workers run at once) reads a half-saved model; if another process's copy got there first, keep that one
    (a model folder is complete once its config.json is in place)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        save(staging)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").exists():
            raise


class UntrustedPath(Exception):
    """A path in the cache that breaks the trust rule: another user could have written it (or could swap it)."""

    def __init__(self, path: Path, problem: str, advice: str):
        super().__init__(f"{path} {problem}")
        self.advice = advice


def open_cache_folder(*names: str) -> int:
    """A descriptor of the folder `cache_root()/names...`, each level from the root down created with mode 0700 where
    missing, opened without following a symbolic link and checked by the trust rule (raises `UntrustedPath`; `OSError`
    where it cannot be created or opened). The root's parents are created as `mkdir -p` would."""
    path = cache_root()
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = _open_or_create(str(path), path, None)
    for name in names:
        path = path / name
        try:
            below = _open_or_create(name, path, folder)
        finally:
            os.close(folder)
        folder = below
    return folder


def _open_or_create(name: str, path: Path, parent: int | None) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)
    return open_trusted(name, path, parent, folder=True)


def open_trusted(name: str, path: Path, parent: int | None, *, folder: bool = False) -> int:
    """A read-only descriptor of `name` in the folder open as `parent` (`path`: its name in messages) where it passes
    the trust rule, checked on the opened descriptor (`fstat`) so that what is checked is what is read. Raises
    `UntrustedPath`, or `OSError` (`FileNotFoundError` where it is missing)."""
    kind = "folder" if folder else "regular file"
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_DIRECTORY if folder else 0)  # a FIFO cannot hang it
    try:
        descriptor = os.open(name, flags, dir_fd=parent)
    except OSError:  # ELOOP, or ENOTDIR with O_DIRECTORY, where `name` is a symbolic link
        if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            raise UntrustedPath(path, "is a symbolic link", f"replace {path} by a {kind}") from None
        raise
    status, uid = os.fstat(descriptor), os.geteuid()
    if status.st_uid != uid:
        problem, advice = f"is owned by uid {status.st_uid}, not by this user (uid {uid})", f"remove {path}"
    elif status.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(status.st_mode):o})"
        advice = f"run `chmod go-w {path}`"
    elif stat.S_IFMT(status.st_mode) != (stat.S_IFDIR if folder else stat.S_IFREG):
        problem, advice = f"is not a {kind}", f"remove {path}"
    else:
        return descriptor
    os.close(descriptor)
    raise UntrustedPath(path, problem, advice)


def write_file(folder: int, name: str, content: bytes, mode: int) -> None:
    """`content` as `name` in the folder open as `folder`, whole or not at all (a unique temporary file renamed onto
    it), created with `mode` (less the umask). Through the descriptor, so it lands in the folder that was checked."""
    temporary = f".{name}.{uuid.uuid4().hex}.partial"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        with open(os.open(temporary, flags, mode, dir_fd=folder), "wb") as file:
            file.write(content)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=folder)
