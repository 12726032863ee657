"""The pull request peft would merge, docs/upstream/neuroada.patch: a `patch -p1` file against the source release of
peft TARGET_PEFT that copies the tuner as it is now (peft_neuroada/tuner/) into peft's tree as peft/tuners/neuroada/,
with the registration, the PR's own new files (docs/upstream/pr/: the docs page, the example, the method_comparison
experiments, tests/test_neuroada.py) and NeuroAda rows in peft's generic test tables.

    python benchmarks/upstream_patch.py           # (re)writes the patch and its counts
    python benchmarks/upstream_patch.py --check   # exit status 1 when the committed patch or its counts are stale

The counts that describe the patch (added lines, files, the tuner's lines, size) and the tuner model's overrides are
written from what the script builds into docs/upstream.md, between `<!-- counts:NAME -->` and `<!-- /counts:NAME -->`
(NAME: patch, overrides; docs/upstream/issue.md: sizes); no page repeats them by hand.

Beside the new files it changes peft where peft keeps what a tuner registers, as it holds SHiRA and Super-Tuning: the
`PeftType` member, the exports of `peft.tuners` and `peft`, the default-target mapping in `peft/utils/constants.py`
(moved there from the tuner, whose imports follow it), NeuroAda rows in peft's generic test tables, and the toctree
entry of the docs page. The tuner's files get peft's license header and `register_peft_method` in `__init__.py`.
Nothing is formatted by hand: every file the patch adds or changes goes through peft's `make style` (`ruff check
--fix` and `ruff format` with the ruff version peft's setup.py pins and peft's own pyproject.toml, then `doc-builder
style`).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(REPO_ROOT)] + [entry for entry in sys.path if entry != str(REPO_ROOT)]

TUNER = REPO_ROOT / "peft_neuroada" / "tuner"
PR_FILES = REPO_ROOT / "docs" / "upstream" / "pr"
PATCH = REPO_ROOT / "docs" / "upstream" / "neuroada.patch"
UPSTREAM_DOC = REPO_ROOT / "docs" / "upstream.md"
DESIGN_DOC = REPO_ROOT / "docs" / "design.md"
ISSUE_DOC = REPO_ROOT / "docs" / "upstream" / "issue.md"
# The alternative pull request (Super-Tuning's per-neuron mode): one patch, or the series that replaces it.
ALTERNATIVE_SERIES = REPO_ROOT / "docs" / "upstream" / "supertuning"
MAPPING = "TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING"
# The peft release the patches target: their source tree, whatever peft is installed (a new release changes nothing
# here until this names it and the patches are rebuilt on it).
TARGET_PEFT = "0.22.0"
TUNER_DIR = "src/peft/tuners/neuroada"
# peft's Makefile: `make quality` runs `ruff check` and `ruff format --check` on these folders (those the tree has).
QUALITY_DIRS = ("src", "tests", "examples", "docs", "scripts")
LICENSE = """\
# Copyright 2026-present the HuggingFace Inc. team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""
REGISTRATION = """
register_peft_method(name="neuroada", config_cls=NeuroAdaConfig, model_cls=NeuroAdaModel)
"""
# peft's docs are not in its source release: the toctree entries are hunks against peft's docs/source/_toctree.yml as
# its repository holds it (checked against huggingface/peft 5d602fdbf, 2026-12: after MiSS in the methods' list, after
# Multitask Prompt Tuning in the API reference's, both alphabetical, as the Super-Tuning PR placed its entries).
TOCTREE = "docs/source/_toctree.yml"
TOCTREE_HUNK = """\
diff --git a/docs/source/_toctree.yml b/docs/source/_toctree.yml
--- a/docs/source/_toctree.yml
+++ b/docs/source/_toctree.yml
@@ -111,6 +111,8 @@
         title: LoRA
       - local: package_reference/miss
         title: MiSS
+      - local: package_reference/neuroada
+        title: NeuroAda
       - local: package_reference/oft
         title: OFT
       - local: package_reference/osf
@@ -206,6 +208,8 @@
       title: MiSS
     - local: package_reference/multitask_prompt_tuning
       title: Multitask Prompt Tuning
+    - local: package_reference/neuroada
+      title: NeuroAda
     - local: package_reference/oft
       title: OFT
     - local: package_reference/osf
"""

# ------------------------------------------------------------------------------------------ the test tables
# The rows, in peft's style, put beside Super-Tuning's in each table (or at the end of a table it has no rows in).
CUSTOM_MODEL_CASES = """\
    ############
    # NeuroAda #
    ############
    ("Vanilla MLP 1 NeuroAda", "MLP", NeuroAdaConfig, {"k": 1, "target_modules": "lin0"}),
    ("Vanilla MLP 2 NeuroAda", "MLP", NeuroAdaConfig, {"k": 3, "target_modules": ["lin0"]}),
    ("Vanilla MLP 3 NeuroAda", "MLP", NeuroAdaConfig, {"k": 2, "target_modules": ["lin1"]}),
    ("Vanilla MLP 4 NeuroAda", "MLP", NeuroAdaConfig, {"k": 2, "target_modules": ["lin0", "lin1"]}),
    ("Vanilla MLP 5 NeuroAda", "MLP", NeuroAdaConfig, {"target_modules": ["lin0"], "modules_to_save": ["lin1"]}),
    (
        "Vanilla MLP 6 NeuroAda half the neurons",
        "MLP",
        NeuroAdaConfig,
        {"k": 2, "target_modules": ["lin0"], "neuron_fraction": 0.5},
    ),
    ("Embedding + transformers Conv1D 1 NeuroAda", "EmbConv1D", NeuroAdaConfig, {"k": 2, "target_modules": "conv1d"}),
"""
# k=2 on lin1 in "Different": its two neurons' largest inputs are hidden units the test inputs never activate.
MULTIPLE_ACTIVE_ADAPTERS_CASES = """\
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
"""
MIXED_BATCH_CASES = """\
    (
        "NeuroAda mixed adapter",
        NeuroAdaConfig(target_modules=["lin0"], init_weights=False),
        NeuroAdaConfig(target_modules=["lin0"], k=3, init_weights=False),
    ),
"""
MIXED_MODULES_TO_SAVE = "            NeuroAdaConfig,\n"
# test_quantization.py's method x quantization-backend matrix: the targets its loaders count (q_proj, v_proj).
QUANTIZATION_CASE = """\
    (
        NeuroAdaConfig,
        {"k": 2, "target_modules": ["q_proj", "v_proj"]},
    ),
"""


def transformers_case(task_type: str, targets: list[str] | None) -> str:
    """A row of the transformers-model tables: k=2, random deltas (as Super-Tuning's rows: merge and disable tests then
    compare outputs that differ), on the default targets (or `targets` where the tables' models
    include architectures without a NeuroAda default)."""
    return f"""\
    (
        NeuroAdaConfig,
        {{
            "k": 2,
            "init_weights": False,
            "task_type": "{task_type}",
            "target_modules": {"None" if targets is None else json.dumps(targets)},
        }},
    ),
"""


# T5 (q, k, v, o) and BART; BERT, RoBERTa, DeBERTa (in_proj) and DeBERTa-v2: their attention projections.
SEQ2SEQ_TARGETS = ["q", "k", "v", "o", "q_proj", "k_proj", "v_proj", "out_proj"]
ENCODER_TARGETS = ["query", "key", "value", "in_proj", "query_proj", "key_proj", "value_proj"]

Edit = Callable[[str], str]


def table_rows(table: str, text: str, after: str | None = "SupertuningConfig") -> Edit:
    """Put `text` (whole lines) into the list or tuple assigned to `table`: after its last entry naming `after`, or at
    its end when `after` is None."""

    def edit(source: str) -> str:
        node = next(
            statement.value
            for statement in ast.parse(source).body
            if isinstance(statement, ast.Assign) and any(getattr(t, "id", None) == table for t in statement.targets)
        )
        entries = [e for e in node.elts if after is None or after in {getattr(n, "id", None) for n in ast.walk(e)}]
        return insert_lines(source, entries[-1].end_lineno, text)

    return edit


def parametrized_with(function: str, after: str, text: str) -> Edit:
    """Put `text` into the `pytest.mark.parametrize` list of `function` that names `after`, after it."""

    def edit(source: str) -> str:
        test = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function)
        values = [
            value
            for decorator in test.decorator_list
            for argument in getattr(decorator, "args", [])
            if isinstance(argument, ast.List)
            for value in argument.elts
        ]
        line = next(value.end_lineno for value in values if getattr(value, "id", None) == after)
        return insert_lines(source, line, text)

    return edit


def imported_from(module: str, *names: str, level: int = 0) -> Edit:
    """Add `names` to the `from module import ...` statement, each at its sorted place: a line of its own in a
    statement of one name a line, or in the line of a one-line statement (which peft's style then wraps if long)."""

    def edit(source: str) -> str:
        for name in names:
            statement = next(
                n
                for n in ast.parse(source).body
                if isinstance(n, ast.ImportFrom) and n.module == module and n.level == level
            )
            members = [(a.name, a.lineno) for a in statement.names]
            if statement.lineno != statement.end_lineno:
                source = insert_sorted(source, name, f"    {name},\n", members)
                continue
            imported = sorted([a.name for a in statement.names] + [name], key=import_order)
            line = f"from {'.' * level}{module} import {', '.join(imported)}\n"
            lines = source.splitlines(keepends=True)
            source = "".join(lines[: statement.lineno - 1] + [line] + lines[statement.lineno :])
        return source

    return edit


def exported(*names: str) -> Edit:
    """Add `names` to `__all__` (a list, one string a line), each at its sorted place."""

    def edit(source: str) -> str:
        for name in names:
            listed = next(
                n.value
                for n in ast.parse(source).body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "__all__"
            )
            source = insert_sorted(source, name, f'    "{name}",\n', [(e.value, e.lineno) for e in listed.elts])
        return source

    return edit


def tuner_imported(source: str) -> str:
    """`from .neuroada import ...` among the `from .<tuner> import ...` lines of peft/tuners/__init__.py."""
    tuners = [(n.module, n.lineno) for n in ast.parse(source).body if isinstance(n, ast.ImportFrom) and n.level == 1]
    return insert_sorted(source, "neuroada", "from .neuroada import NeuroAdaConfig, NeuroAdaModel\n", tuners)


def peft_type(source: str) -> str:
    """`NEUROADA` last in `PeftType` and in its docstring's list of types."""
    enum = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "PeftType")
    source = insert_lines(source, enum.body[-1].end_lineno, '    NEUROADA = "NEUROADA"\n')
    return insert_lines(source, enum.body[0].end_lineno - 1, "    - NEUROADA\n")


def default_targets(source: str) -> str:
    """The tuner's default-target mapping as peft keeps the others, first among those that differ from LoRA's."""
    anchor = "# target module mappings that differ from LORA\n"
    if source.count(anchor) != 1:
        raise ValueError(f"peft's constants.py has no single {anchor.strip()!r} to put {MAPPING} after")
    return source.replace(anchor, anchor + mapping_definition() + "\n")


def insert_lines(source: str, after_line: int, text: str) -> str:
    lines = source.splitlines(keepends=True)
    return "".join(lines[:after_line] + [text] + lines[after_line:])


def import_order(member: str) -> tuple[int, str]:
    """Where ruff's isort and RUF022 put a name: constants, classes, the rest; case aside."""
    return (0 if member.isupper() else 1 if member[:1].isupper() else 2, member.lower())


def insert_sorted(source: str, name: str, text: str, members: list[tuple[str, int]]) -> str:
    """Put `text` before the first of `members` ((name, line)) that sorts after `name` as ruff's isort and RUF022
    order them (constants, classes, the rest; case aside), or after the last one."""

    later = [line for member, line in members if import_order(member) > import_order(name)]
    return insert_lines(source, later[0] - 1, text) if later else insert_lines(source, members[-1][1], text)


EDITS: dict[str, list[Edit]] = {
    "src/peft/utils/peft_types.py": [peft_type],
    "src/peft/utils/constants.py": [default_targets],
    "src/peft/utils/other.py": [imported_from("constants", MAPPING, level=1), exported(MAPPING)],
    "src/peft/utils/__init__.py": [imported_from("other", MAPPING, level=1), exported(MAPPING)],
    "src/peft/tuners/__init__.py": [tuner_imported, exported("NeuroAdaConfig", "NeuroAdaModel")],
    "src/peft/__init__.py": [
        imported_from("tuners", "NeuroAdaConfig", "NeuroAdaModel", level=1),
        exported("NeuroAdaConfig", "NeuroAdaModel"),
    ],
    "tests/test_config.py": [
        imported_from("peft", "NeuroAdaConfig"),
        table_rows("ALL_CONFIG_CLASSES", "    (NeuroAdaConfig, {}),\n"),
    ],
    "tests/test_custom_models.py": [
        imported_from("peft", "NeuroAdaConfig"),
        table_rows("TEST_CASES", CUSTOM_MODEL_CASES),
        table_rows("MULTIPLE_ACTIVE_ADAPTERS_TEST_CASES", MULTIPLE_ACTIVE_ADAPTERS_CASES),
        parametrized_with("test_multiple_adapters_mixed_modules_to_save", "SupertuningConfig", MIXED_MODULES_TO_SAVE),
        table_rows("MIXED_ADAPTER_TEST_CASES", MIXED_BATCH_CASES, None),
        parametrized_with(
            "test_multiple_adapters_mixed_modules_to_save_order_switched", "SupertuningConfig", MIXED_MODULES_TO_SAVE
        ),
    ],
    "tests/test_decoder_models.py": [
        imported_from("peft", "NeuroAdaConfig"),
        table_rows("ALL_CONFIGS", transformers_case("CAUSAL_LM", None)),
    ],
    "tests/test_encoder_decoder_models.py": [
        imported_from("peft", "NeuroAdaConfig"),
        table_rows("ALL_CONFIGS", transformers_case("SEQ_2_SEQ_LM", SEQ2SEQ_TARGETS)),
    ],
    "tests/test_feature_extraction_models.py": [
        imported_from("peft", "NeuroAdaConfig"),
        table_rows("ALL_CONFIGS", transformers_case("FEATURE_EXTRACTION", ENCODER_TARGETS)),
    ],
    "tests/test_seq_classifier.py": [
        imported_from("peft", "NeuroAdaConfig"),
        table_rows("ALL_CONFIGS", transformers_case("SEQ_CLS", None)),
    ],
    "tests/test_quantization.py": [
        imported_from("peft", "NeuroAdaConfig"),
        table_rows("TEST_CASES", QUANTIZATION_CASE, None),
    ],
}


# ---------------------------------------------------------------------------------------------- the tuner


def mapping_statement(tree: ast.Module) -> ast.stmt | None:
    return next(
        (
            node
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            and MAPPING in {getattr(t, "id", None) for t in getattr(node, "targets", [getattr(node, "target", None)])}
        ),
        None,
    )


def mapping_definition() -> str:
    """The tuner's mapping written out for constants.py, under the comment it has in the tuner (peft's style formats
    it with the rest of the file)."""
    mapping, comment = tuner_mapping()
    entries = "".join(f"    {json.dumps(arch)}: {json.dumps(targets)},\n" for arch, targets in mapping.items())
    return f"{comment}{MAPPING} = {{\n{entries}}}\n"


def tuner_mapping() -> tuple[dict[str, list[str]], str]:
    """The tuner's default-target mapping, and the comment lines right above its definition."""
    for path in sorted(TUNER.glob("*.py")):
        source = path.read_text()
        statement = mapping_statement(ast.parse(source))
        if statement is not None:
            lines = source.splitlines(keepends=True)[: statement.lineno - 1]
            comment = []
            while lines and lines[-1].lstrip().startswith("#"):
                comment.insert(0, lines.pop())
            module = importlib.import_module(f"peft_neuroada.tuner.{path.stem}")
            return getattr(module, MAPPING), "".join(comment)
    raise ValueError(f"no file of {TUNER} defines {MAPPING}")


def without_mapping(source: str) -> str:
    """A tuner module that defines or imports the mapping, reading it from peft.utils instead."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    statement = mapping_statement(tree)
    imports = [
        node
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and MAPPING in {a.name for a in node.names}
    ]
    if statement is None and not imports:
        return source
    if statement is not None:
        start = statement.lineno - 1
        while start and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        lines[start : statement.end_lineno] = [""] * (statement.end_lineno - start)
    for node in imports:
        names = ", ".join(alias.name for alias in node.names if alias.name != MAPPING)
        kept = f"from {'.' * node.level}{node.module} import {names}\n" if names else ""
        lines[node.lineno - 1 : node.end_lineno] = [kept] + [""] * (node.end_lineno - node.lineno)
    last_import = max(n.end_lineno for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom))
    lines[last_import - 1] += f"from peft.utils import {MAPPING}\n"
    return "".join(lines)


def tuner_files() -> dict[str, str]:
    """peft/tuners/neuroada/ (before peft's style): the tuner's modules as they are, the mapping read from peft.utils,
    the package registering the method."""
    files = {}
    for path in sorted(TUNER.glob("*.py")):
        source = without_mapping(path.read_text())
        if path.name == "__init__.py":
            source = "from peft.utils import register_peft_method\n" + without_docstring(source) + REGISTRATION
        files[f"{TUNER_DIR}/{path.name}"] = source
    return files


def without_docstring(source: str) -> str:
    """The module without its docstring (peft's tuner packages have none; this one's speaks of the plugin)."""
    body = ast.parse(source).body
    if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
        return source
    return "".join(source.splitlines(keepends=True)[body[0].end_lineno :]).lstrip("\n")


# ----------------------------------------------------------------------------------------- the PR's own files


def pr_files() -> dict[str, str]:
    """docs/upstream/pr/ as it lands in peft (its ruff.toml, which lints the files there as peft does, and caches
    stay here), and the method_comparison experiments' adapter configs, written as peft writes a config."""
    files = {
        path.relative_to(PR_FILES).as_posix(): path.read_text()
        for path in sorted(PR_FILES.rglob("*"))
        if path.is_file() and path.name != "ruff.toml" and not any(part.startswith((".", "__")) for part in path.parts)
    }
    for name, k in EXPERIMENTS.items():
        files[f"{EXPERIMENTS_DIR}/{name}/adapter_config.json"] = experiment_config(k)
    return files


EXPERIMENTS_DIR = "method_comparison/MetaMathQA/experiments/neuroada"
EXPERIMENTS = {"llama-3.2-3B-k1": 1, "llama-3.2-3B-k20": 20}


def experiment_config(k: int) -> str:
    """A NeuroAda adapter_config.json for Llama-3.2-3B (the paper's seven projections, peft's benchmark's task)."""
    from peft_neuroada.tuner.config import NeuroAdaConfig

    targets = tuner_mapping()[0]["llama"]
    config = NeuroAdaConfig(k=k, target_modules=list(targets), task_type="CAUSAL_LM").to_dict()
    config.pop("peft_version", None)  # peft adds the running version when it saves
    config = {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}
    return json.dumps(config, indent=2, sort_keys=True, default=str) + "\n"


# ------------------------------------------------------------------------------------------------ the patch


def quality_pin(release: Release, name: str) -> str:
    """The version peft's setup.py pins `name` at in `extras["quality"]` (what `pip install peft[quality]` gets)."""
    extras = re.search(r'(?s)extras\["quality"\] = \[(.*?)\]', release.files["setup.py"])
    pinned = re.search(rf'"{re.escape(name)}==([^"]+)"', extras[1]) if extras else None
    if pinned is None:
        raise ValueError(f"peft's setup.py pins no {name} in extras['quality']")
    return pinned[1]


def installed_once(folder: Path, requirements: list[str], what: str) -> Path:
    """`folder`, holding `requirements` installed by `pip install --target` (once: a finished install is renamed into
    place, so a concurrent one leaves it whole)."""
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
        command = [sys.executable, "-m", "pip", "install", "--target", str(staging), *requirements]
        installed = subprocess.run(command, capture_output=True, text=True)
        if installed.returncode != 0:
            raise FileNotFoundError(f"{what}: {installed.stderr[-500:]}")
        try:
            staging.rename(folder)
        except OSError:  # another process installed it first
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def pinned_ruff(release: Release) -> Path:
    """The ruff executable at the version peft's setup.py pins, installed once into the project cache."""
    from peft_neuroada.cache import cache_root

    version = quality_pin(release, "ruff")
    folder = cache_root() / "peft-quality" / f"ruff-{version}"
    return (
        installed_once(folder, ["--no-deps", f"ruff=={version}"], f"ruff {version}, which peft pins") / "bin" / "ruff"
    )


def doc_builder(release: Release) -> tuple[list[str], dict[str, str]]:
    """The `doc-builder` command of peft's `make style` and `make quality` (hf-doc-builder and black, which peft's
    setup.py lists in `extras["quality"]` unpinned), installed once with their dependencies into the project cache;
    with the environment it runs in."""
    from peft_neuroada.cache import cache_root

    for name in ("hf-doc-builder", "black"):
        if not re.search(rf'"{name}"', release.files["setup.py"]):
            raise ValueError(f"peft's setup.py no longer lists {name}: see how its `make quality` runs doc-builder")
    folder = installed_once(
        cache_root() / "peft-quality" / "doc-builder",
        ["hf-doc-builder", "black"],
        "hf-doc-builder, which peft's make quality runs",
    )
    return [sys.executable, str(folder / "bin" / "doc-builder")], {**os.environ, "PYTHONPATH": str(folder)}


def doc_style(release: Release, arguments: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`doc-builder style ARGUMENTS --max_len 119` (peft's Makefile), run in `cwd`."""
    command, env = doc_builder(release)
    return subprocess.run(
        [*command, "style", *arguments, "--max_len", "119"], capture_output=True, text=True, cwd=cwd, env=env
    )


def ruff(release: Release, arguments: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """peft's pinned ruff run in `cwd` (a tree holding peft's pyproject.toml, whose settings it reads)."""
    return subprocess.run([str(pinned_ruff(release)), *arguments], capture_output=True, text=True, cwd=cwd)


def peft_style(files: dict[str, str], release: Release) -> dict[str, str]:
    """peft's `make style` (`ruff check --fix`, `ruff format`, with peft's pinned ruff and its pyproject.toml, then
    `doc-builder style`, which fits docstrings to 119 columns) on the files the PR adds or changes; the Python files it
    adds get peft's license header first."""
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "pyproject.toml").write_text(release.files["pyproject.toml"])
        for name, source in files.items():
            path = Path(scratch, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            new_python = name.endswith(".py") and name not in release.files
            path.write_text(LICENSE + "\n" + source if new_python else source)
        python = sorted(name for name in files if name.endswith(".py"))
        for arguments in (["check", "--fix", "--exit-zero", "--quiet"], ["format", "--quiet"]):
            run = ruff(release, [*arguments, *python], Path(scratch))
            if run.returncode != 0:
                raise RuntimeError(f"ruff {' '.join(arguments)} failed: {run.stderr}")
        run = doc_style(release, python, Path(scratch))
        if run.returncode != 0:
            raise RuntimeError(f"doc-builder style failed: {run.stdout[-1000:]}{run.stderr[-2000:]}")
        return {name: Path(scratch, name).read_text() for name in files}


class Release:
    """The text files of peft's source release (a `peft-X.tar.gz`), by path inside it."""

    def __init__(self, archive: Path) -> None:
        root = archive.name.removesuffix(".tar.gz") + "/"
        with tarfile.open(archive) as tar:
            self.files = {
                member.name.removeprefix(root): tar.extractfile(member).read().decode()
                for member in tar.getmembers()
                if member.isfile() and member.name.endswith((".py", ".md", ".yml", ".toml", ".json"))
            }


def file_diff(path: str, old: str | None, new: str) -> str:
    """One file's section of a git-style unified diff (`patch -p1` and `git apply` read both)."""
    header = f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if old is None else "")
    lines = difflib.unified_diff(
        [] if old is None else old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        "/dev/null" if old is None else f"a/{path}",
        f"b/{path}",
    )
    return header + "".join(lines)


def patched_files(release: Release) -> dict[str, str]:
    """Every file the patch adds or changes, as it reads after the patch."""
    changed = {**tuner_files(), **pr_files()}
    for path, steps in EDITS.items():
        source = release.files[path]
        for step in steps:
            source = step(source)
        changed[path] = source
    return peft_style(changed, release)


def build_patch(archive: Path) -> str:
    """The patch against the source release `archive`: every file it adds or changes, and the toctree hunk."""
    release = Release(archive)
    sections = [
        file_diff(path, release.files.get(path), text)
        for path, text in patched_files(release).items()
        if release.files.get(path) != text
    ]
    return "".join(sorted([*sections, TOCTREE_HUNK], key=lambda section: section.split("\n", 1)[0]))


def project_references(patch: str) -> list[str]:
    """Added lines of peft's copy of the tuner that name this project's files or the plugin (peft has neither)."""
    found, path = [], ""
    for line in patch.splitlines():
        if line.startswith("+++ "):
            path = line.removeprefix("+++ b/")
        elif line.startswith("+") and path.startswith(TUNER_DIR) and re.search(PROJECT_NAMES, line):
            found.append(f"{path}: {line[1:].strip()}")
    return found


PROJECT_NAMES = r"peft_neuroada|\bplugin\b|README|docs/\w+\.md|tests/test_"


# ----------------------------------------------------------------------------------------- the counts in the docs

# Methods PeftModel calls on its tuner only where the tuner defines them (BaseTuner does not): LoRA's mixed batches.
PEFT_TUNER_HOOKS = ("_enable_peft_forward_hooks",)
# Tuners of peft's whose overrides upstream.md counts beside NeuroAda's (peft.tuners class name, the name it is given).
PEER_TUNERS = {"SupertuningModel": "Super-Tuning", "ShiraModel": "SHiRA", "VeraModel": "VeRA"}


def tuner_overrides(model_class: type) -> list[str]:
    """The methods a tuner's model class defines, itself or through the classes it mixes in before BaseTuner, that
    peft calls on a tuner: those BaseTuner defines too (`_create_and_replace`, which BaseTuner requires, among them)
    and PEFT_TUNER_HOOKS; in the order defined."""
    from peft.tuners.tuners_utils import BaseTuner

    own = [cls for cls in model_class.__mro__ if cls.__module__.startswith(model_class.__module__.rpartition(".")[0])]
    return list(
        dict.fromkeys(
            name
            for cls in own
            for name, member in vars(cls).items()
            if (inspect.isfunction(member) or isinstance(member, classmethod | staticmethod))
            and (hasattr(BaseTuner, name) or name in PEFT_TUNER_HOOKS)
        )
    )


def release_overrides(release: Release, model_class: str) -> list[str]:
    """`tuner_overrides` of peft's tuner model class `model_class` as the source release holds it (its package's
    classes, and BaseTuner's methods there or nn.Module's)."""
    import torch

    tuners = {path: text for path, text in release.files.items() if path.startswith("src/peft/tuners/")}
    base_tuner = next(
        node
        for node in ast.parse(tuners["src/peft/tuners/tuners_utils.py"]).body
        if isinstance(node, ast.ClassDef) and node.name == "BaseTuner"
    )
    base_methods = {node.name for node in base_tuner.body if isinstance(node, ast.FunctionDef)}
    defining = next(path for path, text in tuners.items() if re.search(rf"(?m)^class {model_class}\b", text))
    package = defining.rpartition("/")[0] + "/"
    sources = [text for path, text in tuners.items() if path.startswith(package)]
    return source_overrides(sources, model_class, lambda name: name in base_methods or hasattr(torch.nn.Module, name))


def source_overrides(sources, model_class: str, on_base_tuner: Callable[[str], bool]) -> list[str]:
    """The methods `model_class` defines, itself or through the classes of `sources` among its bases, that peft
    calls on a tuner: those `on_base_tuner` accepts and PEFT_TUNER_HOOKS; in the order defined."""
    classes = {
        node.name: node for source in sources for node in ast.parse(source).body if isinstance(node, ast.ClassDef)
    }
    names, queue = [], [model_class]
    while queue:
        node = classes.get(queue.pop(0))
        if node is None:
            continue
        names += [
            method.name
            for method in node.body
            if isinstance(method, ast.FunctionDef)
            and (on_base_tuner(method.name) or method.name in PEFT_TUNER_HOOKS)
            and method.name not in names
        ]
        queue += [base.id for base in node.bases if isinstance(base, ast.Name)]
    return names


def patch_counts(patch: str) -> dict[str, int]:
    """Added lines (all, and those of the tuner's files), files, lines and bytes of a patch."""
    counts, path, previous = {"added": 0, "tuner": 0}, "", ""
    for line in patch.splitlines():
        if line.startswith("+++ ") and previous.startswith("--- "):  # a file's header
            path = line.removeprefix("+++ b/")
        elif line.startswith("+"):
            counts["added"] += 1
            counts["tuner"] += int(path.startswith(f"{TUNER_DIR}/"))
        previous = line
    files = len(re.findall(r"(?m)^diff --git ", patch))
    return counts | {"files": files, "lines": len(patch.splitlines()), "bytes": len(patch.encode())}


def count_texts(patch: str, release: Release) -> dict[str, str]:
    """What each marked block of docs/upstream.md and the issue says, by block name (peft's tuners counted in
    `release`)."""
    from peft_neuroada.tuner.model import NeuroAdaModel

    counts = patch_counts(patch)
    ours = tuner_overrides(NeuroAdaModel)
    hooks = [name for name in ours if name in PEFT_TUNER_HOOKS]
    peers = [f"{name} {len(release_overrides(release, cls))}" for cls, name in PEER_TUNERS.items()]
    peers[0] = peers[0].replace(" ", " has ")  # "Super-Tuning has 2, SHiRA 3, VeRA 5"
    return {
        "patch": (
            f"{counts['added']:,} added lines in {counts['files']} files, {counts['lines']:,} lines and "
            f"{round(counts['bytes'] / 1000)} kB in all; the tuner (`{TUNER_DIR}/`, license headers included) is "
            f"{counts['tuner']:,} of the added lines."
        ),
        "overrides": (
            f"{len(ours)} methods of `NeuroAdaModel` that peft calls on a tuner: {len(ours) - len(hooks)} that "
            "BaseTuner defines too (`_create_and_replace`, which BaseTuner requires, among them)"
            + "".join(f" and `{name}`, which `PeftModel` calls where a tuner defines it" for name in hooks)
            + f". Counted the same way, peft {TARGET_PEFT}'s {', '.join(peers)}."
        ),
        "sizes": sizes_text(counts),
        "tuner": tuner_sizes(),
        "features": feature_sizes(),
    }


def line_numbers(source: str) -> set[int]:
    return set(range(1, len(source.splitlines()) + 1))


def code_line_numbers(source: str) -> set[int]:
    """Numbers of the lines of `source` that are code: not blank, not a comment alone, not in a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and ast.get_docstring(node) is not None:
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    lines = source.splitlines()
    alone = {number for number, line in enumerate(lines, 1) if line.strip().startswith("#")}
    blank = {number for number, line in enumerate(lines, 1) if not line.strip()}
    return line_numbers(source) - docstrings - alone - blank


def code_lines(source: str) -> int:
    return len(code_line_numbers(source))


# What the tuner holds beyond adapting a linear layer, by its definitions ("file.py" whole, or "file.py:name" of a
# module-level class, function or constant, "file.py:Class.method" of a method): docs/design.md shows what each costs.
FEATURES: dict[str, tuple[str, ...]] = {
    "MoE experts (`target_parameters`, `ParamWrapper`)": (
        "experts.py",
        "model.py:NeuroAdaModel._check_new_adapter_config",
    ),
    "mixed batches (`adapter_names`)": (
        "model.py:BASE_ADAPTER_NAME",
        "model.py:MIXED_BATCH_REFUSAL",
        "model.py:MixedBatch",
        "model.py:NeuroAdaModel._enable_peft_forward_hooks",
        "model.py:NeuroAdaModel._serving",
        "model.py:NeuroAdaModel._mixed_batch",
        "layer.py:Linear._mixed_batch_forward",
    ),
    "quantized bases (read and requantized through peft's backends)": (
        "layer.py:FULL_PRECISION_HINT",
        "layer.py:QuantizedWeight",
        "layer.py:NeuroAdaLayer.resolved_backend",
        "layer.py:NeuroAdaLayer.quantized",
    ),
    "offloading (accelerate's hooks per call)": ("layer.py:onloaded", "layer.py:NeuroAdaLayer.offloaded_containers"),
    "`delta_dtype`": (
        "config.py:DTYPES",
        "layer.py:NeuroAdaLayer._move_adapter_to_device_of_base_layer",
        "model.py:NeuroAdaModel._cast_adapter_dtype",
    ),
    "default targets per architecture": (
        "config.py:LLAMA_STYLE_TARGETS",
        "config.py:TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING",
    ),
    "every config field checked by name": (
        "config.py:_is_int",
        "config.py:_is_none_or_names",
        "config.py:NeuroAdaConfig._check_fields",
    ),
}


def definition_lines(source: str, name: str) -> set[int]:
    """The line numbers of the definition `name` in `source` (decorators included); refuses a name it lacks, so the
    table cannot go stale silently."""
    body = ast.parse(source).body
    for part in name.split("."):
        found = [
            node
            for node in body
            if getattr(node, "name", None) == part
            or any(
                getattr(target, "id", None) == part
                for target in getattr(node, "targets", [getattr(node, "target", None)])
            )
        ]
        if len(found) != 1:
            raise ValueError(f"FEATURES names {name!r}, which the tuner does not define once; update the table")
        node, body = found[0], getattr(found[0], "body", [])
    start = min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", []))])
    return set(range(start, node.end_lineno + 1))


def feature_sizes() -> str:
    """Each of FEATURES by lines, in all and of code, and the tuner without them, as docs/design.md shows them."""
    sources = {path.name: path.read_text() for path in sorted(TUNER.glob("*.py"))}
    held: dict[str, set[tuple[str, int]]] = {}
    for feature, definitions in FEATURES.items():
        held[feature] = set()
        for definition in definitions:
            file, _, name = definition.partition(":")
            lines = definition_lines(sources[file], name) if name else line_numbers(sources[file])
            held[feature] |= {(file, number) for number in lines}
    code = {(file, number) for file, source in sources.items() for number in code_line_numbers(source)}
    everything = {(file, number) for file, source in sources.items() for number in line_numbers(source)}
    table = ["| what | lines | of code |", "|---|---:|---:|"]
    table += [f"| {feature} | {len(lines):,} | {len(lines & code):,} |" for feature, lines in held.items()]
    rest = everything - set().union(*held.values())
    table.append(f"| the tuner without these | {len(rest):,} | {len(rest & code):,} |")
    return "\n".join(table)


def tuner_sizes() -> str:
    """The tuner's files by lines, in all and of code (`code_lines`), as docs/design.md shows them."""
    rows = [(path.name, path.read_text()) for path in sorted(TUNER.glob("*.py"))]
    sizes = [(name, len(text.splitlines()), code_lines(text)) for name, text in rows]
    table = ["| file | lines | of code |", "|---|---:|---:|"]
    table += [f"| `{name}` | {lines:,} | {code:,} |" for name, lines, code in sizes]
    table.append(f"| the tuner | {sum(s[1] for s in sizes):,} | {sum(s[2] for s in sizes):,} |")
    return "\n".join(table)


def alternative_patches() -> list[Path]:
    """The alternative pull request's patches, in order."""
    return sorted(ALTERNATIVE_SERIES.glob("000[1-9]-*.patch"))


def sizes_text(counts: dict[str, int]) -> str:
    """The two ways in, by size, for the coordination issue (`counts`: this patch's)."""
    patches = [path.read_text() for path in alternative_patches()]
    added = sum(patch_counts(patch)["added"] for patch in patches)
    in_tuner = sum(
        len(re.findall(r"(?m)^\+(?!\+\+)", section))
        for patch in patches
        for section in re.split(r"(?m)^(?=diff --git )", patch)
        if section.startswith("diff --git a/src/peft/tuners/supertuning/")
    )
    return (
        f"The alternative's {len(patches)} patches add {added:,} lines ({in_tuner:,} in Super-Tuning's tuner, the "
        f"rest its tests and docs). NeuroAda's pull request adds {counts['added']:,} lines ({counts['tuner']:,} in "
        "the tuner; the rest its tests, peft's test-table rows, a docs page, an example and two method_comparison "
        "experiments)."
    )


def with_counts(doc: str, patch: str, release: Release) -> str:
    """`doc` (docs/upstream.md or the issue) with every block it marks holding what count_texts says for `patch` and
    `release` (docs/upstream.md marks every block but `sizes`, which the issue marks)."""
    for name, text in count_texts(patch, release).items():
        pattern = re.compile(rf"(<!-- counts:{name} -->\n).*?(<!-- /counts:{name} -->)", re.DOTALL)
        if not pattern.findall(doc):
            continue
        if len(pattern.findall(doc)) != 1:
            raise ValueError(f"a page marks counts:{name} more than once")
        if not text.startswith("|"):  # (a table stays as it is)
            text = textwrap.fill(text, width=119, break_long_words=False, break_on_hyphens=False)
        doc = pattern.sub(lambda match, text=text: match[1] + text + "\n" + match[2], doc)
    return doc


def source_release(folder: Path, peft_version: str = TARGET_PEFT) -> Path:
    """peft's source release `peft_version` (its tests ship there, not in the wheel), downloaded once into `folder`."""
    archive = folder / f"peft-{peft_version}.tar.gz"
    if not archive.exists():
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", f"peft=={peft_version}", "--no-deps", "--no-binary"]
        fetched = subprocess.run([*command, ":all:", "-d", str(folder)], capture_output=True, text=True)
        if fetched.returncode != 0 or not archive.exists():
            raise FileNotFoundError(f"peft {peft_version}'s source release: {fetched.stderr[-500:]}")
    return archive


def default_release() -> Path:
    from peft_neuroada.cache import cache_root

    return source_release(cache_root() / "peft-source")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="Only compare with the committed patch and counts.")
    args = parser.parse_args(argv)
    release = default_release()
    patch = build_patch(release)
    sources = Release(release)
    wanted = {PATCH: patch}
    pages = (UPSTREAM_DOC, ISSUE_DOC, DESIGN_DOC)
    wanted |= {page: with_counts(page.read_text(), patch, sources) for page in pages}
    if args.check:
        stale = [path for path, text in wanted.items() if not (path.exists() and path.read_text() == text)]
        for path in wanted:
            print(f"{path.relative_to(REPO_ROOT)} is {'stale' if path in stale else 'up to date'}")
        return int(bool(stale))
    for path, text in wanted.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO_ROOT)}: {len(text.splitlines())} lines, {len(text.encode())} bytes")
    for reference in project_references(patch):
        print(f"names this project, which peft does not hold: {reference}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
