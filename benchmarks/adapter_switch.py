"""Serving many adapters at merged speed: what switching the merged adapter costs, and what it leaves in the weights.

    python benchmarks/adapter_switch.py --model smollm2 --switches 10000
    python benchmarks/adapter_switch.py --model large-random --timed 3

Per method (NeuroAda k=1 and k=20, LoRA at each one's parameter budget), two adapters with random, trained-sized
values on the same layers. A switch unmerges the merged adapter and merges the other, as a server does between
requests for different adapters (`unmerge_adapter`, `set_adapter`, `merge_adapter`); the merged model then runs at
the base model's speed. Reported: the median time of `--timed` switches of the whole model, and the largest change of
one adapted weight (the first layer's up_proj, the largest shape) after `--switches` switches of that layer and a last
unmerge: the same arithmetic as the model's switches, layer by layer (an exact unmerge leaves 0).
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


def switch_to(model: PeftModel, name: str) -> float:
    """Seconds to unmerge the merged adapter and merge `name` instead."""
    start = time.perf_counter()
    model.unmerge_adapter()
    model.set_adapter(name)
    model.merge_adapter()
    return time.perf_counter() - start


def measure(model_name: str, config, timed: int, switches: int) -> tuple[float, float, float]:
    """Median whole-model switch time (ms); the largest change one adapter makes to one layer's weight when merged,
    and the largest change left after `switches` switches of that layer and a last unmerge."""
    torch.manual_seed(0)
    model = get_peft_model(build_model(model_name, torch.float32), config, adapter_name="first").eval()
    torch.manual_seed(1)
    model.add_adapter("second", config)
    layer = next(module for name, module in model.named_modules() if name.endswith("layers.0.mlp.up_proj"))
    weight = layer.get_base_layer().weight
    before = weight.detach().clone()
    with torch.no_grad():
        median = statistics.median(switch_to(model, ("first", "second")[i % 2]) for i in range(timed))
        model.unmerge_adapter()
        layer.merge(adapter_names=["first"])
        merged_change = (weight.detach() - before).abs().max().item()
        layer.unmerge()
        for i in range(1, switches):
            layer.merge(adapter_names=[("first", "second")[i % 2]])
            layer.unmerge()
    return median * 1000, merged_change, (weight.detach() - before).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", choices=["smollm2", "large-random", "tiny"], default="smollm2")
    parser.add_argument("--switches", type=int, default=10000, help="Switches of one layer before its weight is read.")
    parser.add_argument("--timed", type=int, default=10, help="Whole-model switches timed.")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    rows = []
    for label, config in methods(build_model(args.model, torch.float32)).items():
        median_ms, merged_change, drift = measure(args.model, config, args.timed, args.switches)
        print(f"[{label}] {median_ms:.2f} ms per switch, weight change left {drift:.3g}", file=sys.stderr)
        rows.append([label, f"{median_ms:.2f}", f"{merged_change:.3g}", f"{drift:.3g}"])
    print(f"\nmodel={args.model} timed={args.timed} switches={args.switches} threads={args.threads}\n")
    left = f"largest abs(W - W0) after {args.switches} switches"
    header = ["method", "whole-model switch (ms, median)", "largest abs(W - W0) merged", left]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
