"""The alternative first contribution, docs/upstream/supertuning-neuron.patch: peft's Super-Tuning with NeuroAda's
selection (`selection="neuron"`), a forward that keeps nothing of the weight's size for backward and an unmerge that
writes back what the merge overwrote. Applied with `patch -p1` to a clean copy of the installed peft's source release,
its own specs and Super-Tuning's rows of peft's custom-model table, the new per-neuron rows among them, pass in a
process where the plugin cannot be imported. (Super-Tuning's other tests and its decoder rows load models from the
Hub, which is not reachable here.)"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.test_peft_upstream_suite import without_the_plugin

PATCH = Path(__file__).resolve().parents[1] / "docs" / "upstream" / "supertuning-neuron.patch"
RUNS = {
    "per-neuron specs": ["tests/test_supertuning.py", "-k", "PerNeuron"],
    "custom-model rows": ["tests/test_custom_models.py", "-k", "Supertuning"],
}


@pytest.fixture(scope="module")
def patched_release(upstream_patch, tmp_path_factory) -> Path:
    try:
        release = upstream_patch.default_release()
    except FileNotFoundError as error:
        pytest.skip(f"no source release of the installed peft: {error}")
    scratch = tmp_path_factory.mktemp("supertuning-neuron")
    with tarfile.open(release) as archive:
        archive.extractall(scratch, filter="data")
    root = scratch / release.name.removesuffix(".tar.gz")
    patched = subprocess.run(
        ["patch", "-p1", "--batch", "--forward"], stdin=PATCH.open(), text=True, capture_output=True, cwd=root
    )
    assert patched.returncode == 0, patched.stdout + patched.stderr
    (root / "tests" / "__init__.py").touch()
    return root


def test_the_patch_changes_super_tuning_and_its_tests_only():
    changed = re.findall(r"(?m)^diff --git a/(\S+)", PATCH.read_text())
    assert changed == [
        "src/peft/tuners/supertuning/config.py",
        "src/peft/tuners/supertuning/layer.py",
        "tests/test_custom_models.py",
        "tests/test_supertuning.py",
    ]


@pytest.mark.parametrize("run", RUNS)
def test_the_patched_super_tuning_passes_in_peft_without_the_plugin(patched_release, tmp_path, run):
    command = [sys.executable, "-m", "pytest", *RUNS[run], "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    command += ["-W", "ignore::FutureWarning"]
    env = without_the_plugin(patched_release, tmp_path)
    completed = subprocess.run(command, capture_output=True, text=True, cwd=patched_release, env=env, timeout=600)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", completed.stdout)[1])
    assert passed >= (12 if run == "per-neuron specs" else 300), completed.stdout[-1000:]
    if run == "custom-model rows":
        listed = subprocess.run(
            [*command, "--collect-only"], capture_output=True, text=True, cwd=patched_release, env=env
        )
        assert "per neuron" in listed.stdout or "per_neuron" in listed.stdout


def test_upstream_md_states_the_patchs_size():
    added = [line for line in PATCH.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    in_tuner = sum(1 for _ in re.finditer(r"(?m)^\+(?!\+\+)", PATCH.read_text().split("diff --git a/tests/")[0]))
    doc = " ".join((PATCH.parents[1] / "upstream.md").read_text().split())
    assert f"adapter | {len(added)} (built:" in doc
    assert f"{in_tuner} in the tuner, {len(added) - in_tuner} in tests" in doc
