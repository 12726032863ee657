"""The accuracy study (benchmarks/study.py) and its figures: every budget of every method gets its own swept learning
rate, tests run on seeds the sweep never used, and NeuroAda is compared with each peer at a matched budget through
a paired bootstrap interval."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.shared_data import shared_datasets

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _study(*arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "study.py"), "--threads", "1", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def _benchmark_module(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_every_budget_is_swept_and_tested_on_other_seeds_and_a_rerun_trains_nothing(tmp_path: Path) -> None:
    results = tmp_path / "study.json"
    completed = _study("--dry-run", "--results", str(results))
    assert completed.returncode == 0, completed.stderr[-3000:]
    saved = json.loads(results.read_text())
    settings, runs = saved["settings"], saved["runs"]
    assert settings["sweep_seed"] not in settings["test_seeds"]
    for family in ("neuroada", "lora", "shira", "supertuning", "mask", "full"):
        tested = [run for run in runs if run["family"] == family and run["phase"] == "test"]
        assert tested and all(run["trainable"] > 0 and 0 <= run["accuracy"] <= 1 for run in tested)
        for size in {run["size"] for run in tested}:
            swept = [run for run in runs if (run["family"], run["size"], run["phase"]) == (family, size, "sweep")]
            assert len({run["learning_rate"] for run in swept}) == len(swept) >= 4
            assert {run["seed"] for run in swept} == {settings["sweep_seed"]}
            at_size = [run for run in tested if run["size"] == size]
            assert sorted(run["seed"] for run in at_size) == settings["test_seeds"]
            assert len({run["learning_rate"] for run in at_size}) == 1
            assert all(len(run["answered"]) == run["questions"] for run in at_size)
    again = _study("--dry-run", "--results", str(results))
    assert again.returncode == 0 and "sweep " not in again.stdout and "test " not in again.stdout, again.stdout
    assert json.loads(results.read_text())["runs"] == runs
    figures = [sys.executable, str(BENCHMARKS / "study_figures.py"), "--results", str(results), "--out", str(tmp_path)]
    drawn = subprocess.run(figures, capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0 and (tmp_path / "accuracy.png").stat().st_size > 0, drawn.stderr[-3000:]
    assert all(f"| {family} |" in drawn.stdout for family in ("neuroada", "lora", "mask", "full"))
    assert "| k=20 | mask 20 |" in drawn.stdout


@pytest.mark.parametrize(
    ("peak", "tried"),
    [
        (3e-4, {1e-3, 3e-3, 1e-2, 3e-2, 3e-4, 1e-4}),  # below the grid: two steps down, the second one worse
        (1e-2, {1e-3, 3e-3, 1e-2, 3e-2}),  # inside it: the grid alone
        (3.0, {1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0}),  # above it: up to the ladder's top
    ],
)
def test_a_sweep_goes_beyond_its_grid_while_the_best_rate_is_on_its_edge(peak, tried, monkeypatch) -> None:
    study = _benchmark_module("study")
    asked = []

    def run(self, phase, family, size, learning_rate, seed):
        asked.append(learning_rate)
        return {"accuracy": 1.0 / (1.0 + abs(study.math.log(learning_rate / peak)))}

    monkeypatch.setattr(study.Study, "run", run)
    sweep = study.Study.__new__(study.Study)
    sweep.settings = study.STUDIES["cpu"]
    best = sweep.learning_rate("lora", 3)
    assert set(asked) == tried and len(asked) == len(tried)
    assert best == min(tried, key=lambda rate: abs(study.math.log(rate / peak)))


def test_a_sweep_with_every_rate_tied_stays_on_its_grid(monkeypatch) -> None:
    study = _benchmark_module("study")
    monkeypatch.setattr(study.Study, "run", lambda self, *key: {"accuracy": 0.0})
    sweep = study.Study.__new__(study.Study)
    sweep.settings = study.STUDIES["cpu"]
    assert sweep.learning_rate("neuroada", 1) == 3e-3  # the smallest on a tie, and no step below it


def _point(figures, family: str, answered: list[str]):
    runs = tuple(
        {"seed": seed, "answered": text, "accuracy": text.count("1") / len(text), "trainable": 100}
        for seed, text in enumerate(answered, start=1)
    )
    return figures.Point(family, 1, 1e-2, runs)


def test_the_paired_difference_is_the_mean_gap_and_its_interval_reads_only_what_the_pairs_support() -> None:
    figures = _benchmark_module("study_figures")
    ours = _point(figures, "neuroada", ["1111111111" * 4, "1111111110" * 4, "1111111100" * 4])
    theirs = _point(figures, "lora", ["1111111100" * 4, "1111111000" * 4, "1111110000" * 4])
    mean, low, high = figures.paired_difference(ours, theirs)
    assert mean == pytest.approx(20.0) and 0 < low < mean < high
    assert figures.verdict(low, high) == "NeuroAda ahead"
    assert figures.verdict(*figures.paired_difference(theirs, ours)[1:]) == "peer ahead"
    split = _point(figures, "neuroada", ["1111100000" * 4] * 3)
    other_half = _point(figures, "lora", ["0000011111" * 4] * 3)
    mean, low, high = figures.paired_difference(split, other_half)
    assert mean == 0 and low < 0 < high and figures.verdict(low, high) == "not told apart"


def test_the_study_scale_up_trains_on_commonsense_and_scores_arc_easy_and_boolq(tmp_path: Path) -> None:
    """`--device cuda` is the paper-protocol scale-up; its dry run is the same study on the tiny model, on the CPU."""
    shared_datasets()
    results = tmp_path / "study.json"
    completed = _study("--dry-run", "--device", "cuda", "--families", "neuroada", "--results", str(results))
    assert completed.returncode == 0, completed.stderr[-3000:]
    saved = json.loads(results.read_text())
    assert (saved["settings"]["task"], saved["settings"]["device"]) == ("commonsense", "cpu")
    questions = {run["phase"]: run["questions"] for run in saved["runs"]}
    assert questions == {"sweep": 4, "test": 8}, "4 dev examples; 4 of ARC-Easy and 4 of boolq"
    assert all(len(run["answered"]) == run["questions"] for run in saved["runs"])


def test_the_study_refuses_to_mix_runs_made_with_other_settings(tmp_path: Path) -> None:
    results = tmp_path / "study.json"
    results.write_text(json.dumps({"settings": {"model": "tiny", "steps": 1}, "runs": []}))
    completed = _study("--dry-run", "--results", str(results))
    assert completed.returncode != 0 and "other settings" in completed.stderr
    assert json.loads(results.read_text())["runs"] == []


def test_the_committed_study_data_draws_the_documented_figures(tmp_path: Path) -> None:
    figures = [sys.executable, str(BENCHMARKS / "study_figures.py"), "--out", str(tmp_path)]
    drawn = subprocess.run(figures, capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert {path.name for path in tmp_path.glob("*.png")} == {"accuracy.png", "cost.png"}
