"""Files written whole or not at all: a reader (another process, or anyone after a crash) never sees part of one."""

from __future__ import annotations

import os
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
