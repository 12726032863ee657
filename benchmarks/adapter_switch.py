"""Serving many adapters at merged speed: what switching the merged adapter costs, and what it leaves in the weights.

    python benchmarks/adapter_switch.py --model smollm2 --switches 10000
    python benchmarks/adapter_switch.py --model large-random --switches 1000

Per method (NeuroAda k=1 and k=20, LoRA at each one's parameter budget), two adapters with random, trained-sized
values on the same layers. A switch unmerges the merged adapter and merges the other, as a server does between
requests for different adapters (`unmerge_adapter`, `set_adapter`, `merge_adapter`); the merged model then runs at
the base model's speed. Reported: the median switch time, and the largest difference of any adapted weight from its
value before the first merge once the last adapter is unmerged again (an exact unmerge leaves 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
from common import markdown_table
from cost.variants import BUDGET_K, TARGETS, budget_rank, build_model
from peft import LoraConfig, PeftModel, get_peft_model

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.budget import lora_rank_for_k, targeted_shapes


def methods(model: torch.nn.Module) -> dict[str, object]:
    """NeuroAda k=1 and k=BUDGET_K, and LoRA at the rank of each one's parameter count."""
    rank_for_k1 = lora_rank_for_k(targeted_shapes(model, NeuroAdaConfig(k=1, target_modules=TARGETS)), 1)
    return {
        "neuroada k=1": NeuroAdaConfig(k=1, target_modules=TARGETS, init_weights=False),
        f"lora r={rank_for_k1}": LoraConfig(r=rank_for_k1, target_modules=TARGETS, init_lora_weights=False),
        f"neuroada k={BUDGET_K}": NeuroAdaConfig(k=BUDGET_K, target_modules=TARGETS, init_weights=False),
        f"lora r={budget_rank(model)}": LoraConfig(
            r=budget_rank(model), target_modules=TARGETS, init_lora_weights=False
        ),
    }


def adapted_weights(model: PeftModel) -> list[torch.Tensor]:
    return [module.get_base_layer().weight for module in model.base_model.model.modules() if hasattr(module, "merge")]


def switch_to(model: PeftModel, name: str) -> float:
    """Seconds to unmerge the merged adapter and merge `name` instead."""
    start = time.perf_counter()
    model.unmerge_adapter()
    model.set_adapter(name)
    model.merge_adapter()
    return time.perf_counter() - start


def measure(model_name: str, config, switches: int) -> tuple[float, float]:
    """Median switch time (ms) and the largest weight difference after `switches` switches and a last unmerge."""
    torch.manual_seed(0)
    model = get_peft_model(build_model(model_name, torch.float32), config, adapter_name="first").eval()
    torch.manual_seed(1)
    model.add_adapter("second", config)
    before = [weight.detach().clone() for weight in adapted_weights(model)]
    with torch.no_grad():
        times = [switch_to(model, ("first", "second")[i % 2]) for i in range(switches)]
        model.unmerge_adapter()
    drift = max(
        (weight.detach() - kept).abs().max().item()
        for weight, kept in zip(adapted_weights(model), before, strict=True)
    )
    return statistics.median(times) * 1000, drift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", choices=["smollm2", "large-random", "tiny"], default="smollm2")
    parser.add_argument("--switches", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    rows = []
    for label, config in methods(build_model(args.model, torch.float32)).items():
        median_ms, drift = measure(args.model, config, args.switches)
        print(f"[{label}] {median_ms:.2f} ms per switch, largest weight difference {drift:.3g}", file=sys.stderr)
        rows.append([label, f"{median_ms:.2f}", f"{drift:.3g}"])
    print(f"\nmodel={args.model} switches={args.switches} threads={args.threads} torch={torch.__version__}\n")
    print(markdown_table(["method", "switch (ms, median)", f"largest abs(W - W0) after {args.switches}"], rows))


if __name__ == "__main__":
    main()
