"""The tuner's plain path carries every numerics and guarantee spec alone: the specs below run again in a fresh
process where `peft_neuroada.accel` cannot be imported (tests/conftest.py hides it), so every layer computes
`base(x) + (P ⊙ Θ) x` in plain torch. Specs of the accelerated paths themselves are marked `needs_accelerators`."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
from peft import get_peft_model

from peft_neuroada import Accelerator, NeuroAdaConfig, layers
from tests.conftest import ACCELERATORS_HIDDEN, neuroada_layers, tiny_llama

TESTS = Path(__file__).resolve().parent
NUMERICS_AND_GUARANTEES = [
    "test_math.py",
    "test_properties.py",
    "test_mixed_batch.py",
    "test_weighted_adapters.py",
    "test_empty_inputs.py",
    "test_bias.py",
    "test_experts.py",
    "test_delete_adapter.py",
    "test_changed_indices.py",
    "test_shared_weights.py",
    "test_selection.py",
    "test_weight_versions.py",
]
# The only specs the hidden run may skip: those of the accelerators themselves, and this file's own counterpart.
SKIPS_WITH_THE_ACCELERATORS_HIDDEN = {
    "specifies peft_neuroada.accel, hidden here",
    "an inference-tensor weight trains only on the accelerators' direct path (as LoRA, peft cannot)",
    "this is the run with the accelerators hidden",
}


@pytest.mark.skipif(not ACCELERATORS_HIDDEN, reason="runs inside the run with the accelerators hidden")
def test_with_the_accelerators_hidden_every_layer_computes_on_the_plain_path():
    assert "peft_neuroada.accel" not in sys.modules
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2))
    assert {type(layer.accelerator) for layer in neuroada_layers(model)} == {Accelerator}
    assert layers.installed_accelerator() is layers.PLAIN_PATH


@pytest.mark.skipif(ACCELERATORS_HIDDEN, reason="this is the run with the accelerators hidden")
def test_every_numerics_and_guarantee_spec_passes_with_the_accelerators_hidden(tmp_path):
    report = tmp_path / "report.xml"
    files_run = [*NUMERICS_AND_GUARANTEES, Path(__file__).name]
    files = [str(TESTS / name) for name in files_run]
    command = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    env = {**os.environ, "NEUROADA_SPECS_WITHOUT_ACCELERATORS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, cwd=TESTS.parent, env=env)
    assert run.returncode == 0, run.stdout[-4000:]
    cases = list(ElementTree.parse(report).iter("testcase"))
    passed = [case for case in cases if not list(case)]
    assert any(case.get("name").startswith("test_with_the_accelerators_hidden") for case in passed)
    assert {case.get("classname").removeprefix("tests.") + ".py" for case in passed} == set(files_run)
    skip_reasons = {case.find("skipped").get("message") for case in cases if case.find("skipped") is not None}
    assert skip_reasons <= SKIPS_WITH_THE_ACCELERATORS_HIDDEN
