"""The accuracy study (benchmarks/study.py) and its figures: every budget of every method gets its own swept learning
rate, tests run on seeds the sweep never used, and NeuroAda is compared with each peer at a matched budget through
a paired bootstrap interval."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from peft_neuroada.tuner.selection import select_inputs
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


def _answers(correct_per_seed: list[int], questions: int = 200) -> list[str]:
    return ["1" * correct + "0" * (questions - correct) for correct in correct_per_seed]


def test_a_gap_is_read_as_a_win_only_where_seeds_and_questions_both_allow_it() -> None:
    figures, stats = _benchmark_module("study_figures"), _benchmark_module("study_stats")
    steady = figures.paired_differences(
        _point(figures, "neuroada", _answers([190, 191, 190, 192, 190])),
        _point(figures, "lora", _answers([170, 170, 171, 170, 169])),
    )
    # The gap of the k=5 vs LoRA r=3: the bootstrap's 95% interval excludes 0, three seeds do not.
    one_seed = figures.paired_differences(
        _point(figures, "neuroada", _answers([190, 190, 190])), _point(figures, "lora", _answers([182, 184, 169]))
    )
    ahead, lucky = stats.read_family([steady]), stats.read_family([one_seed])
    assert ahead[0].mean == pytest.approx(10.3) and ahead[0].verdict == "NeuroAda ahead"
    assert lucky[0].bootstrap[0] > 0 and lucky[0].seed_t[0] < 0 and lucky[0].verdict == "not told apart"
    assert stats.read_family([-steady])[0].verdict == "peer ahead"


def test_holm_corrects_over_the_table_and_an_interval_excludes_0_exactly_when_holm_rejects() -> None:
    stats = _benchmark_module("study_stats")
    adjusted, levels = stats.holm([0.01, 0.04, 0.03, 0.005])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert levels == pytest.approx([0.05 / 3, 0.05 / 2, 0.05 / 2, 0.05 / 4])  # the last two at the level Holm stopped
    rng = np.random.default_rng(1)
    gaps = [rng.normal(loc, 1.0, size=(4, 1)) for loc in (0.0, 0.5, 1.5, 2.5, 4.0, 6.0)]
    for reading in stats.read_family(gaps):
        low, high = reading.seed_corrected
        assert (low > 0 or high < 0) == (reading.seed_holm_p < 0.05)
    alone = stats.read_family([gaps[3]])[0]
    among = stats.read_family(gaps)[3]
    assert among.seed_holm_p > alone.seed_holm_p and among.seed_corrected[0] < alone.seed_corrected[0]


def test_the_detectable_gap_grows_with_the_seeds_spread_and_shrinks_with_more_seeds() -> None:
    stats = _benchmark_module("study_stats")
    three, five = np.array([1.0, 3.0, 2.0]), np.array([1.0, 3.0, 2.0, 1.0, 3.0])
    assert stats.detectable_gap(three, 0.05) > stats.detectable_gap(five, 0.05)
    assert stats.detectable_gap(3 * three, 0.05) == pytest.approx(3 * stats.detectable_gap(three, 0.05))
    assert stats.detectable_gap(three, 0.05 / 11) > stats.detectable_gap(three, 0.05)


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


def test_the_committed_bf16_question_draws_its_figures_and_reads_its_one_pair(tmp_path: Path) -> None:
    """docs/study/confirm-bf16.json (its rate swept in float32 elsewhere): figures, no sweep table, the pair's
    corrected reading, and a cost table in wall seconds per step for a study run on CUDA."""
    results = BENCHMARKS.parent / "docs" / "study" / "confirm-bf16.json"
    figures = [sys.executable, str(BENCHMARKS / "study_figures.py"), "--results", str(results), "--prefix", "bf16-"]
    drawn = subprocess.run([*figures, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert {path.name for path in tmp_path.glob("*.png")} == {"bf16-accuracy.png", "bf16-loss.png"}
    assert "dev accuracy per learning rate" not in drawn.stdout
    assert "| k=20 | mask 20 |" in drawn.stdout and "s per step (wall)" in drawn.stdout


def test_the_committed_confirmatory_runs_are_whole_and_read_all_seven_pairs(tmp_path: Path) -> None:
    """docs/study/confirm.json: every budget's chosen rate lies inside its swept grid and has its five test seeds on
    the fresh questions; the figures draw and the reading covers the seven matched pairs."""
    results = BENCHMARKS.parent / "docs" / "study" / "confirm.json"
    runs = json.loads(results.read_text())["runs"]
    chosen = _benchmark_module("common").chosen_rates(runs)
    assert chosen.keys() == {(run["family"], run["size"]) for run in runs}, "a budget tested without a sweep"
    for budget, best in chosen.items():
        swept = {
            run["learning_rate"] for run in runs if run["phase"] == "sweep" and (run["family"], run["size"]) == budget
        }
        assert min(swept) < best < max(swept), f"{budget}: the chosen rate {best} is on the edge of {sorted(swept)}"
        tests = [run for run in runs if run["phase"] == "test" and (run["family"], run["size"]) == budget]
        assert {run["learning_rate"] for run in tests} == {best}, budget
        assert sorted(run["seed"] for run in tests) == [6, 7, 8, 9, 10], budget
        assert {run["questions"] for run in tests} == {512}, budget
    figures = [sys.executable, str(BENCHMARKS / "study_figures.py"), "--results", str(results), "--prefix", "c-"]
    drawn = subprocess.run([*figures, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert {path.name for path in tmp_path.glob("*.png")} == {"c-accuracy.png", "c-loss.png"}
    pairs = [line for line in drawn.stdout.splitlines() if line.startswith(("| k=5 |", "| k=20 |"))]
    assert len(pairs) == 7, pairs


def test_a_study_stopped_before_its_test_runs_reports_its_sweeps_and_draws_nothing(tmp_path: Path) -> None:
    study = json.loads((BENCHMARKS.parent / "docs" / "study" / "results.json").read_text())
    swept = {**study, "runs": [run for run in study["runs"] if run["phase"] == "sweep"]}
    (tmp_path / "swept.json").write_text(json.dumps(swept))
    figures = [sys.executable, str(BENCHMARKS / "study_figures.py"), "--results", str(tmp_path / "swept.json")]
    drawn = subprocess.run([*figures, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert "| neuroada | 20 |" in drawn.stdout and "**" in drawn.stdout and "No test runs" in drawn.stdout
    assert not list(tmp_path.glob("*.png"))


def test_the_confirmatory_runs_sweep_finer_on_two_seeds_and_test_fresh_questions_with_loss_curves(tmp_path) -> None:
    """study_confirm.py's dry run: NeuroAda k=20 and mask-based k=20 swept at half, once and twice the first study's
    rate on two new seeds, tested on new seeds and on questions no earlier reading saw, and asked again in bf16,
    each bf16 run in a fresh process that measures its own peak memory."""
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "study_confirm.py"), "--dry-run", "--threads", "1"]
    command += ["--results-dir", str(tmp_path), "--families", "neuroada", "mask", "--parts", "sweep", "bf16", "test"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    confirm, common = _benchmark_module("study_confirm"), _benchmark_module("common")
    first = json.loads((BENCHMARKS.parent / "docs" / "study" / "results.json").read_text())
    centres, earlier_seeds = common.chosen_rates(first["runs"]), {run["seed"] for run in first["runs"]}
    saved = json.loads((tmp_path / "confirm.json").read_text())
    settings, runs = saved["settings"], saved["runs"]
    for family, size in [("neuroada", 5), ("neuroada", 20), ("mask", 20)]:
        swept = [run for run in runs if (run["phase"], run["family"], run["size"]) == ("sweep", family, size)]
        rates = sorted({run["learning_rate"] for run in swept})
        centre = centres[(family, size)]
        assert {centre / 2, centre, centre * 2} <= set(rates)
        assert all(high / low == pytest.approx(2.0) for low, high in zip(rates, rates[1:], strict=False))
        assert {run["seed"] for run in swept} == {4, 5} and not {4, 5} & earlier_seeds
        tested = [run for run in runs if (run["phase"], run["family"], run["size"]) == ("test", family, size)]
        assert sorted(run["seed"] for run in tested) == settings["test_seeds"]
    assert all(len(run["losses"]) == settings["steps"] == 2 for run in runs)
    task = confirm.FreshTask(confirm.SETTINGS["float32"], None)
    assert len(task.asked["test"]) == 512 and not {prompt for prompt, _ in task.asked["test"]} & task.earlier
    assert len(task.earlier) == 128 + 256
    bf16 = json.loads((tmp_path / "confirm-bf16.json").read_text())
    assert (bf16["settings"]["dtype"], bf16["settings"]["delta_dtype"]) == ("bfloat16", "bfloat16")
    rate = common.chosen_rates(runs)[("neuroada", 20)]
    assert {(run["family"], run["size"], run["learning_rate"]) for run in bf16["runs"]} == {
        ("neuroada", 20, rate),
        ("mask", 20, rate),
    }
    assert all(run["peak_growth_bytes"] > 0 and run["step_cpu_seconds"] > 0 for run in bf16["runs"])
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "sweep " not in again.stdout and "test " not in again.stdout, again.stdout
    for name, prefix in (("confirm.json", "confirm-"), ("confirm-bf16.json", "confirm-bf16-")):
        figures = [sys.executable, str(BENCHMARKS / "study_figures.py"), "--results", str(tmp_path / name)]
        drawn = subprocess.run([*figures, "--out", str(tmp_path), "--prefix", prefix], capture_output=True, text=True)
        assert drawn.returncode == 0, drawn.stderr[-3000:]
        assert (tmp_path / f"{prefix}accuracy.png").exists() and (tmp_path / f"{prefix}loss.png").exists()
        assert "| k=20 | mask 20 |" in drawn.stdout
    assert "peak growth, mean (MiB)" in drawn.stdout


def test_the_mask_based_arm_trains_the_entries_neuroada_selects_ties_included() -> None:
    """Q4_1-derived weights tie often; the mask-based arm sends equal magnitudes to the lower column, as the tuner's
    rule does (torch.topk alone leaves their order unspecified), so both arms train the same entries."""
    variants = _benchmark_module("cost.variants")
    model = LlamaForCausalLM(variants.llama_config(64, 64, 128, 1, 4, 2, 32))
    weight = model.model.layers[0].mlp.down_proj.weight  # 64 x 128: magnitudes 0, 1, 2, 3 repeated along each row
    with torch.no_grad():
        weight.copy_((torch.arange(weight.shape[1]) % 4).float().expand_as(weight))
    lowest_of_the_largest = list(range(3, 80, 4))  # 20 of the 32 columns holding 3
    assert select_inputs(weight, 20).tolist() == [lowest_of_the_largest] * weight.shape[0]
    _, trained, _ = variants.mask_based(model, 20)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert any(parameter is weight for parameter in trained)
    assert [row.nonzero().squeeze(1).tolist() for row in weight.grad] == [lowest_of_the_largest] * weight.shape[0]
