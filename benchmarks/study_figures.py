"""The study's figures and tables, from committed data: accuracy against trainable parameters, NeuroAda's paired
difference against each peer at a matched budget, read by study_stats.py's rule (benchmarks/study.py's results), and
the cost of a training step at equal budget (benchmarks/train_cost.py's JSON).

    python benchmarks/study_figures.py            # docs/study/*.json -> docs/study/accuracy.png, cost.png + tables
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import common
import matplotlib
import matplotlib.ticker
import numpy as np
import study_stats

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

STUDY = common.REPO_ROOT / "docs" / "study"
# Per family, in the figures' order: how its legend names it and its budgets.
LABELS = {
    "neuroada": "NeuroAda (k = {sizes})",
    "lora": "LoRA (r = {sizes}: nearest NeuroAda's budgets)",
    "shira": "SHiRA (r = {sizes})",
    "supertuning": "Super-Tuning (NeuroAda's k = {sizes} budgets)",
    "mask": "mask-based (NeuroAda's k = {sizes} entries, dense gradients)",
    "full": "full fine-tuning",
}
TASKS = {"second_largest": "second largest of four numbers", "commonsense": "commonsense_15k (ARC-Easy, boolq)"}
# A peer's budget is matched to NeuroAda's when their trainable counts differ by at most this factor (LoRA r=3 has
# 1.18x NeuroAda k=5's count; no rank comes within it of k=1).
MATCHED = 1.25


def label(entries: list[Point]) -> str:
    return LABELS[entries[0].family].format(sizes=", ".join(str(point.size) for point in entries))


def in_budget_order(item: tuple[tuple[str, int], float]) -> tuple[int, int]:
    """Sort key of a ((family, budget), rate) item: families as LABELS lists them, then budgets upward."""
    (family, size), _ = item
    return list(LABELS).index(family), size


@dataclass(frozen=True)
class Point:
    """One budget of one method at its chosen rate: its test runs (one per seed) and what they add up to."""

    family: str
    size: int
    learning_rate: float
    runs: tuple[dict, ...]

    @property
    def trainable(self) -> int:
        return self.runs[0]["trainable"]

    @property
    def scores(self) -> list[float]:
        return [100 * run["accuracy"] for run in self.runs]

    @property
    def spread(self) -> float:
        return statistics.stdev(self.scores) if len(self.scores) > 1 else 0.0


def points(runs: list[dict]) -> dict[str, list[Point]]:
    """Per family, in the order of the budgets: each budget that has test runs at its chosen rate (its sweep's, or,
    for a budget that was not swept, the one rate all its test runs share)."""
    tested: dict[tuple[str, int], dict[float, list[dict]]] = {}
    for run in runs:
        if run["phase"] == "test":
            tested.setdefault((run["family"], run["size"]), {}).setdefault(run["learning_rate"], []).append(run)
    swept, rates = common.chosen_rates(runs), {}
    for budget, by_rate in tested.items():
        if budget in swept or len(by_rate) == 1:
            rates[budget] = swept.get(budget, next(iter(by_rate)))
    table: dict[str, list[Point]] = {}
    for (family, size), rate in sorted(rates.items(), key=in_budget_order):
        if at_rate := tested[(family, size)].get(rate):
            table.setdefault(family, []).append(Point(family, size, rate, tuple(sorted(at_rate, key=seed_of))))
    return table


def seed_of(run: dict) -> int:
    return run["seed"]


def paired_differences(ours: Point, theirs: Point) -> np.ndarray:
    """NeuroAda's answers minus the peer's, in points, seeds x questions, over the test seeds both ran: both methods
    answered the same questions after training on the same examples per seed."""
    seeds = sorted({seed_of(run) for run in ours.runs} & {seed_of(run) for run in theirs.runs})
    answered = [
        [np.array([int(c) for c in run["answered"]]) for run in point.runs if seed_of(run) in seeds]
        for point in (ours, theirs)
    ]
    return 100.0 * (np.stack(answered[0]) - np.stack(answered[1]))


def matched_pairs(table: dict[str, list[Point]]) -> list[tuple[Point, Point]]:
    """(NeuroAda, peer) at every peer budget within MATCHED of one of NeuroAda's, the nearest one."""
    pairs = []
    for family, peers in table.items():
        if family in ("neuroada", "full"):
            continue
        for peer in peers:
            nearest = min(
                table.get("neuroada", []), key=lambda ours: abs(np.log(ours.trainable / peer.trainable)), default=None
            )
            if nearest is not None and max(nearest.trainable, peer.trainable) <= MATCHED * min(
                nearest.trainable, peer.trainable
            ):
                pairs.append((nearest, peer))
    return sorted(pairs, key=lambda pair: (pair[0].size, list(LABELS).index(pair[1].family)))


Paired = tuple[Point, Point, study_stats.Reading]


def read_pairs(table: dict[str, list[Point]]) -> list[Paired]:
    """Every matched pair with its reading, Holm's correction taken over all of them (one family: the table)."""
    pairs = matched_pairs(table)
    readings = study_stats.read_family([paired_differences(ours, peer) for ours, peer in pairs])
    return [(ours, peer, reading) for (ours, peer), reading in zip(pairs, readings, strict=True)]


def accuracy_figure(table: dict[str, list[Point]], read: list[Paired], settings: dict, path: Path) -> None:
    """Left: test accuracy against trainable parameters (mean ± sd over the test seeds). Right: NeuroAda minus each
    peer at a matched budget, with both Holm-corrected intervals."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.25, 1]})
    for family, entries in table.items():
        if family == "full":  # every weight trains: a reference level, not a point hundreds of times further right
            mean, spread = statistics.mean(entries[0].scores), entries[0].spread
            left.axhspan(mean - spread, mean + spread, color="black", alpha=0.08)
            left.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"{label(entries)} (mean ± sd)")
            continue
        style = {"marker": "*", "markersize": 12, "linestyle": "none"} if len(entries) == 1 else {"marker": "o"}
        left.errorbar(
            [p.trainable for p in entries],
            [statistics.mean(p.scores) for p in entries],
            yerr=[p.spread for p in entries],
            capsize=3,
            label=label(entries),
            **style,
        )
    left.set_xscale("log")
    left.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda count, _: f"{count / 1e6:g}M"))
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel("trainable parameters (log scale)")
    left.set_ylabel("test accuracy (%)")
    left.set_title(
        f"SmolLM2-135M ({settings['dtype']}), {TASKS[settings['task']]}, {settings['steps']} steps of "
        f"{settings['batch']}: mean ± sd over {len(settings['test_seeds'])} test seeds",
        fontsize=9,
    )
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    for row, (_, _, reading) in enumerate(read):
        colour = {"NeuroAda ahead": "tab:green", "peer ahead": "tab:red"}.get(reading.verdict, "tab:gray")
        drawn = ((reading.bootstrap_corrected, -0.15, 3), (reading.seed_corrected, 0.15, 1.2))
        for (low, high), offset, width in drawn:
            right.plot([low, high], [row + offset] * 2, color=colour, linewidth=width, solid_capstyle="butt")
        right.plot([reading.mean], [row], "o", color=colour)
    right.axvline(0.0, color="black", linewidth=0.8)
    right.set_yticks(
        range(len(read)), [f"k={ours.size} vs {peer.family} {peer.size}" for ours, peer, _ in read], fontsize=8
    )
    right.invert_yaxis()
    right.set_xlabel("NeuroAda minus peer, test accuracy points")
    right.set_title(
        "matched budgets, intervals Holm-corrected over the table\nthick: bootstrap (seeds and questions); "
        "thin: t over seeds\ngreen / red: NeuroAda / the peer ahead in both; grey: neither",
        fontsize=8,
    )
    right.grid(True, axis="x", alpha=0.3)
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


def markdown(runs: list[dict], table: dict[str, list[Point]], read: list[Paired]) -> str:
    """The sweeps (dev accuracy per learning rate, the chosen one in bold), the test table and the paired
    differences, for docs/results.md; a file whose rates were swept elsewhere (the bf16 question) has no sweeps."""
    swept = any(run["phase"] == "sweep" for run in runs)
    rows = [sweep_markdown(runs), ""] if swept else []
    rows += [
        "| method | budget | trainable | learning rate | test accuracy, mean ± sd (%) | seeds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for family, entries in table.items():
        for p in entries:
            rows.append(
                f"| {family} | {p.size} | {p.trainable:,} | {p.learning_rate:.1e} | "
                f"{statistics.mean(p.scores):.1f} ± {p.spread:.1f} | {len(p.runs)} |"
            )
    rows += [
        "",
        "| NeuroAda | peer | trainable (NeuroAda / peer) | NeuroAda minus peer | per test seed | bootstrap 95% "
        "| bootstrap, Holm-corrected (p) | seed t 95% | seed t, Holm-corrected (p) | reading |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for ours, peer, reading in read:
        gaps = ", ".join(f"{gap:+.1f}" for gap in reading.per_seed)
        reading_text = reading.verdict
        if reading_text == "not told apart":
            reading_text += f" (detectable: {reading.detectable:.0f})"
        rows.append(
            f"| k={ours.size} | {peer.family} {peer.size} | {ours.trainable:,} / {peer.trainable:,} | "
            f"{reading.mean:+.1f} | {gaps} | {interval(reading.bootstrap)} | "
            f"{interval(reading.bootstrap_corrected)} ({reading.bootstrap_holm_p:.2f}) | {interval(reading.seed_t)} | "
            f"{interval(reading.seed_corrected)} ({reading.seed_holm_p:.2f}) | {reading_text} |"
        )
    return "\n".join(rows)


def sweep_markdown(runs: list[dict]) -> str:
    """Per budget, the mean dev accuracy over the sweep seeds at each learning rate, the chosen one in bold."""
    rows = ["| method | budget | dev accuracy per learning rate (mean over the sweep seeds) |", "|---|---:|---|"]
    for (family, size), rate in sorted(common.chosen_rates(runs).items(), key=in_budget_order):
        scores: dict[float, list[float]] = {}
        for run in runs:
            if run["phase"] == "sweep" and (run["family"], run["size"]) == (family, size):
                scores.setdefault(run["learning_rate"], []).append(100 * run["accuracy"])
        cells = []
        for lr, at in sorted(scores.items()):
            cell = f"{lr:.1e}: {statistics.mean(at):.1f}"
            cells.append(f"**{cell}**" if lr == rate else cell)
        rows.append(f"| {family} | {size} | {', '.join(cells)} |")
    return "\n".join(rows)


def interval(bounds: tuple[float, float]) -> str:
    return f"[{bounds[0]:+.1f}, {bounds[1]:+.1f}]"


def loss_figure(table: dict[str, list[Point]], path: Path) -> None:
    """The training loss at every step of each budget's test runs (mean over seeds, the band their range), one panel
    per NeuroAda budget with the peers matched to it: where a budget's spread comes from."""
    groups: dict[int, list[Point]] = {}
    for ours, peer in matched_pairs(table):
        groups.setdefault(ours.size, [ours]).append(peer)
    figure, panels = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 3.8), squeeze=False)
    for axes, (size, entries) in zip(panels[0], groups.items(), strict=True):
        for point in entries:
            curves = np.array([run["losses"] for run in point.runs])
            steps = np.arange(1, curves.shape[1] + 1)
            axes.plot(steps, curves.mean(axis=0), label=f"{point.family} {point.size} (lr {point.learning_rate:.2g})")
            axes.fill_between(steps, curves.min(axis=0), curves.max(axis=0), alpha=0.2)
        axes.set_yscale("log")
        axes.set_xlabel("step")
        axes.set_ylabel("training loss (log scale)")
        axes.set_title(f"NeuroAda k={size} and its matched peers: mean and range over the test seeds", fontsize=8)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def cost_markdown(table: dict[str, list[Point]]) -> str:
    """Each budget's accuracy beside what its runs measured of their cost, for a study whose runs ran in fresh
    processes (their peak memory growth over the loaded model is their own: CUDA's, or the CPU's peak RSS)."""
    on_cuda = all("step_seconds" in p.runs[0] for entries in table.values() for p in entries)
    key, clock = ("step_seconds", "s per step (wall)") if on_cuda else ("step_cpu_seconds", "CPU s per step")
    rows = [
        f"| method | budget | test accuracy, mean ± sd (%) | peak growth, mean (MiB) | {clock}, median |",
        "|---|---:|---:|---:|---:|",
    ]
    for family, entries in table.items():
        for p in entries:
            growth = statistics.mean(run["peak_growth_bytes"] for run in p.runs) / 2**20
            step = statistics.median(run[key] for run in p.runs)
            rows.append(
                f"| {family} | {p.size} | {statistics.mean(p.scores):.1f} ± {p.spread:.1f} | {growth:,.0f} | "
                f"{step:.2f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--results", type=Path, default=STUDY / "results.json")
    parser.add_argument("--cost", type=Path, help="train_cost.py's JSON (default: the study's, for its results).")
    parser.add_argument("--out", type=Path, default=STUDY, help="The folder the PNG files are written to.")
    parser.add_argument(
        "--prefix", default="", help="Put before each PNG file's name (confirm-: confirm-accuracy.png)."
    )
    args = parser.parse_args(argv)
    study = json.loads(args.results.read_text())
    table = points(study["runs"])
    if not table:  # a resumable study stopped before its test runs: where its sweeps stand
        print(sweep_markdown(study["runs"]))
        print(f"\nNo test runs in {args.results} yet: no figures, and nothing to compare.")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    read = read_pairs(table)
    accuracy_figure(table, read, study["settings"], args.out / f"{args.prefix}accuracy.png")
    runs = [run for entries in table.values() for point in entries for run in point.runs]
    if all("losses" in run for run in runs):
        loss_figure(table, args.out / f"{args.prefix}loss.png")
    cost = args.cost or (STUDY / "train_cost_smollm2.json" if args.results == STUDY / "results.json" else None)
    if cost is not None:
        cost_figure(json.loads(cost.read_text()), args.out / f"{args.prefix}cost.png")
    print(markdown(study["runs"], table, read))
    if all("peak_growth_bytes" in run for run in runs):
        print("\n" + cost_markdown(table))


if __name__ == "__main__":
    main()
