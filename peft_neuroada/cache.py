"""Where peft-neuroada keeps what it builds once per machine (compiled kernels, converted models)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$PEFT_NEUROADA_CACHE` (unless empty), else `~/.cache/peft_neuroada`: a process without a home can name one."""
    configured = os.environ.get("PEFT_NEUROADA_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "peft_neuroada"
