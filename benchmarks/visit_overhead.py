"""What one visit of an adapted layer costs beyond its arithmetic: a tiny layer (8 tokens, 64 -> 64) called through
PeftModel, where the per-visit Python (path choice, placement, the merged copy or the sparse products' calls) is
nearly all of the time.

    python benchmarks/visit_overhead.py                 # no-grad forward and forward + backward, 1 thread

Times are the minimum over `--rounds` rounds of `--calls` calls (the minimum is what is left of a shared machine's
noise); compare runs of two checkouts back to back, alternating, as docs/performance.md does.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch
from common import markdown_table
from peft import LoraConfig, get_peft_model
from torch import nn

from peft_neuroada import NeuroAdaConfig


class OneLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


VARIANTS: dict[str, Callable[[], nn.Module]] = {
    "frozen nn.Linear": lambda: OneLayer().requires_grad_(False),
    "neuroada k=1": lambda: get_peft_model(OneLayer(), NeuroAdaConfig(k=1, target_modules=["proj"])),
    "neuroada k=20": lambda: get_peft_model(OneLayer(), NeuroAdaConfig(k=20, target_modules=["proj"])),
    "lora r=1": lambda: get_peft_model(OneLayer(), LoraConfig(r=1, target_modules=["proj"])),
}


def fastest(call: Callable[[], object], calls: int, rounds: int) -> float:
    """Microseconds per call, the fastest round's."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def visit_times(model: nn.Module, calls: int, rounds: int) -> tuple[float, float]:
    """Microseconds of a no-grad forward and of a forward + backward."""
    x = torch.randn(8, 64)
    x_with_grad = x.clone().requires_grad_(True)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def forward_backward() -> None:
        model(x_with_grad).sum().backward()

    return fastest(forward, calls, rounds), fastest(forward_backward, max(1, calls // 3), rounds)


def measure(calls: int, rounds: int) -> list[list[str]]:
    rows = []
    for name, make in VARIANTS.items():
        no_grad, with_grad = visit_times(make(), calls, rounds)
        rows.append([name, f"{no_grad:.1f}", f"{with_grad:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = measure(args.calls, args.rounds)
    print(markdown_table(["variant", "no-grad forward (us)", "forward + backward (us)"], rows))


if __name__ == "__main__":
    main()
