"""NeuroAda adapter files that survive interrupted saves and explain damage on load.

peft writes the weights straight onto the final path, then the config: an interrupted save destroys the previous
adapter or pairs new weights with the old config, and a damaged file fails with a bare parser message. peft's calls
are routed here (`peft_compat.route_safetensors_calls`); these keep the folder's consistent pair until the config
commits the new one (atomic_file.py), for NeuroAda adapters only: other methods' files pass through unchanged.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import safetensors.torch
from peft.utils import CONFIG_NAME
from safetensors import SafetensorError

from .atomic_file import keep_previous_pair, weights_to_read, write_atomically
from .tuner.config import METHOD_NAME, PREFIX


def save_file(tensors: dict, filename: str | os.PathLike, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, atomic for NeuroAda adapters; over an existing adapter, the previous weights and
    config stay readable until the new config is written (`NeuroAdaConfig.save_pretrained` commits)."""
    if not any(f".{PREFIX}" in key for key in tensors):
        safetensors.torch.save_file(tensors, filename, metadata=metadata)
        return
    weights = Path(filename)

    def write(temporary: str) -> None:
        safetensors.torch.save_file(tensors, temporary, metadata=metadata)
        # Only once the new weights are whole: a write that fails leaves the folder as it was.
        keep_previous_pair(weights, weights.with_name(CONFIG_NAME))

    write_atomically(weights, write)


def load_file(filename: str | os.PathLike, device: str | int = "cpu") -> dict:
    """safetensors' `load_file` of the weights that belong to the folder's config (the previous ones, with a warning,
    after a save interrupted before its config); a damaged NeuroAda adapter file raises a ValueError that says what
    to do."""
    asked = Path(filename)
    weights = weights_to_read(asked, asked.with_name(CONFIG_NAME))
    if weights != asked:
        warnings.warn(
            f"The last save into '{asked.parent}' was interrupted before its {CONFIG_NAME} was written: loading the "
            f"adapter saved before it (its weights were kept as '{weights.name}'). Save the adapter again.",
            stacklevel=2,
        )
    try:
        return safetensors.torch.load_file(weights, device=device)
    except SafetensorError as error:
        if not _is_neuroada_adapter(weights.parent):
            raise
        raise ValueError(
            f"The adapter weights file '{weights}' is damaged and cannot be read ({error}). It was probably "
            "truncated by an interrupted copy or download: download or save the adapter again."
        ) from error


def _is_neuroada_adapter(directory: Path) -> bool:
    try:
        config = json.loads((directory / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("peft_type") == METHOD_NAME.upper()
