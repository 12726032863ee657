"""The alternative first contribution, docs/upstream/supertuning-neuron.patch: peft's Super-Tuning with NeuroAda's
selection (`selection="neuron"`), a forward that keeps nothing of the weight's size for backward and an unmerge that
writes back what the merge overwrote. Applied with `patch -p1` to a clean copy of the source release the patches target
(`TARGET_PEFT`), its own specs and Super-Tuning's rows of peft's custom-model table, the new per-neuron rows among
them, pass in a process where the plugin cannot be imported; its decoder rows run on the local Llama stand-in.
(Super-Tuning's other tests load models from the Hub, which is not reachable here.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from peft import get_peft_model

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.supertuning_format import to_supertuning
from tests.conftest import tiny_llama
from tests.test_peft_upstream_suite import (
    HUB_ONLY,
    apply_patch,
    extracted,
    hub_cache,
    without_the_plugin,
)

PATCH = Path(__file__).resolve().parents[1] / "docs" / "upstream" / "supertuning-neuron.patch"
LLAMA = "peft-internal-testing/tiny-random-LlamaForCausalLM"  # the decoder stand-in Super-Tuning's rows run on
RUNS = {
    "per-neuron specs": ["tests/test_supertuning.py", "-k", "PerNeuron"],
    "custom-model rows": ["tests/test_custom_models.py", "-k", "Supertuning"],
}


@pytest.fixture(scope="module")
def patched_release(peft_release, tmp_path_factory) -> Path:
    root = extracted(peft_release, tmp_path_factory.mktemp("supertuning-neuron"))
    apply_patch(root, PATCH.read_text())
    return root


def test_the_patch_changes_super_tuning_and_its_tests_only():
    changed = re.findall(r"(?m)^diff --git a/(\S+)", PATCH.read_text())
    assert changed == [
        "src/peft/tuners/supertuning/config.py",
        "src/peft/tuners/supertuning/layer.py",
        "tests/test_custom_models.py",
        "tests/test_decoder_models.py",
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


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    return hub_cache(tmp_path_factory.mktemp("hub"))


def test_super_tuning_s_decoder_rows_pass_on_the_local_llama_stand_in(patched_release, stand_ins, tmp_path):
    """Super-Tuning's rows of peft's decoder table, the new per-neuron row among them, on the Llama stand-in that
    tests/test_peft_upstream_suite.py builds for peft's tiny Hub model (one of its stand-ins keeps this run short)."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "peft_tree_plugin.py").write_text(Path(__file__).with_name("peft_tree_plugin.py").read_text())
    env = {
        **without_the_plugin(patched_release, tmp_path, plugin),
        "HF_HUB_CACHE": str(stand_ins),
        "NEUROADA_STAND_INS": json.dumps([LLAMA]),
        "NEUROADA_HUB_ONLY": json.dumps(HUB_ONLY),
        "NEUROADA_REPORT": str(tmp_path / "report.json"),
    }
    command = [sys.executable, "-m", "pytest", "tests/test_decoder_models.py", "-k", "Supertuning", "-q"]
    command += ["-p", "peft_tree_plugin", "-p", "no:cacheprovider", "-o", "addopts="]
    completed = subprocess.run(command, capture_output=True, text=True, cwd=patched_release, env=env, timeout=900)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", completed.stdout)[1])
    rows = (patched_release / "tests" / "test_decoder_models.py").read_text().count('"selection": "neuron"')
    assert rows == 1 and passed >= 30, completed.stdout[-1000:]


def test_upstream_md_states_the_patchs_size():
    added = [line for line in PATCH.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    in_tuner = sum(1 for _ in re.finditer(r"(?m)^\+(?!\+\+)", PATCH.read_text().split("diff --git a/tests/")[0]))
    doc = " ".join((PATCH.parents[1] / "upstream.md").read_text().split())
    assert f"adapter | {len(added)} (built:" in doc
    assert f"{in_tuner} in the tuner, {len(added) - in_tuner} in tests" in doc


CONVERSION = """
import torch
from peft import SupertuningConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft_neuroada import NeuroAdaConfig
from peft_neuroada.supertuning_format import from_supertuning, to_supertuning
from tests.conftest import tiny_llama

# 48 tokens, past the bypass's few-token threshold: NeuroAda's forward is its merged copy, one matmul as Super-Tuning's
ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(0))
for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(0)
    neuroada = get_peft_model(tiny_llama().to(dtype), NeuroAdaConfig(k=2, init_weights=False)).eval()
    fields, state = to_supertuning(neuroada)
    supertuning = get_peft_model(tiny_llama().to(dtype), SupertuningConfig(**fields)).eval()
    selected = get_peft_model_state_dict(supertuning)
    same = [torch.equal(selected[key].sort()[0], state[key].sort()[0]) for key in state if key.endswith("indices")]
    assert same and all(same), "its own selection picks the same entries"
    set_peft_model_state_dict(supertuning, state)
    with torch.no_grad():
        assert torch.equal(supertuning(ids).logits, neuroada(ids).logits), dtype
    back = from_supertuning(neuroada, get_peft_model_state_dict(supertuning))
    saved = get_peft_model_state_dict(neuroada)
    assert back.keys() == saved.keys() and all(torch.equal(back[key], saved[key]) for key in saved)
print("exact")
"""


def test_a_neuroada_adapter_converts_to_the_per_neuron_mode_and_back_exactly(patched_release):
    """On the patched peft: Super-Tuning's own per-neuron selection picks the adapter's entries on the same base, the
    converted adapter gives the same logits bit for bit in float32 and bf16, and converting back gives its tensors."""
    repo = PATCH.parents[2]
    paths = os.pathsep.join([str(patched_release / "src"), str(repo)])
    env = {**os.environ, "PYTHONPATH": paths, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", CONVERSION], capture_output=True, text=True, cwd=repo, env=env
    )
    assert run.returncode == 0 and run.stdout.strip() == "exact", run.stdout[-2000:] + run.stderr[-3000:]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"neuron_fraction": 0.5}, r"at '.*q_proj': it tunes a share of the neurons"),
        ({"bias": "all"}, "Super-Tuning trains no biases or extra modules"),
    ],
    ids=["some-neurons", "biases"],
)
def test_adapters_the_per_neuron_mode_cannot_hold_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        to_supertuning(get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, **config)))
