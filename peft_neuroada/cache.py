"""Where peft-neuroada keeps what it builds or converts once per machine: the compiled C kernels, the embedded default
model as safetensors, the benchmarks' saved random models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$PEFT_NEUROADA_CACHE`, else `~/.cache/peft_neuroada`."""
    return Path(os.environ.get("PEFT_NEUROADA_CACHE", Path.home() / ".cache" / "peft_neuroada"))
