"""NeuroAda against peft's Super-Tuning at equal budgets on SmolLM2-135M (the project's model): which neurons each
can move, what each saves, and whether unmerging gives the base weights back. The question a peft maintainer asks
first: is NeuroAda a selection mode of Super-Tuning?

    python benchmarks/vs_supertuning.py --json docs/upstream/supertuning.json
    python benchmarks/vs_supertuning.py --model tiny   # smoke test: a random 2-layer Llama, seconds

Both adapt the same seven projections (q/k/v/o, gate/up/down) at NeuroAda's budgets k = 1, 2, 5, 20; Super-Tuning at
the density that gives it the same number of trainable entries (`cost.variants.supertuning`, as train_cost.py and
the accuracy study set it up). Per budget:

* coverage: the share of the adapted layers' neurons (output rows) with at least one trainable entry, per projection
  and overall, and the most entries one neuron gets;
* ties: the layers whose Super-Tuning support depends on how `torch.topk` breaks ties at its threshold (entries of
  equal |w| on both sides of it; SmolLM2's weights come from a 4-bit GGUF, so equal magnitudes are common), which
  decides whether `save_precomputed_indices=False` rebuilds the same support at load;
* saved bytes per trainable parameter: the adapter_model.safetensors `save_pretrained` writes, over the trainable
  count (Super-Tuning also with `save_precomputed_indices=False`, which saves its values alone);
* unmerge (k = 1 and 20, on a float32 and a bfloat16 base): every trainable entry set to N(0, 0.01²) (the size of
  trained deltas at the study's rates), merged, unmerged; how many adapted entries differ from the base afterwards,
  and by how much at most.

Step time and peak memory are train_cost.py's (variants neuroada-k20 and supertuning-budget).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import common  # this checkout's peft_neuroada first
import torch
from cost.variants import RANDOM_CONFIGS, TARGETS, build_model, neuroada, supertuning
from peft import get_peft_model
from torch import nn

BUDGETS = (1, 2, 5, 20)
UNMERGE_BUDGETS = (1, 20)
DELTA_STD = 1e-2
METHODS = {"neuroada": neuroada, "supertuning": supertuning}


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The adapter layers by module name (both tuners' layers have `get_delta_weight` and a base layer)."""
    return {name: module for name, module in model.named_modules() if hasattr(module, "get_delta_weight")}


def set_trainable_entries(model: nn.Module, seed: int = 0) -> int:
    """Every trainable entry drawn from N(0, DELTA_STD²); returns how many there are."""
    generator = torch.Generator().manual_seed(seed)
    params = [param for param in model.parameters() if param.requires_grad]
    with torch.no_grad():
        for param in params:
            param.copy_(torch.randn(param.shape, generator=generator) * DELTA_STD)
    return sum(param.numel() for param in params)


def coverage(model: nn.Module) -> dict:
    """Neurons with at least one trainable entry, per projection and overall, and the most entries of one neuron."""
    rows, covered, most = defaultdict(int), defaultdict(int), 0
    for name, layer in adapted_layers(model).items():
        per_row = (layer.get_delta_weight("default") != 0).sum(dim=1)
        projection = name.rsplit(".", 1)[-1]
        rows[projection] += per_row.numel()
        covered[projection] += int((per_row > 0).sum())
        most = max(most, int(per_row.max()))
    shares = {projection: covered[projection] / rows[projection] for projection in sorted(rows)}
    return {"all": sum(covered.values()) / sum(rows.values()), "per_projection": shares, "most_per_neuron": most}


def tie_dependent_layers(model: nn.Module) -> float:
    """The share of Super-Tuning layers whose support `topk` had to cut through entries of equal |w|."""
    dependent, layers = 0, adapted_layers(model)
    for layer in layers.values():
        magnitude = layer.get_base_layer().weight.detach().abs().flatten()
        chosen = magnitude[layer.supertuning_indices["default"].long()]
        threshold = chosen.min()
        dependent += int((magnitude == threshold).sum() > (chosen == threshold).sum())
    return dependent / len(layers)


def saved_bytes(model: nn.Module, trainable: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return (Path(folder) / "adapter_model.safetensors").stat().st_size / trainable


def unmerge_error(model: nn.Module) -> dict:
    """Merge then unmerge: the adapted entries that differ from the base afterwards, and the largest difference."""
    layers = adapted_layers(model)
    before = {name: layer.get_base_layer().weight.detach().clone() for name, layer in layers.items()}
    model.merge_adapter()
    model.unmerge_adapter()
    changed, largest = 0, 0.0
    for name, layer in layers.items():
        difference = (layer.get_base_layer().weight.detach() - before[name]).float().abs()
        changed += int((difference > 0).sum())
        largest = max(largest, float(difference.max()))
    return {"entries_changed": changed, "largest_difference": largest}


def measure(base: nn.Module, method: str, k: int) -> dict:
    model, params, label = METHODS[method](k)(copy.deepcopy(base))
    trainable = set_trainable_entries(model)
    row = {"method": method, "k": k, "label": label, "trainable": trainable, "coverage": coverage(model)}
    row["saved_bytes_per_parameter"] = saved_bytes(model, trainable)
    if method == "supertuning":
        row["tie_dependent_layers"] = tie_dependent_layers(model)
        config = replace(model.peft_config["default"], save_precomputed_indices=False)
        values_only = get_peft_model(copy.deepcopy(base), config)
        row["saved_bytes_per_parameter_without_indices"] = saved_bytes(values_only, set_trainable_entries(values_only))
    if k in UNMERGE_BUDGETS:
        row["unmerge"] = {"float32": unmerge_error(model)}
        bf16, _, _ = METHODS[method](k)(copy.deepcopy(base).to(torch.bfloat16))
        set_trainable_entries(bf16)
        row["unmerge"]["bfloat16"] = unmerge_error(bf16)
    return row


def format_table(rows: list[dict]) -> str:
    lines = [
        "| method | k | trainable | neurons covered | most entries / neuron | saved bytes / param | unmerge: entries "
        "changed (fp32 / bf16) | largest change (fp32 / bf16) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        unmerge = row.get("unmerge", {})
        changed = " / ".join(f"{unmerge[dtype]['entries_changed']:,}" for dtype in unmerge) or "-"
        largest = " / ".join(f"{unmerge[dtype]['largest_difference']:.1e}" for dtype in unmerge) or "-"
        saved = f"{row['saved_bytes_per_parameter']:.2f}"
        if "saved_bytes_per_parameter_without_indices" in row:
            saved += f" ({row['saved_bytes_per_parameter_without_indices']:.2f} without indices)"
        lines.append(
            f"| {row['method']} | {row['k']} | {row['trainable']:,} | {100 * row['coverage']['all']:.1f}% | "
            f"{row['coverage']['most_per_neuron']} | {saved} | {changed} | {largest} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", choices=["smollm2", *RANDOM_CONFIGS], default="smollm2")
    parser.add_argument("--json", type=Path, help="Also write the rows to this file.")
    args = parser.parse_args(argv)
    base = build_model(args.model, torch.float32).requires_grad_(False)
    rows = [measure(base, method, k) for k in BUDGETS for method in METHODS]
    if args.json:
        payload = {"model": args.model, "targets": TARGETS, "delta_std": DELTA_STD, "rows": rows}
        payload["machine"] = common.machine(None)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
