"""The training-cost report: one table row per variant and the issue's targets checked against them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from common import markdown_table

from .measurement import Result
from .meters import MIB

# ------------------------------------------------------------------------------------------------ reporting


def _ratio(value: float, floor: float) -> str:
    return f"{value / floor:.2f}x" if floor and value == value and floor == floor else "-"


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds == seconds else "-"


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.1f}" if tokens_per_s == tokens_per_s else "-"


def format_table(results: list[Result], clock: str) -> str:
    """One row per variant; `clock` ("cpu" or "wall") is the time the ratios to the floor are taken on. Generation is
    reported as new tokens per second (wall clock), and its ratios as the variant's rate over the floor's (below 1:
    slower than the frozen model), the floor's time over the variant's on `clock`."""
    floor = next(r for r in results if r.variant == "floor")
    step, infer = f"step_{clock}_s", f"infer_{clock}_s"
    header = [
        "variant",
        "trainable params",
        "step wall (ms)",
        "step CPU (ms)",
        f"step / floor ({clock})",
        "step / paired floor",
        "peak growth (MiB)",
        "peak / floor",
        "saved for bwd (MiB)",
        "grads + optim (MiB)",
        "accounted / floor",
        f"infer fwd {clock} (ms)",
        "infer / floor",
        "infer / paired base",
        "gen tok/s (wall)",
        f"gen tok/s / floor ({clock})",
        "gen tok/s / paired base",
    ]
    rows = []
    for r in results:
        if r.error:
            rows.append([r.label or r.variant, f"error: {r.error}"] + [""] * (len(header) - 2))
            continue
        rows.append(
            [
                r.label,
                f"{r.trainable_params:,}",
                _ms(r.step_wall_s),
                _ms(r.step_cpu_s),
                _ratio(getattr(r, step), getattr(floor, step)),
                _ratio(r.paired_ratio("step", clock), 1.0),
                _mib(r.peak_growth_bytes),
                _ratio(r.peak_growth_bytes, floor.peak_growth_bytes),
                _mib(r.saved_bytes),
                _mib(r.grad_bytes + r.optimizer_bytes),
                _ratio(r.accounted_bytes, floor.accounted_bytes),
                _ms(getattr(r, infer)),
                _ratio(getattr(r, infer), getattr(floor, infer)),
                _ratio(r.paired_ratio("infer", clock), 1.0),
                _rate(r.tokens_per_s("wall")),
                _ratio(r.tokens_per_s(clock), floor.tokens_per_s(clock)),
                _ratio(1.0, r.paired_ratio("gen", clock)),
            ]
        )
    return markdown_table(header, rows)


@dataclass(frozen=True)
class Target:
    """One of the issue's acceptance targets: `metric` of variant `a` over that of `b` must be <= `limit`."""

    description: str
    metric: str  # a Result attribute; "step" and "infer" mean the chosen clock's time
    a: str
    b: str
    limit: float

    def ratio(self, results: dict[str, Result], clock: str) -> float:
        """The ratio across the two variants' processes."""
        metric = f"{self.metric}_{clock}_s" if self.metric in ("step", "infer") else self.metric
        return getattr(results[self.a], metric) / getattr(results[self.b], metric)

    def paired_ratio(self, results: dict[str, Result], clock: str) -> float:
        """The in-process paired ratio, for time targets against the floor (NaN where there is none)."""
        if self.b != "floor" or self.metric not in ("step", "infer"):
            return float("nan")
        return results[self.a].paired_ratio(self.metric, clock)


ISSUE_TARGETS = [
    Target("neuroada k=1 step <= 1.05x floor", "step", "neuroada-k1", "floor", 1.05),
    Target("neuroada k=20 step <= 1.10x floor", "step", "neuroada-k20", "floor", 1.10),
    Target("neuroada k=20 step <= LoRA at equal budget", "step", "neuroada-k20", "lora-budget", 1.0),
    Target("neuroada k=1 peak growth <= 1.05x floor", "peak_growth_bytes", "neuroada-k1", "floor", 1.05),
    Target("neuroada k=20 peak growth <= 1.05x floor", "peak_growth_bytes", "neuroada-k20", "floor", 1.05),
    Target("neuroada k=20 peak growth <= LoRA at equal budget", "peak_growth_bytes", "neuroada-k20", "lora-budget", 1),
    Target("neuroada k=20 peak growth <= 0.6x mask-based", "peak_growth_bytes", "neuroada-k20", "mask-k20", 0.6),
    Target("neuroada k=20 >= 1.3x faster than SHiRA", "step", "neuroada-k20", "shira-budget", 1 / 1.3),
    Target(
        "neuroada k=20 >= 1.3x faster than paper scatter_add", "step", "neuroada-k20", "paper-scatter-k20", 1 / 1.3
    ),
    Target("neuroada k=1 unmerged inference fwd <= 1.05x base", "infer", "neuroada-k1", "floor", 1.05),
]


def check_targets(results: list[Result], clock: str) -> list[dict[str, object]]:
    """Each issue target with its measured ratio(s); targets whose variants were not run or failed, or whose metric
    was not measured (inference with `--infer-steps 0`), are left out.

    A target against the floor is judged on the paired in-process ratio when there is one (it is the robust one).
    """
    by_name = {r.variant: r for r in results if not r.error}
    checks = []
    for target in ISSUE_TARGETS:
        if target.a in by_name and target.b in by_name:
            ratio, paired = target.ratio(by_name, clock), target.paired_ratio(by_name, clock)
            if math.isnan(ratio):
                continue
            judged = ratio if math.isnan(paired) else paired
            checks.append(
                {
                    "target": target.description,
                    "ratio": ratio,
                    "paired_ratio": paired,
                    "limit": target.limit,
                    "holds": judged <= target.limit,
                }
            )
    return checks


def format_checks(checks: list[dict[str, object]]) -> str:
    rows = [
        [
            c["target"],
            f"{c['ratio']:.3f}",
            "-" if math.isnan(c["paired_ratio"]) else f"{c['paired_ratio']:.3f}",
            f"{c['limit']:.3f}",
            "yes" if c["holds"] else "NO",
        ]
        for c in checks
    ]
    return markdown_table(["target", "ratio (separate processes)", "paired ratio", "limit", "holds"], rows)
