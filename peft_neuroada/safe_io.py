"""Adapter files that survive interrupted saves and explain damage on load.

peft writes adapter weights with safetensors' `save_file` straight onto the final path and reads them with
`load_file`, so a save interrupted mid-write destroys the previous adapter, and a damaged file fails with a bare
parser message. Importing `peft_neuroada` routes both calls through the wrappers below. This applies to every peft
method, because the behaviour is strictly safer: same files, same format, written to a temporary name and renamed
into place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import peft.peft_model
import peft.utils.save_and_load
import safetensors.torch
from safetensors import SafetensorError


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Run `write(temporary_path)` and move the result onto `path` in one rename, or leave `path` untouched."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write(str(temporary))
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def save_file_atomically(tensors: dict, filename: str | os.PathLike, metadata: dict | None = None) -> None:
    write_atomically(filename, lambda temporary: safetensors.torch.save_file(tensors, temporary, metadata=metadata))


def load_file_explained(filename: str | os.PathLike, device: str | int = "cpu") -> dict:
    try:
        return safetensors.torch.load_file(filename, device=device)
    except SafetensorError as error:
        raise ValueError(
            f"The adapter weights file '{filename}' is damaged and cannot be read ({error}). It was probably "
            "truncated by an interrupted copy or download: download or save the adapter again."
        ) from error


def install() -> None:
    """Make peft save adapter weights atomically and explain damaged adapter files (idempotent)."""
    peft.peft_model.safe_save_file = save_file_atomically
    peft.utils.save_and_load.safe_load_file = load_file_explained
