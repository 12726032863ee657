"""The study's confirmatory runs (issue 53): more power where the first study's claims were made, and the paper's
Question 1 asked in bf16.

    python benchmarks/study_confirm.py                 # parts 1 and 2, resumable, into docs/study/confirm.json
    python benchmarks/study_figures.py --results docs/study/confirm.json --prefix confirm-
    python benchmarks/study_figures.py --results docs/study/confirm-bf16.json --prefix confirm-bf16-
    python benchmarks/study_confirm.py --parts bf16 --bf16-device cuda   # part 3 on a GPU (benchmarks/gpu.sh)
    python benchmarks/study_confirm.py --dry-run --results-dir /tmp/confirm   # a tiny random model: the suite's check

1. Sweep: NeuroAda k=5 and k=20 and their matched peers (LoRA r=3/10, SHiRA r=3/10, Super-Tuning k=5/20, mask-based
   k=20), each at the rate the first study chose for it (docs/study/results.json) and at half and twice it, on two
   sweep seeds (their mean dev accuracy scores a rate); while the best rate is on the grid's edge, the next factor
   of 2 beyond it is tried too. Neither seed is one of the first study's.
2. Test: each budget at its rate, five test seeds, on 512 test questions drawn with a new salt, none of them a dev or
   test question of the first study (a question no earlier reading has seen).
3. bf16: NeuroAda k=20 (deltas in bf16, as the paper code keeps them) against mask-based k=20 (dense bf16 weights,
   gradients masked), both selecting by the tuner's rule with its stable tie order, at NeuroAda k=20's rate from 1,
   on the same five test seeds and questions; each run in a fresh process, so its peak memory is its own. On a CPU
   without native bf16 a run takes 7x an fp32 one: `--bf16-device cuda` runs this part on a GPU.

Every run records its loss at every step and its median step time (CPU seconds on the CPU, wall seconds on a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import common  # this checkout's peft_neuroada first
import torch
from cost import variants
from study import FAMILIES, RESULTS, STUDIES, Family, GeneratedTask, Settings, Study, draw_questions, dry_run
from transformers import PreTrainedTokenizerBase

FILES = {
    dtype: RESULTS["cpu"].with_name(name)
    for dtype, name in (("float32", "confirm.json"), ("bfloat16", "confirm-bf16.json"))
}
# The budgets whose claims the first study made: NeuroAda's k=5 and k=20 and every peer matched to them.
BUDGETS = {"neuroada": (5, 20), "lora": (3, 10), "shira": (3, 10), "supertuning": (5, 20), "mask": (20,)}
BF16_ARMS = (("neuroada", 20), ("mask", 20))
GRID_STEP = 2.0  # neighbours at most 2x away on both sides of a chosen rate
TOP_RATE = 1.0


@dataclass(frozen=True)
class ConfirmSettings(Settings):
    """The first study's settings, plus what makes these runs new: the further sweep seeds, the salt the test
    questions are drawn with, and the deltas' dtype (None: peft's choice)."""

    more_sweep_seeds: tuple[int, ...] = ()
    test_salt: str = "confirm-test"
    delta_dtype: str | None = None


FIRST = STUDIES["cpu"]
SETTINGS = {
    "float32": ConfirmSettings(
        **(vars(FIRST) | {"test_questions": 512, "sweep_seed": 4, "test_seeds": (6, 7, 8, 9, 10)}),
        more_sweep_seeds=(5,),
    )
}
SETTINGS["bfloat16"] = replace(SETTINGS["float32"], dtype="bfloat16", delta_dtype="bfloat16")


def confirm_dry_run(settings: ConfirmSettings) -> ConfirmSettings:
    """The same runs on study.py's tiny random model, in the settings' dtype: a few steps and questions, two test
    seeds."""
    return replace(dry_run(settings), dtype=settings.dtype, test_seeds=(6, 7))


class FreshTask(GeneratedTask):
    """The first study's task and dev questions; test questions drawn with the settings' salt, leaving out every dev
    and test question of the first study."""

    def __init__(self, settings: ConfirmSettings, tokenizer: PreTrainedTokenizerBase) -> None:
        self.earlier = {
            prompt
            for split, count in (("dev", FIRST.dev_questions), ("test", FIRST.test_questions))
            for prompt, _ in draw_questions(f"study-{split}", count)
        }
        super().__init__(settings, tokenizer)

    def questions(self, split: str, count: int) -> list[tuple[str, str]]:
        if split == "dev":
            return super().questions(split, count)
        drawn = draw_questions(self.settings.test_salt, count + len(self.earlier))
        return [question for question in drawn if question[0] not in self.earlier][:count]


class ConfirmStudy(Study):
    """A results file of the confirmatory runs: sweeps around the first study's rates on several seeds, tests on the
    fresh questions, NeuroAda's deltas in the settings' dtype."""

    def __init__(self, path: Path, settings: ConfirmSettings, centres: dict[tuple[str, int], float]) -> None:
        super().__init__(path, settings)
        self.centres = centres
        neuroada = replace(
            FAMILIES["neuroada"], build=lambda model, k, seed: variants.neuroada(k, settings.delta_dtype)(model)
        )
        self.families: dict[str, Family] = FAMILIES | {"neuroada": neuroada}
        self.isolated = settings.dtype == "bfloat16"  # the arm that compares peak memory

    @cached_property
    def task(self) -> FreshTask:
        return FreshTask(self.settings, self.tokenizer)

    def sweep_seeds(self) -> tuple[int, ...]:
        return (self.settings.sweep_seed, *self.settings.more_sweep_seeds)

    def first_rates(self, family: str, size: int) -> list[float]:
        centre = self.centres[(family, size)]
        return [rate for rate in (centre / GRID_STEP, centre, centre * GRID_STEP) if rate <= TOP_RATE]

    def beyond(self, rate: float, step: int) -> float | None:
        further = float(f"{rate * GRID_STEP**step:.6g}")
        return further if further <= TOP_RATE else None

    def arguments(self) -> tuple:
        return self.path, self.settings, self.centres


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--results-dir", type=Path, help="Where confirm.json and confirm-bf16.json go (docs/study/).")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("sweep", "bf16", "test"),
        default=["sweep", "test"],
        help="sweep and test by default; bf16 when named (its runs are recorded with the device they ran on).",
    )
    parser.add_argument("--families", nargs="+", choices=list(BUDGETS), default=list(BUDGETS))
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads.")
    parser.add_argument(
        "--bf16-device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="Where the bf16 part runs: cuda on a GPU, or on a CPU with native bf16 (the fp32 parts run on the CPU, "
        "where their sweeps ran).",
    )
    parser.add_argument("--dry-run", action="store_true", help="A tiny random model on the CPU.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    centres = common.chosen_rates(json.loads(RESULTS["cpu"].read_text())["runs"])
    settings = {dtype: confirm_dry_run(s) if args.dry_run else s for dtype, s in SETTINGS.items()}
    settings["bfloat16"] = replace(settings["bfloat16"], device=args.bf16_device)
    paths = {dtype: (args.results_dir or FILES[dtype].parent) / FILES[dtype].name for dtype in FILES}
    wanted = ["float32"] + (["bfloat16"] if "bf16" in args.parts else [])
    studies = {dtype: ConfirmStudy(paths[dtype], settings[dtype], centres) for dtype in wanted}
    budgets = [(family, size) for family in args.families for size in BUDGETS[family]]
    if "bf16" in args.parts:
        rate = studies["float32"].learning_rate("neuroada", 20)
        for family, size in BF16_ARMS:
            for seed in settings["bfloat16"].test_seeds:
                studies["bfloat16"].run("test", family, size, rate, seed)
    # Budget by budget, its sweep (unless recorded already) and then its test runs: a run stopped part-way leaves
    # whole budgets to compare.
    for budget in budgets if {"sweep", "test"} & set(args.parts) else []:
        rate = studies["float32"].learning_rate(*budget)
        for seed in settings["float32"].test_seeds if "test" in args.parts else []:
            studies["float32"].run("test", *budget, rate, seed)
    minutes = math.ceil((time.perf_counter() - started) / 60)
    print(f"confirmatory runs done in {minutes} min; results in {', '.join(map(str, paths.values()))}")


if __name__ == "__main__":
    main()
