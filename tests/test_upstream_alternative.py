"""The alternative first contribution, docs/upstream/supertuning/: three patches to peft's Super-Tuning, a series
applied in order with `patch -p1` to a clean copy of the source release the patches target (`TARGET_PEFT`):

1. `0001-supertuning-exact-unmerge.patch`: unmerge writes back the entries the merge overwrote (bit for bit in bf16,
   where subtracting the values again rounds);
2. `0002-supertuning-row-selection.patch`: `selection="row"` with `entries_per_row` (each output row's top entries by
   magnitude, ties to the lower column: NeuroAda's selection), a line in peft's docs page and custom-model rows;
3. `0003-supertuning-memory-saving-forward.patch`: the forward that keeps nothing of the weight's size for backward,
   opt-in (`memory_saving_forward=True`; the default forward is unchanged), with the default forward's values under
   `torch.autocast` and in double backward.

After each patch, its specs and those of the patches before it pass in a process where the plugin cannot be imported,
and after the last, Super-Tuning's rows of peft's custom-model table too. The specs, on the release without the fixes,
show what each fixes: the unmerge specs fail there, the autocast and double-backward specs of the default forward pass
there. (peft's docs are not in its source release: the docs page's hunk is left out when applying, as for the series'
toctree.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

import pytest
from peft import get_peft_model

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.supertuning_format import to_supertuning
from tests.conftest import tiny_llama
from tests.test_peft_upstream_suite import apply_patch, extracted, without_the_plugin

REPO = Path(__file__).resolve().parents[1]
SERIES = sorted((REPO / "docs" / "upstream" / "supertuning").glob("*.patch"))
DOCS_PAGE = "docs/source/package_reference/supertuning.md"  # in peft's repository, not in its source release
SPECS = ["TestSupertuningExactUnmerge", "TestSupertuningRowSelection", "TestSupertuningMemorySavingForward"]
CUSTOM_ROWS = ["Vanilla MLP 7 Supertuning per row", "Vanilla MLP 9 Supertuning Supra (r=2) memory-saving"]


def sections(text: str) -> dict[str, str]:
    """A patch's file sections by the path they change."""
    parts = re.split(r"(?m)^(?=diff --git )", text)
    return {re.match(r"diff --git a/(\S+)", part)[1]: part for part in parts if part}


def added(text: str) -> int:
    return len(re.findall(r"(?m)^\+(?!\+\+)", text))


@pytest.fixture(scope="module")
def tree(peft_release, tmp_path_factory) -> Callable[[int], Path]:
    """`tree(n)`: a clean copy of the release with the first `n` patches applied (built once per stage)."""
    trees: dict[int, Path] = {}

    def build(stage: int) -> Path:
        if stage not in trees:
            root = extracted(peft_release, tmp_path_factory.mktemp(f"supertuning-{stage}"))
            for patch in SERIES[:stage]:
                apply_patch(root, "".join(s for path, s in sections(patch.read_text()).items() if path != DOCS_PAGE))
            trees[stage] = root
        return trees[stage]

    return build


def run_specs(root: Path, scratch: Path, targets: list[str], *options: str) -> tuple[str, dict[str, str]]:
    """peft's tests `targets` in a fresh interpreter on `root`, the plugin blocked: its output, each test's outcome."""
    junit = scratch / "junit.xml"
    command = [sys.executable, "-m", "pytest", *targets, *options, "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    command += ["-W", "ignore::FutureWarning", f"--junitxml={junit}"]
    env = without_the_plugin(root, scratch)
    run = subprocess.run(command, capture_output=True, text=True, cwd=root, env=env, timeout=600)
    outcomes = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "skipped" if case.find("skipped") is not None else ("failed" if failed else "ok")
        outcomes[f"{case.get('classname').rpartition('.')[2]}::{case.get('name')}"] = outcome
    return run.stdout[-4000:] + run.stderr[-2000:], outcomes


def test_the_series_changes_super_tuning_its_docs_page_and_its_tests_only():
    assert [patch.name for patch in SERIES] == [
        "0001-supertuning-exact-unmerge.patch",
        "0002-supertuning-row-selection.patch",
        "0003-supertuning-memory-saving-forward.patch",
    ]
    tuner = ["src/peft/tuners/supertuning/config.py", "src/peft/tuners/supertuning/layer.py"]
    tables = ["tests/test_custom_models.py", "tests/test_supertuning.py"]
    assert [list(sections(patch.read_text())) for patch in SERIES] == [
        [tuner[1], tables[1]],
        [DOCS_PAGE, *tuner, *tables],
        [*tuner, *tables],
    ]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_passes_in_peft_without_the_plugin(tree, tmp_path, stage):
    """After the first `stage` patches: their specs; after the last, Super-Tuning's rows of peft's custom-model table
    too (each patch's new rows among them: the table's generic tests merge, unmerge and reload every row)."""
    targets = [f"tests/test_supertuning.py::{spec}" for spec in SPECS[:stage]]
    last = stage == len(SERIES)
    table = ["tests/test_custom_models.py", "-k", "Supertuning"] if last else []
    output, outcomes = run_specs(tree(stage), tmp_path, [*targets, *table[:1]], *table[1:])
    assert outcomes and "failed" not in outcomes.values(), output
    specs = [name for name in outcomes if name.split("::")[0] in SPECS]
    assert len(specs) == [7, 16, 24][stage - 1], output
    if last:
        assert len([name for name in outcomes if "Vanilla MLP" in name and outcomes[name] == "ok"]) >= 200, output
        assert all(any(row in name for name in outcomes) for row in CUSTOM_ROWS), output


def test_the_specs_on_the_release_without_the_fixes(tmp_path, peft_release, tmp_path_factory):
    """The three patches' specs on the unpatched release: the exact-unmerge specs fail (the merge's entries come back
    rounded); the default forward's autocast training step and double backward pass, as they do after the series."""
    root = extracted(peft_release, tmp_path_factory.mktemp("supertuning-specs-only"))
    for patch in SERIES:
        apply_patch(root, sections(patch.read_text())["tests/test_supertuning.py"])
    targets = [f"tests/test_supertuning.py::{spec}" for spec in SPECS]
    output, outcomes = run_specs(root, tmp_path, targets)
    unmerge = {name: outcome for name, outcome in outcomes.items() if "unmerge" in name}
    assert len(unmerge) == 7 and set(unmerge.values()) == {"failed"}, output
    default = {name: outcome for name, outcome in outcomes.items() if name.endswith("[default]")}
    assert len(default) == 3 and set(default.values()) == {"ok"}, output
    forward = "TestSupertuningMemorySavingForward::test_"
    assert outcomes[f"{forward}a_training_step_under_autocast[default]"] == "ok"
    assert outcomes[f"{forward}double_backward[default]"] == "ok"


def test_upstream_md_states_the_series_sizes():
    counts = [added(patch.read_text()) for patch in SERIES]
    in_tuner = [sum(added(s) for path, s in sections(p.read_text()).items() if "src/" in path) for p in SERIES]
    doc = " ".join((REPO / "docs" / "upstream.md").read_text().split())
    assert f"| {sum(counts)} (built: [upstream/supertuning/](upstream/supertuning/):" in doc
    for patch, count, tuner in zip(SERIES, counts, in_tuner, strict=True):
        assert f"`{patch.name.split('-', 1)[0]}` {count} ({tuner} in the tuner)" in doc


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
    assert fields["selection"] == "row" and fields["entries_per_row"] == 2, fields
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


def test_a_neuroada_adapter_converts_to_the_per_row_selection_and_back_exactly(tree):
    """On peft with the series: Super-Tuning's own per-row selection picks the adapter's entries on the same base, the
    converted adapter gives the same logits bit for bit in float32 and bf16, and converting back gives its tensors."""
    paths = os.pathsep.join([str(tree(3) / "src"), str(REPO)])
    env = {**os.environ, "PYTHONPATH": paths, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", CONVERSION], capture_output=True, text=True, cwd=REPO, env=env
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
def test_adapters_the_per_row_selection_cannot_hold_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        to_supertuning(get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, **config)))
