"""Where peft-neuroada keeps what it builds or converts once per machine: the compiled C kernels, the embedded default
model as safetensors, the benchmarks' saved random models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$PEFT_NEUROADA_CACHE` (unless empty), else `~/.cache/peft_neuroada`. The home folder is looked up only for the
    latter, so a process without one can name its cache; RuntimeError (from `Path.home`) where neither is known."""
    configured = os.environ.get("PEFT_NEUROADA_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "peft_neuroada"
