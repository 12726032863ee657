"""Files written whole or not at all: a reader (another process, or anyone after a crash) never sees part of one.

An adapter is two files, its weights and its config, written one after the other, so one rename per file is not
enough: a save interrupted between them would pair the new weights with the old config. The weights' save keeps the
folder's last consistent pair beside it (`keep_previous_pair`), the config's rename commits the new pair
(`commit_config`), and a reader picks the weights that belong to the config it finds (`weights_to_read`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Run `write(temporary_path)` and move the result onto `path` in one rename, or leave `path` untouched.

    The temporary file sits beside `path` (a rename cannot cross file systems) under a name no other call uses, so
    threads and processes writing the same path at once never write into each other's file."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        write(str(temporary))
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def previous_version(path: Path) -> Path:
    """Where a save keeps the committed version of `path` until its new pair is committed."""
    return path.with_name(f".{path.name}.previous")


def keep_previous_pair(weights: Path, config: Path) -> None:
    """Before a save replaces `weights`: keep the folder's consistent (weights, config) pair beside them, so that a
    save interrupted before its config lands still reads whole (`weights_to_read`).

    An earlier interrupted save's pair is left as it is: `weights` is then that save's, which no config describes.
    The kept pair counts only once both files are there, so its config is removed first and written last."""
    if not (weights.is_file() and config.is_file()) or weights_to_read(weights, config) != weights:
        return
    previous_version(config).unlink(missing_ok=True)
    write_atomically(previous_version(weights), lambda temporary: _link_or_copy(weights, temporary))
    write_atomically(previous_version(config), lambda temporary: shutil.copyfile(config, temporary))


def commit_config(staged: Path, config: Path, weights: Path) -> None:
    """Rename `staged` onto `config`: the step that makes the `weights` written before it the folder's adapter.

    The kept pair (`keep_previous_pair`) is dropped after the rename, or before it when the new config is
    byte-identical to the kept one (repeated checkpoints of one config): there, the rename would not tell readers
    that the save is complete."""
    if _same_bytes(staged, previous_version(config)):
        _drop_previous_pair(weights, config)
    os.replace(staged, config)
    _drop_previous_pair(weights, config)


def weights_to_read(weights: Path, config: Path) -> Path:
    """The weights file that belongs to `config`: `weights`, or the kept previous one while the save that replaced
    `weights` has not committed its config yet (the folder's config is still the kept one)."""
    previous = previous_version(weights)
    if previous.is_file() and _same_bytes(config, previous_version(config)):
        return previous
    return weights


def _drop_previous_pair(weights: Path, config: Path) -> None:
    previous_version(config).unlink(missing_ok=True)
    previous_version(weights).unlink(missing_ok=True)


def _link_or_copy(source: Path, destination: str) -> None:
    """A hard link costs no space or time; a copy where the file system has none."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copyfile(source, destination)


def _same_bytes(first: Path, second: Path) -> bool:
    try:
        return first.read_bytes() == second.read_bytes()
    except FileNotFoundError:
        return False
