"""peft's own specifications of a tuner: `tests/test_custom_models.py` from the source release of the installed peft,
run with NeuroAda cases added to its case tables beside the other tuners' (SHiRA's, Super-Tuning's, ...): once with
the plugin installed, and once with the tuner alone (`peft_neuroada/tuner/`) dropped into a copy of peft's source tree
as `peft/tuners/neuroada/`, registered as a peft PR would register it, with the plugin not importable.

The cases are peft's kind: the generic tables hold no trained-bias cases for any tuner (LoRA with `bias="all"` fails
the same generic tests, e.g. `test_disable_adapters`, since a trained bias stays when the adapter is disabled);
peft's bias rule, `test_adding_multiple_adapters_with_bias_raises`, runs for every case. NeuroAda's own bias specs
are in test_bias.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from importlib.metadata import version
from pathlib import Path

import pytest

from peft_neuroada.cache import cache_root

PLUGIN_IMPORT = "from peft_neuroada import NeuroAdaConfig\n"
# In peft's tree: peft's own NeuroAdaConfig, and proof that the plugin is nowhere in the process.
IN_TREE_IMPORT = """
import sys

import peft.tuners.neuroada
from peft import NeuroAdaConfig

assert NeuroAdaConfig.__module__ == "peft.tuners.neuroada.config" and "peft_neuroada" not in sys.modules
assert peft.tuners.neuroada.__file__.startswith(PEFT_SOURCE_TREE)
"""
# Inserted before the first model class, where every case table is defined and no test class has read one yet.
CASE_TABLES = """

TEST_CASES += [
    ("Vanilla MLP 1 NeuroAda", "MLP", NeuroAdaConfig, {"k": 1, "target_modules": "lin0"}),
    ("Vanilla MLP 2 NeuroAda", "MLP", NeuroAdaConfig, {"k": 3, "target_modules": ["lin0"]}),
    ("Vanilla MLP 3 NeuroAda", "MLP", NeuroAdaConfig, {"k": 2, "target_modules": ["lin1"]}),
    ("Vanilla MLP 4 NeuroAda", "MLP", NeuroAdaConfig, {"k": 2, "target_modules": ["lin0", "lin1"]}),
    ("Vanilla MLP 5 NeuroAda", "MLP", NeuroAdaConfig, {"target_modules": ["lin0"], "modules_to_save": ["lin1"]}),
    ("Embedding + transformers Conv1D 1 NeuroAda", "EmbConv1D", NeuroAdaConfig, {"k": 2, "target_modules": "conv1d"}),
]
ALL_PEFT_CONFIG_CLASSES = sorted({row[2] for row in TEST_CASES}, key=lambda cls: cls.__name__)
# k=2 on lin1: its two neurons' largest inputs are hidden units the test inputs never activate.
MULTIPLE_ACTIVE_ADAPTERS_TEST_CASES += [
    (
        "NeuroAda Same",
        "neuroada",
        NeuroAdaConfig,
        {"k": 2, "target_modules": ["lin0"], "init_weights": False},
        {"k": 2, "target_modules": ["lin0"], "init_weights": False},
    ),
    (
        "NeuroAda Different",
        "neuroada",
        NeuroAdaConfig,
        {"k": 1, "target_modules": ["lin0"], "init_weights": False},
        {"k": 2, "target_modules": ["lin1"], "init_weights": False},
    ),
]

"""
MIXED_BATCH_CASES = """
MIXED_ADAPTER_TEST_CASES += [
    (
        "NeuroAda mixed adapter",
        NeuroAdaConfig(target_modules=["lin0"], init_weights=False),
        NeuroAdaConfig(target_modules=["lin0"], k=3, init_weights=False),
    ),
]

"""
SINGLE_ADAPTER_CASES = [f"Vanilla MLP {i} NeuroAda" for i in range(1, 6)]
SINGLE_ADAPTER_CASES.append("Embedding + transformers Conv1D 1 NeuroAda")
ANCHORS = {CASE_TABLES: "\nclass MLP(nn.Module):\n", MIXED_BATCH_CASES: "\nclass TestMixedAdapterBatches:\n"}
TUNER = Path(__file__).resolve().parents[1] / "peft_neuroada" / "tuner"
# What a peft PR adds beside the tuner's folder, as peft holds SHiRA: (file, anchor, text put after the anchor).
REGISTRATION = [
    ("src/peft/utils/peft_types.py", '    SHIRA = "SHIRA"\n', '    NEUROADA = "NEUROADA"\n'),
    (
        "src/peft/tuners/__init__.py",
        "from .shira import ShiraConfig, ShiraModel\n",
        "from .neuroada import NeuroAdaConfig, NeuroAdaModel\n",
    ),
    ("src/peft/tuners/__init__.py", '    "ShiraModel",\n', '    "NeuroAdaConfig",\n    "NeuroAdaModel",\n'),
    ("src/peft/__init__.py", "    ShiraModel,\n", "    NeuroAdaConfig,\n    NeuroAdaModel,\n"),
    ("src/peft/__init__.py", '    "ShiraModel",\n', '    "NeuroAdaConfig",\n    "NeuroAdaModel",\n'),
    (
        "src/peft/tuners/neuroada/__init__.py",
        '__all__ = ["Linear", "NeuroAdaConfig", "NeuroAdaLayer", "NeuroAdaModel", "ParamWrapper"]\n',
        '\nfrom peft.utils import register_peft_method\n\nregister_peft_method(name="neuroada", '
        'config_cls=NeuroAdaConfig, model_cls=NeuroAdaModel, prefix="neuroada_")\n',
    ),
]


def peft_source_release(folder: Path) -> Path:
    """The installed peft's source release (its tests ship there, not in the wheel), downloaded once per machine."""
    peft_version = version("peft")
    archive = folder / f"peft-{peft_version}.tar.gz"
    if not archive.exists():
        command = [sys.executable, "-m", "pip", "download", f"peft=={peft_version}", "--no-deps"]
        fetched = subprocess.run([*command, "--no-binary", ":all:", "-d", str(folder)], capture_output=True, text=True)
        if fetched.returncode != 0 or not archive.exists():
            pytest.skip(f"peft {peft_version}'s source release could not be downloaded: {fetched.stderr[-500:]}")
    return archive


def with_neuroada_cases(archive: Path, destination: Path, import_line: str = PLUGIN_IMPORT, parts=("tests",)) -> Path:
    """peft's `parts` (its tests folder, and its source tree for the drop-in) unpacked into `destination`, its
    custom-model tables extended by NeuroAda's cases, which import NeuroAdaConfig by `import_line`."""
    root = archive.name.removesuffix(".tar.gz")
    with tarfile.open(archive) as release:
        members = [
            m for m in release.getmembers() if m.isfile() and m.name.startswith(tuple(f"{root}/{p}/" for p in parts))
        ]
        release.extractall(destination, members=members, filter="data")
    tests = destination / root / "tests"
    (tests / "__init__.py").touch()  # its modules import each other relatively
    specs = tests / "test_custom_models.py"
    import_line = import_line.replace("PEFT_SOURCE_TREE", repr(str(destination / root / "src")))
    add_beside(specs, {import_line + CASE_TABLES: ANCHORS[CASE_TABLES], MIXED_BATCH_CASES: ANCHORS[MIXED_BATCH_CASES]})
    return specs


def add_beside(path: Path, texts: dict[str, str], before: bool = True) -> None:
    """Put each text beside its anchor (before it, or after it), which `path` must hold exactly once."""
    content = path.read_text()
    for text, anchor in texts.items():
        assert content.count(anchor) == 1, f"peft's {path.name} has no single {anchor.strip()!r} to add to"
        content = content.replace(anchor, text + anchor if before else anchor + text)
    path.write_text(content)


def run_neuroada_cases(specs: Path, env: dict[str, str] | None = None) -> list[ElementTree.Element]:
    """Every NeuroAda case of peft's custom-model specs, run in a fresh interpreter; their JUnit test cases."""
    report = specs.parent / "report.xml"
    command = [sys.executable, "-m", "pytest", str(specs), "-k", "NeuroAda", "-q", "-p", "no:cacheprovider"]
    # peft's own pytest options (coverage) are not for this run; its rootdir makes `tests` a package.
    command += ["-o", "addopts=", "--rootdir", str(specs.parent.parent), f"--junitxml={report}"]
    run = subprocess.run(command, capture_output=True, text=True, cwd=specs.parent.parent, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return list(ElementTree.parse(report).iter("testcase"))


@pytest.fixture(scope="module")
def peft_results(tmp_path_factory) -> list[ElementTree.Element]:
    """Every NeuroAda case of peft's custom-model specs, run in a fresh interpreter; their JUnit test cases."""
    specs = with_neuroada_cases(peft_release(), tmp_path_factory.mktemp("peft"))
    return run_neuroada_cases(specs)


def peft_release() -> Path:
    folder = cache_root() / "peft-source"
    folder.mkdir(parents=True, exist_ok=True)
    return peft_source_release(folder)


@pytest.fixture(scope="module")
def in_tree_results(tmp_path_factory) -> list[ElementTree.Element]:
    """The same cases with the tuner dropped into a copy of peft's source tree, and the plugin not importable: a
    `peft_neuroada` that raises on import shadows the installed one, and its start-up hook is switched off."""
    scratch = tmp_path_factory.mktemp("peft-tree")
    specs = with_neuroada_cases(peft_release(), scratch, IN_TREE_IMPORT, parts=("tests", "src"))
    source = specs.parents[1] / "src"
    shutil.copytree(TUNER, source / "peft" / "tuners" / "neuroada", ignore=shutil.ignore_patterns("__pycache__"))
    for file, anchor, text in REGISTRATION:
        add_beside(source / file.removeprefix("src/"), {text: anchor}, before=False)
    blocked = scratch / "blocked" / "peft_neuroada"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("the plugin is not installed in this run")\n')
    path = os.pathsep.join([str(source), str(blocked.parent)])
    return run_neuroada_cases(specs, {**os.environ, "PYTHONPATH": path, "PEFT_NEUROADA_NO_AUTOLOAD": "1"})


def ran_for(case_name: str, results: list[ElementTree.Element]) -> list[ElementTree.Element]:
    return [case for case in results if f"{case_name}-" in case.get("name")]


def specs_run_for(case_name: str, results: list[ElementTree.Element]) -> set[str]:
    """The names of peft's spec functions that ran for one case (without their parameters)."""
    return {case.get("name").split("[")[0] for case in ran_for(case_name, results)}


def test_every_neuroada_case_passes_each_of_peft_s_generic_tuner_specs(peft_results):
    assert not [case for case in peft_results if case.find("failure") is not None or case.find("error") is not None]
    generic_specs = specs_run_for(SINGLE_ADAPTER_CASES[0], peft_results)
    assert len(generic_specs) >= 40  # 44 in peft 0.21.2, 56 runs with their own parameters
    for case_name in SINGLE_ADAPTER_CASES:
        assert specs_run_for(case_name, peft_results) == generic_specs


def test_peft_s_specs_for_several_active_adapters_and_mixed_batches_run_on_neuroada(peft_results):
    for case_name in ("NeuroAda Same", "NeuroAda Different", "NeuroAda mixed adapter"):
        ran = ran_for(case_name, peft_results)
        assert len(ran) >= 5 and all(case.find("skipped") is None for case in ran)


def test_peft_refuses_a_second_adapter_training_biases_for_every_neuroada_case(peft_results):
    spec = "test_adding_multiple_adapters_with_bias_raises"
    bias_rule = [case for case in peft_results if case.get("name").startswith(f"{spec}[")]
    assert len(bias_rule) == len(SINGLE_ADAPTER_CASES) and all(case.find("skipped") is None for case in bias_rule)


def test_the_tuner_alone_inside_peft_s_source_tree_passes_the_same_specs_as_the_plugin(peft_results, in_tree_results):
    assert not [case for case in in_tree_results if case.find("failure") is not None or case.find("error") is not None]
    ran = {case.get("name") for case in in_tree_results if case.find("skipped") is None}
    assert ran == {case.get("name") for case in peft_results if case.find("skipped") is None}
    assert len(ran) >= 40 * len(SINGLE_ADAPTER_CASES)
