"""The paper's memory claim side by side: peak training memory and step time of each method, measured by
train_cost.py on three model sizes (docs/study/memory-*.json), against `neuroada estimate` for the same set-ups and,
for LLaMA3-8B's shape, against the paper's "up to 60% memory savings" over mask-based sparse tuning.

    python benchmarks/memory_figures.py     # docs/study/memory-*.json -> docs/study/memory.png + the tables
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import common
import matplotlib
import torch
from cost.variants import RANDOM_CONFIGS
from transformers import AutoConfig, LlamaConfig, PretrainedConfig

from peft_neuroada.train.default_model import default_model_path
from peft_neuroada.train.estimate import ADAMW_IMPLEMENTATIONS, MASK_BYTES, Estimate, Estimator, weight_bytes

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

STUDY = common.REPO_ROOT / "docs" / "study"
GIB = 2**30
# train_cost.py's variant -> the estimate of the same method (None: the estimate has no such method)
VARIANTS: dict[str, Callable[[Estimator], Estimate] | None] = {
    "floor": Estimator.frozen,
    "neuroada-k1": lambda estimator: estimator.neuroada(1),
    "neuroada-k20": lambda estimator: estimator.neuroada(20),
    "paper-scatter-k20": None,
    "mask-k20": lambda estimator: estimator.mask(20),
    "lora-budget": lambda estimator: estimator.lora(20),
    "full": Estimator.full,
}
# LLaMA3-8B's shape (its config.json), estimated at the paper's batch of 2; the paper's sequence length is not stated,
# so 512 tokens stands for a GSM8K example.
LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
PAPER = "NeuroAda saves up to 60% of mask-based tuning's GPU memory on LLaMA3-8B (H100, batch 2)"
# The paper code's mask-based baseline (perCell_mag): its masks are `torch.ones_like(weight)` in bf16
# (select_para.py), its weights train in pure bf16 under the Trainer's `adamw_torch`, torch's AdamW, which keeps its
# moments in the weights' dtype and on CUDA takes the foreach path.
PAPER_BASELINE = ("bfloat16", None, "foreach")
MOMENTS = {"bf16 (the weights')": None, "float32": torch.float32}


def model_config(name: str) -> PretrainedConfig:
    return AutoConfig.from_pretrained(default_model_path()) if name == "smollm2" else RANDOM_CONFIGS[name]


def rows_of(report: dict) -> list[dict]:
    """Per measured variant: its peak (the loaded weights plus the peak growth over them: the weights are counted,
    not measured), the growth alone, step time over the frozen floor's, and the estimate of the same set-up."""
    args = report["args"]
    device = "cuda" if report["machine"].get("gpu") else "cpu"
    dtype = getattr(torch, args["dtype"])
    estimator = Estimator(model_config(args["model"]), dtype, args["batch"], args["seq_len"], None, device)
    base = weight_bytes(estimator.model, None)
    results = {result["variant"]: result for result in report["results"] if result["error"] is None}
    floor = results["floor"]["step_cpu_s"]
    rows = []
    for variant, estimate in VARIANTS.items():
        if variant not in results:
            continue
        result = results[variant]
        row = {"variant": variant, "label": result["label"], "peak": base + result["peak_growth_bytes"]}
        row |= {
            "growth": result["peak_growth_bytes"],
            "step": result["step_cpu_s"] / floor,
            "estimate": estimate(estimator).total if estimate else None,
            "base": base,
        }
        rows.append(row)
    return rows


def memory_figure(reports: dict[str, list[dict]], args: dict, path: Path) -> None:
    """Left: peak memory per method and model (bars measured, black ticks the estimate). Right: step time over the
    frozen model's."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    width = 0.8 / len(VARIANTS)
    for index, rows in enumerate(reports.values()):
        for offset, row in enumerate(rows):
            x = index + (offset - len(VARIANTS) / 2 + 0.5) * width
            colour = f"C{offset}"
            left.bar(x, row["peak"] / GIB, width, color=colour, label=row["label"] if index == 0 else None)
            if row["estimate"] is not None:
                left.plot([x - width / 2, x + width / 2], [row["estimate"] / GIB] * 2, color="black", linewidth=1.5)
            right.bar(x, row["step"], width, color=colour)
    for axes in (left, right):
        axes.set_xticks(range(len(reports)), list(reports))
        axes.grid(True, axis="y", alpha=0.3)
    left.set_ylabel("peak training memory (GiB)")
    left.set_title("measured (bars) and `neuroada estimate` (black ticks)", fontsize=9)
    left.legend(fontsize=7)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_ylabel("training step time / frozen model's")
    figure.suptitle(f"{args['dtype']}, AdamW, {args['threads']} CPU threads", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown(reports: dict[str, list[dict]], shapes: dict[str, str]) -> str:
    lines = [
        "| model | method | peak (GiB) | estimate (GiB) | estimate / peak | measured growth (GiB) "
        "| estimated growth / measured | step / floor |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, rows in reports.items():
        for row in rows:
            cells = ["-", "-", "-"]
            if row["estimate"] is not None:
                growth = (row["estimate"] - row["base"]) / row["growth"]
                cells = [f"{row['estimate'] / GIB:.2f}", f"{row['estimate'] / row['peak']:.3f}", f"{growth:.3f}"]
            lines.append(
                f"| {model} ({shapes[model]}) | {row['label']} | {row['peak'] / GIB:.2f} | {cells[0]} | {cells[1]} | "
                f"{row['growth'] / GIB:.2f} | {cells[2]} | {row['step']:.2f}x |"
            )
    lines += ["", "| model | NeuroAda k=20 peak / mask-based k=20 peak | saving |", "|---|---:|---:|"]
    for model, rows in reports.items():
        peaks = {row["variant"]: row["peak"] for row in rows}
        ratio = peaks["neuroada-k20"] / peaks["mask-k20"]
        lines.append(f"| {model} (measured) | {ratio:.3f} | {1 - ratio:.0%} |")
    estimator = Estimator(LLAMA3_8B, torch.bfloat16, 2, 512, None)
    ratio = estimator.neuroada(20).total / estimator.mask(20).total
    lines.append(f"| LLaMA3-8B shape, batch 2 x 512 (estimate, bool masks) | {ratio:.3f} | {1 - ratio:.0%} |")
    lines.append("| LLaMA3-8B (the paper) | - | up to 60% |")
    return "\n".join(lines + ["", mask_range()])


def mask_range() -> str:
    """LLaMA3-8B's shape, batch 2 x 512, bf16 weights on CUDA: mask-based k=20's estimated peak and NeuroAda k=20's
    saving against it for each mask storage, moment dtype and AdamW implementation (NeuroAda at the same AdamW), the
    paper code's own baseline in bold."""
    storages = list(MASK_BYTES)
    lines = [
        "| AdamW | moments | NeuroAda k=20 (GiB) | " + " | ".join(f"mask: {storage}" for storage in storages) + " |",
        "|---|---|---:|" + "---:|" * len(storages),
    ]
    savings = []
    for adamw in ADAMW_IMPLEMENTATIONS:
        estimator = Estimator(LLAMA3_8B, torch.bfloat16, 2, 512, None, "cuda", adamw)
        ours = estimator.neuroada(20).total
        for label, moments in MOMENTS.items():
            cells = []
            for storage in storages:
                theirs = estimator.mask(20, storage, moments).total
                savings.append(1 - ours / theirs)
                cell = f"{theirs / GIB:.2f} GiB, saves {1 - ours / theirs:.0%}"
                cells.append(f"**{cell}**" if (storage, moments, adamw) == PAPER_BASELINE else cell)
            lines.append(f"| {adamw} | {label} | {ours / GIB:.2f} | " + " | ".join(cells) + " |")
    lines.append(f"\nNeuroAda k=20 saves {min(savings):.0%}-{max(savings):.0%} of mask-based k=20's peak over these.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reports", type=Path, nargs="+", default=sorted(STUDY.glob("memory-*.json")))
    parser.add_argument("--out", type=Path, default=STUDY, help="The folder memory.png is written to.")
    args = parser.parse_args(argv)
    measured = [json.loads(path.read_text()) for path in args.reports]
    reports = {report["args"]["model"]: rows_of(report) for report in measured}
    reports = dict(sorted(reports.items(), key=lambda item: item[1][0]["peak"]))  # by the frozen model's peak
    shapes = {
        report["args"]["model"]: f"{report['args']['batch']} x {report['args']['seq_len']}" for report in measured
    }
    args.out.mkdir(parents=True, exist_ok=True)
    memory_figure(reports, measured[0]["args"], args.out / "memory.png")
    print(markdown(reports, shapes))
    print(f"\n{PAPER}")


if __name__ == "__main__":
    main()
