"""Files written whole or not at all, even across a crash. An adapter is two files, so a save interrupted between them
would pair new weights with the old config: the weights' save keeps the last consistent pair (`keep_previous_pair`),
the config's rename commits the new one (`commit_config`), and readers pick the weights of the config they find."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Run `write(temporary_path)` and rename the result onto `path`. The temporary file is beside `path` (renames
    cannot cross file systems), under a unique name so concurrent writers never share one."""
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
    """Before a save replaces `weights`, keep the folder's consistent pair beside them, so a save interrupted before
    its config lands still reads whole; after an interrupted save the pair kept then stays (`weights` match no config).
    The kept pair counts once both files exist: its config is removed first and written last."""
    if not (weights.is_file() and config.is_file()) or weights_to_read(weights, config) != weights:
        return
    previous_version(config).unlink(missing_ok=True)
    write_atomically(previous_version(weights), lambda temporary: _link_or_copy(weights, temporary))
    write_atomically(previous_version(config), lambda temporary: shutil.copyfile(config, temporary))


def commit_config(staged: Path, config: Path, weights: Path) -> None:
    """Rename `staged` onto `config`, committing the `weights` written before it, and drop the kept pair (before too
    when the new config equals the kept one: then readers could not tell the save from the kept pair)."""
    if _same_bytes(staged, previous_version(config)):
        _drop_previous_pair(weights, config)
    os.replace(staged, config)
    _drop_previous_pair(weights, config)


def weights_to_read(weights: Path, config: Path) -> Path:
    """The weights file of `config`: the kept one while the save replacing `weights` has not committed its config."""
    previous = previous_version(weights)
    return previous if previous.is_file() and _same_bytes(config, previous_version(config)) else weights


def _drop_previous_pair(weights: Path, config: Path) -> None:
    previous_version(config).unlink(missing_ok=True)
    previous_version(weights).unlink(missing_ok=True)


def _link_or_copy(source: Path, destination: str) -> None:
    try:
        os.link(source, destination)  # costs no space or time
    except OSError:
        shutil.copyfile(source, destination)


def _same_bytes(first: Path, second: Path) -> bool:
    try:
        return first.read_bytes() == second.read_bytes()
    except FileNotFoundError:
        return False
