"""What every benchmark script shares: importing this checkout's `peft_neuroada` without installing it, the
interleaved timing loop, and the Markdown tables they print."""

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
# First on the path even where an editable install of another checkout is on it already (its .pth adds that
# checkout's root after site-packages), so a second worktree's benchmarks time that worktree's package.
sys.path[:] = [str(REPO_ROOT)] + [entry for entry in sys.path if entry != str(REPO_ROOT)]

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


def chosen_rates(runs: list[dict]) -> dict[tuple[str, int], float]:
    """Per (family, budget) of a study's records, the rate its sweep chose: the best mean dev accuracy over the sweep
    seeds (best_learning_rate's rule)."""
    swept: dict[tuple[str, int], dict[float, list[float]]] = {}
    for run in runs:
        if run["phase"] == "sweep":
            by_rate = swept.setdefault((run["family"], run["size"]), {})
            by_rate.setdefault(run["learning_rate"], []).append(run["accuracy"])
    return {
        budget: best_learning_rate({rate: sum(scores) / len(scores) for rate, scores in by_rate.items()})
        for budget, by_rate in swept.items()
    }


def machine(gpu: str | None = None) -> dict:
    """The machine a benchmark ran on, recorded with its figures: the CPU's model name, its count, and a GPU's name."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    described = {"cpu": names[0] if names else platform.machine(), "cpus": os.cpu_count()}
    return described | ({"gpu": gpu} if gpu else {})
