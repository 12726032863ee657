"""NeuroAda adapter files that survive interrupted saves and explain damage on load.

peft writes adapter weights with safetensors' `save_file` straight onto the final path and reads them with
`load_file`, so a save interrupted mid-write destroys the previous adapter, and a damaged file fails with a bare
parser message. Importing `peft_neuroada` routes both of peft's calls through the wrappers below, narrowly:

* only NeuroAda adapters are affected: other methods' tensors go to safetensors' own `save_file` unchanged, and their
  load errors propagate unchanged;
* `install` replaces a function only where peft still holds safetensors' own one (`peft.peft_model.safe_save_file`,
  `peft.utils.save_and_load.safe_load_file`); if peft's internals move, it changes nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import peft.peft_model
import peft.utils.save_and_load
import safetensors.torch
from safetensors import SafetensorError

from .atomic_file import write_atomically
from .config import METHOD_NAME, PREFIX


def save_file(tensors: dict, filename: str | os.PathLike, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, atomic for NeuroAda adapters."""
    if not any(f".{PREFIX}" in key for key in tensors):
        safetensors.torch.save_file(tensors, filename, metadata=metadata)
        return
    write_atomically(filename, lambda temporary: safetensors.torch.save_file(tensors, temporary, metadata=metadata))


def load_file(filename: str | os.PathLike, device: str | int = "cpu") -> dict:
    """safetensors' `load_file`; a damaged NeuroAda adapter file raises a ValueError that says what to do."""
    try:
        return safetensors.torch.load_file(filename, device=device)
    except SafetensorError as error:
        if not _is_neuroada_adapter(Path(filename).parent):
            raise
        raise ValueError(
            f"The adapter weights file '{filename}' is damaged and cannot be read ({error}). It was probably "
            "truncated by an interrupted copy or download: download or save the adapter again."
        ) from error


def _is_neuroada_adapter(directory: Path) -> bool:
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("peft_type") == METHOD_NAME.upper()


def install() -> None:
    """Route peft's adapter-file calls through `save_file` / `load_file` where peft still holds safetensors' own."""
    if getattr(peft.peft_model, "safe_save_file", None) is safetensors.torch.save_file:
        peft.peft_model.safe_save_file = save_file
    if getattr(peft.utils.save_and_load, "safe_load_file", None) is safetensors.torch.load_file:
        peft.utils.save_and_load.safe_load_file = load_file
