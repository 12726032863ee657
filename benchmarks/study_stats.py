"""The study's paired reading, one rule for every table of matched pairs: NeuroAda's accuracy minus a peer's, per
test seed and per question, read three ways.

- The bootstrap (seeds and questions drawn with replacement, pairs kept together) says how the gap would move with
  other questions; with few seeds it cannot reach past the observed seeds' range and shrinks their variance.
- The seed-level t-interval treats each test seed's accuracy gap as one observation (n - 1 degrees of freedom): the
  honest width when seeds are few and the seed-to-seed spread dominates.
- Holm's correction over the pairs of one table keeps the chance of any false win or loss in the table at 5%. It runs
  on each reading's p-values apart, and each pair's corrected interval is that reading's interval at the level Holm
  tested it at (a rejected pair at its step's level, every other pair at the level where Holm stopped), so an interval
  excludes 0 exactly when Holm rejects. A win or a loss is read only where both corrected intervals exclude 0 on the
  same side: the seeds' spread and the questions' both have to allow it.

Where nothing separates, `detectable` is the smallest true gap both readings would find 80% of the time at the pair's
corrected levels: the seed t-test at the pair's own seed spread, the bootstrap at its resampled spread (normal
approximation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

ALPHA = 0.05
POWER = 0.8
RESAMPLES = 10_000


@dataclass(frozen=True)
class Reading:
    """One pair's gap (points, NeuroAda minus peer) and what each interval makes of it."""

    mean: float
    per_seed: tuple[float, ...]
    bootstrap: tuple[float, float]  # 95% percentile interval
    bootstrap_p: float
    bootstrap_holm_p: float  # Holm-adjusted over the table
    bootstrap_corrected: tuple[float, float]  # the percentile interval at the level Holm tested this pair at
    seed_t: tuple[float, float]  # 95% t-interval over the test seeds
    seed_p: float
    seed_holm_p: float
    seed_corrected: tuple[float, float]
    detectable: float  # the smallest gap both readings find with 80% power at their corrected levels

    @property
    def verdict(self) -> str:
        (boot_low, boot_high), (seed_low, seed_high) = self.bootstrap_corrected, self.seed_corrected
        if min(boot_low, seed_low) > 0:
            return "NeuroAda ahead"
        return "peer ahead" if max(boot_high, seed_high) < 0 else "not told apart"


def bootstrap_means(differences: np.ndarray, resamples: int = RESAMPLES) -> np.ndarray:
    """Means of a seeds x questions matrix of paired differences, each over seeds and questions drawn with
    replacement (both methods answered the same questions after training on the same examples per seed, so each draw
    keeps the pairs together)."""
    rng = np.random.default_rng(0)
    seeds, questions = differences.shape
    drawn_seeds = rng.integers(0, seeds, (resamples, seeds))
    drawn_questions = rng.integers(0, questions, (resamples, questions))
    return differences[drawn_seeds[:, :, None], drawn_questions[:, None, :]].mean(axis=(1, 2))


def percentile_interval(means: np.ndarray, alpha: float = ALPHA) -> tuple[float, float]:
    low, high = np.percentile(means, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(low), float(high)


def bootstrap_p(means: np.ndarray) -> float:
    """Two-sided: twice the share of resampled means on the far side of 0."""
    return float(min(1.0, 2 * min(np.mean(means <= 0), np.mean(means >= 0))))


def t_interval(per_seed: np.ndarray, alpha: float = ALPHA) -> tuple[float, float]:
    """The two-sided (1 - alpha) t-interval of the mean over seeds."""
    mean, error = per_seed.mean(), stats.sem(per_seed)
    if error == 0:
        return float(mean), float(mean)
    half = stats.t.ppf(1 - alpha / 2, len(per_seed) - 1) * error
    return float(mean - half), float(mean + half)


def t_p_value(per_seed: np.ndarray) -> float:
    """Two-sided p of the one-sample t-test that the mean gap over seeds is 0 (no spread: 1 at 0, else 0)."""
    if stats.sem(per_seed) == 0:
        return 1.0 if per_seed.mean() == 0 else 0.0
    return float(stats.ttest_1samp(per_seed, 0.0).pvalue)


def holm(p_values: list[float], alpha: float = ALPHA) -> tuple[list[float], list[float]]:
    """Holm's step-down over one family: each p adjusted, and the level each test is read at (a rejected one at its
    step's alpha / (m - rank), every other one at the level where the procedure stopped)."""
    m = len(p_values)
    order = np.argsort(p_values, kind="stable")
    adjusted, levels = [1.0] * m, [alpha] * m
    running, rejected = 0.0, 0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))  # adjusted p never falls down the order
        adjusted[index] = running
        if running < alpha:
            rejected += 1
            levels[index] = alpha / (m - rank)
    for index in order[rejected:]:
        levels[index] = alpha / (m - rejected)
    return adjusted, levels


def detectable_gap(per_seed: np.ndarray, alpha: float, power: float = POWER) -> float:
    """The smallest true mean gap a two-sided t-test at `alpha` finds with `power`, at this sample's spread."""
    n = len(per_seed)
    if n < 2:
        return float("inf")
    quantiles = stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)
    return float(quantiles * stats.sem(per_seed))


def bootstrap_detectable_gap(means: np.ndarray, alpha: float, power: float = POWER) -> float:
    """The same for the bootstrap: its resampled means taken as normal around the true gap."""
    return float((stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)) * means.std())


def read_family(differences: list[np.ndarray], alpha: float = ALPHA) -> list[Reading]:
    """Every pair of one table read together: each entry a seeds x questions matrix of paired differences in points."""
    per_seed = [matrix.mean(axis=1) for matrix in differences]
    seed_p = [t_p_value(gaps) for gaps in per_seed]
    seed_adjusted, seed_levels = holm(seed_p, alpha)
    means = [bootstrap_means(matrix) for matrix in differences]
    boot_p = [bootstrap_p(resampled) for resampled in means]
    boot_adjusted, boot_levels = holm(boot_p, alpha)
    return [
        Reading(
            mean=float(differences[i].mean()),
            per_seed=tuple(float(gap) for gap in per_seed[i]),
            bootstrap=percentile_interval(means[i], alpha),
            bootstrap_p=boot_p[i],
            bootstrap_holm_p=boot_adjusted[i],
            bootstrap_corrected=percentile_interval(means[i], boot_levels[i]),
            seed_t=t_interval(per_seed[i], alpha),
            seed_p=seed_p[i],
            seed_holm_p=seed_adjusted[i],
            seed_corrected=t_interval(per_seed[i], seed_levels[i]),
            detectable=max(
                detectable_gap(per_seed[i], seed_levels[i]), bootstrap_detectable_gap(means[i], boot_levels[i])
            ),
        )
        for i in range(len(differences))
    ]
