"""The study's figures and table, from committed data: accuracy against trainable parameters (benchmarks/study.py's
results) and the cost of a training step at equal budget (benchmarks/train_cost.py's JSON).

    python benchmarks/study_figures.py            # docs/study/*.json -> docs/study/accuracy.png, cost.png + a table
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import common
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

STUDY = common.REPO_ROOT / "docs" / "study"
LABELS = {
    "neuroada": "NeuroAda (k = 1, 2, 5, 20)",
    "lora": "LoRA (r = 1, 2, 4, 8, 16)",
    "shira": "SHiRA (r = 1, 3, 10: nearest NeuroAda's budgets)",
    "supertuning": "Super-Tuning (NeuroAda's k = 1, 2, 5, 20 budgets)",
    "full": "full fine-tuning",
}

TASKS = {"second_largest": "second largest of four numbers", "commonsense": "commonsense_15k (ARC-Easy, boolq)"}


def chosen_rate(runs: list[dict], family: str) -> float:
    """The family's learning rate, as study.py chose it: the best on the dev questions, the smaller one on a tie."""
    swept = {
        run["learning_rate"]: run["accuracy"] for run in runs if run["phase"] == "sweep" and run["family"] == family
    }
    return max(sorted(swept), key=lambda rate: swept[rate])


def summary(runs: list[dict]) -> dict[str, list[tuple[int, int, float, float, int]]]:
    """Per family, per budget: (size, trainable parameters, mean and standard deviation of the test accuracy in
    percent, seeds) at the family's chosen learning rate, in the order of the budgets."""
    table: dict[str, list[tuple[int, int, float, float, int]]] = {}
    for family in LABELS:
        if not any(run["phase"] == "sweep" and run["family"] == family for run in runs):
            continue
        rate = chosen_rate(runs, family)
        tested = [run for run in runs if (run["phase"], run["family"], run["learning_rate"]) == ("test", family, rate)]
        for size in sorted({run["size"] for run in tested}):
            scores = [100 * run["accuracy"] for run in tested if run["size"] == size]
            trainable = next(run["trainable"] for run in tested if run["size"] == size)
            spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
            table.setdefault(family, []).append((size, trainable, statistics.mean(scores), spread, len(scores)))
    return table


def accuracy_figure(table: dict, settings: dict, path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for family, rows in table.items():
        x, mean, spread = ([row[i] for row in rows] for i in (1, 2, 3))
        style = {"marker": "*", "markersize": 12, "linestyle": "none"} if family == "full" else {"marker": "o"}
        axes.errorbar(x, mean, yerr=spread, capsize=3, label=LABELS[family], **style)
    axes.set_xscale("log")
    axes.set_xlabel("trainable parameters (log scale)")
    axes.set_ylabel("test accuracy (%)")
    axes.set_title(
        f"SmolLM2-135M, {TASKS[settings['task']]}, {settings['steps']} steps of {settings['batch']}: "
        f"mean ± sd over {len(settings['seeds'])} seeds",
        fontsize=9,
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def cost_figure(cost: dict, path: Path) -> None:
    """Step time (paired, over the frozen floor) and peak memory growth of each variant of one train_cost.py run."""
    results = [r for r in cost["results"] if r["variant"] != "floor" and r["error"] is None]
    floor = next(r for r in cost["results"] if r["variant"] == "floor")
    labels = [r["label"] for r in results]
    step = [r["step_cpu_s"] / floor["step_cpu_s"] for r in results]
    memory = [r["peak_growth_bytes"] / 2**20 for r in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    left.barh(labels, step, color="tab:blue")
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_xlabel("training step time / frozen model's")
    right.barh(labels, memory, color="tab:orange")
    right.set_xlabel("peak memory growth (MiB)")
    left.invert_yaxis()
    args = cost["args"]
    figure.suptitle(f"{args['model']}, batch {args['batch']} x {args['seq_len']}, {args['dtype']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown(runs: list[dict], table: dict) -> str:
    """The sweep (dev accuracy per learning rate, the chosen one in bold) and the test table, for docs/results.md."""
    rows = ["| method | sweep budget | dev accuracy per learning rate |", "|---|---:|---|"]
    for family in table:
        swept = sorted(
            (run for run in runs if run["phase"] == "sweep" and run["family"] == family),
            key=lambda run: run["learning_rate"],
        )
        rate = chosen_rate(runs, family)
        cells = [f"{run['learning_rate']:.0e}: {100 * run['accuracy']:.1f}" for run in swept]
        cells = [
            f"**{cell}**" if run["learning_rate"] == rate else cell for cell, run in zip(cells, swept, strict=True)
        ]
        rows.append(f"| {family} | {swept[0]['size']} | {', '.join(cells)} |")
    rows += ["", "| method | size | trainable | test accuracy, mean ± sd (%) | seeds |", "|---|---:|---:|---:|---:|"]
    for family, entries in table.items():
        for size, trainable, mean, spread, seeds in entries:
            rows.append(f"| {family} | {size} | {trainable:,} | {mean:.1f} ± {spread:.1f} | {seeds} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--results", type=Path, default=STUDY / "results.json")
    parser.add_argument("--cost", type=Path, default=STUDY / "train_cost_smollm2.json")
    parser.add_argument("--out", type=Path, default=STUDY, help="The folder the PNG files are written to.")
    args = parser.parse_args(argv)
    study = json.loads(args.results.read_text())
    table = summary(study["runs"])
    args.out.mkdir(parents=True, exist_ok=True)
    accuracy_figure(table, study["settings"], args.out / "accuracy.png")
    if args.cost.exists():
        cost_figure(json.loads(args.cost.read_text()), args.out / "cost.png")
    print(markdown(study["runs"], table))


if __name__ == "__main__":
    main()
