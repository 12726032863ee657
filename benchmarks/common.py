"""What every benchmark script shares: importing this checkout's `peft_neuroada` without installing it (with
`PLAIN_PATH=1` in the environment, without its accelerators), the interleaved timing loop, and the Markdown tables
they print."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


class _HideAccelerators:
    """`PLAIN_PATH=1`: `peft_neuroada.accel` cannot be imported, so every layer runs the tuner's plain path."""

    def find_spec(self, name: str, path=None, target=None):
        if name == "peft_neuroada.accel" or name.startswith("peft_neuroada.accel."):
            raise ModuleNotFoundError(f"No module named {name!r} (PLAIN_PATH=1)")
        return None


if os.environ.get("PLAIN_PATH") == "1":
    sys.meta_path.insert(0, _HideAccelerators())

Samples = dict[str, tuple[list[float], list[float]]]


def interleaved_samples(
    calls: dict[str, Callable[[], object]],
    repeats: int,
    sync: Callable[[], None] = lambda: None,
    seed: int = 0,
    setups: Mapping[str, Callable[[], AbstractContextManager]] | None = None,
) -> Samples:
    """Wall and process-CPU seconds of every call of each of `calls`, per name, timed round-robin so that load from
    other jobs on the machine hits every candidate alike. Each round runs the calls in a new (seeded) order: in a fixed
    order, the call after a large matmul measured up to 3x slower on a 2-vCPU VM. `sync` runs before and after each
    call (CUDA: time the kernels, not their launches). CPU time is far less disturbed by other jobs than wall time.
    `setups[name]()` is a context entered before that call's clock starts and left after it stops (e.g. a mode switch
    that is not part of what is measured)."""
    samples: Samples = {name: ([], []) for name in calls}
    setups = setups or {}
    order = random.Random(seed)
    for _ in range(repeats):
        for name, fn in order.sample(list(calls.items()), len(calls)):
            with setups.get(name, contextlib.nullcontext)():
                sync()
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                fn()
                sync()
                samples[name][0].append(time.perf_counter() - start_wall)
                samples[name][1].append(time.process_time() - start_cpu)
    return samples


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def best_learning_rate(scores: Mapping[float, float]) -> float:
    """A sweep's choice, the study's and its figures' alike: the rate that scores best, the smaller one on a tie."""
    return max(sorted(scores), key=lambda rate: scores[rate])


def machine(gpu: str | None = None) -> dict:
    """The machine a benchmark ran on, recorded with its figures: the CPU's model name, its count, and a GPU's name."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    described = {"cpu": names[0] if names else platform.machine(), "cpus": os.cpu_count()}
    return described | ({"gpu": gpu} if gpu else {})
