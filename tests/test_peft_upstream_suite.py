"""The pull request peft would merge, docs/upstream/neuroada.patch, is what benchmarks/upstream_patch.py builds from
the tuner today, and it works inside peft: applied with `patch -p1` to a clean copy of the source release it targets
(`TARGET_PEFT`, whatever peft is installed), peft's own tests pass for NeuroAda in a process where the plugin cannot be
imported (a `peft_neuroada` that raises on import shadows the installed one, and its start-up hook is off). No test
adds anything to peft's files: the NeuroAda rows, `tests/test_neuroada.py` and the registration all come from the
patch.

What runs: every NeuroAda case of test_custom_models.py, test_config.py (but the three tests that read an adapter
repository on the Hub) and test_neuroada.py, those of test_quantization.py on the quantization backends the process
has (bitsandbytes and torchao run on the CPU), and those of the test files whose models come from the Hub (decoder,
encoder-decoder, feature-extraction, sequence-classification) on every model they list but three decoders
(`SERVED`), each built here from a config as a local stand-in for peft's tiny Hub model (`STAND_INS`). The patched
tree passes peft's `make quality`: its ruff commands with the ruff version peft pins and peft's pyproject.toml, and
`doc-builder style --check_only`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    DebertaConfig,
    DebertaModel,
    DebertaV2Config,
    DebertaV2Model,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    GPTJForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
    RobertaModel,
    T5Config,
    T5ForConditionalGeneration,
)

from tests.conftest import save_tiny_llama

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
UPSTREAM_DOC = BENCHMARKS.parent / "docs" / "upstream.md"
RUN_FILES = (
    "tests/test_custom_models.py",
    "tests/test_config.py",
    "tests/test_neuroada.py",
    "tests/test_quantization.py",
)
HUB_FILES = (
    "tests/test_decoder_models.py",
    "tests/test_encoder_decoder_models.py",
    "tests/test_feature_extraction_models.py",
    "tests/test_seq_classifier.py",
)
# test_config.py's tests that load an adapter repository from the Hub (no config can stand in for its files).
HUB_ONLY = [
    f"tests/test_config.py::TestPeftConfig::{name}"
    for name in ("test_from_pretrained", "test_from_pretrained_cache_dir", "test_save_pretrained_with_runtime_config")
]
TINY = {
    "vocab_size": 128,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
GPT = {
    "vocab_size": 128,
    "n_embd": 16,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
# Every model peft's four Hub-model test files list, as a local stand-in built from a config: peft's tiny Hub model's
# class and architecture, at about its size (OPT's feed-forward 4 wide, as peft's test of it assumes). BART's default
# forced end token would make the one token peft's disable test generates the same with and without an adapter.
STAND_INS: dict[str, Callable[[], PreTrainedModel]] = {
    "peft-internal-testing/tiny-random-OPTForCausalLM": lambda: OPTForCausalLM(
        OPTConfig(
            vocab_size=128,
            hidden_size=16,
            ffn_dim=4,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=16,
            max_position_embeddings=64,
        )
    ),
    "peft-internal-testing/tiny-random-GPT2LMHeadModel": lambda: GPT2LMHeadModel(GPT2Config(**GPT)),
    "peft-internal-testing/tiny-random-GPTJForCausalLM": lambda: GPTJForCausalLM(GPTJConfig(**GPT, rotary_dim=4)),
    "peft-internal-testing/tiny-random-LlamaForCausalLM": lambda: LlamaForCausalLM(
        LlamaConfig(num_key_value_heads=2, **TINY)
    ),
    "peft-internal-testing/tiny-dummy-qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **TINY)),
    "hf-internal-testing/tiny-random-Gemma3ForCausalLM": lambda: Gemma3ForCausalLM(
        Gemma3TextConfig(num_key_value_heads=2, head_dim=4, **TINY)
    ),
    "peft-internal-testing/tiny-random-T5ForConditionalGeneration-calibrated": lambda: T5ForConditionalGeneration(
        T5Config(
            vocab_size=128,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=4,
            decoder_start_token_id=0,
        )
    ),
    "peft-internal-testing/tiny-random-BartForConditionalGeneration": lambda: BartForConditionalGeneration(
        BartConfig(
            vocab_size=128,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=64,
            forced_eos_token_id=None,
        )
    ),
    "peft-internal-testing/tiny-random-BertModel": lambda: BertModel(BertConfig(**TINY)),
    "peft-internal-testing/tiny-random-RobertaModel": lambda: RobertaModel(RobertaConfig(**TINY)),
    "peft-internal-testing/tiny-random-DebertaModel": lambda: DebertaModel(DebertaConfig(**TINY)),
    "peft-internal-testing/tiny-random-DebertaV2Model": lambda: DebertaV2Model(DebertaV2Config(**TINY)),
    "peft-internal-testing/tiny-random-BertForSequenceClassification": lambda: BertForSequenceClassification(
        BertConfig(**TINY)
    ),
    "peft-internal-testing/tiny-random-RobertaForSequenceClassification": lambda: RobertaForSequenceClassification(
        RobertaConfig(**TINY)
    ),
    "peft-internal-testing/tiny-LlamaForSequenceClassification-3.2": lambda: LlamaForSequenceClassification(
        LlamaConfig(num_key_value_heads=2, pad_token_id=0, **TINY)
    ),
}
# test_quantization.py's model, quantized as each backend loads it: OPT's 12 layers (its loaders count q_proj and
# v_proj in each), 256 wide: four of bitsandbytes' 4-bit blocks of 64 values a row (OPT-125m has 12), so that a row's
# largest inputs, each its block's largest, are told apart after 4-bit quantization as in the real model (64 wide, one
# block a row, the second largest falls into a tie and NeuroAda's choice on the quantized and full-precision model
# differs: the correlation of their outputs drops to 0.88, under the test's 0.9).
QUANTIZED_MODEL = "peft-internal-testing/opt-125m"
QUANTIZED_STAND_IN = {
    QUANTIZED_MODEL: lambda: OPTForCausalLM(
        OPTConfig(
            vocab_size=128,
            hidden_size=256,
            ffn_dim=128,
            num_hidden_layers=12,
            num_attention_heads=4,
            word_embed_proj_dim=256,
            max_position_embeddings=64,
        )
    )
}
# Decoders the suite's run leaves out (each adds about 6 s to about 300): those kept are the paper's Llama, GPT-2's
# Conv1D and OPT, peft's reference decoder. `NEUROADA_ALL_DECODERS=1` serves all (docs/upstream.md: command, counts).
LEFT_OUT_DECODERS = (
    "peft-internal-testing/tiny-random-GPTJForCausalLM",
    "peft-internal-testing/tiny-dummy-qwen2",
    "hf-internal-testing/tiny-random-Gemma3ForCausalLM",
)
SERVED = [model for model in STAND_INS if os.environ.get("NEUROADA_ALL_DECODERS") or model not in LEFT_OUT_DECODERS]
QUANTIZATION_FILE = "tests/test_quantization.py"
# The test_quantization.py backends that run on the CPU when their package is installed (GPTQ needs gptqmodel).
CPU_BACKENDS = ("bnb_8bit", "bnb_4bit", "torchao_int8_weight_only", "torchao_int8_dynamic_activation_int8")
CUSTOM_MODEL_CASES = [f"Vanilla MLP {i} NeuroAda" for i in range(1, 6)]
CUSTOM_MODEL_CASES += ["Vanilla MLP 6 NeuroAda half the neurons", "Embedding + transformers Conv1D 1 NeuroAda"]


@pytest.fixture(scope="module")
def patched_tree(upstream_patch, peft_release, tmp_path_factory) -> Path:
    """A clean copy of the source release with the committed patch applied by `patch -p1`: every file section but
    the docs toctree's, whose file peft's source release does not ship."""
    root = extracted(peft_release, tmp_path_factory.mktemp("peft-tree"))
    sections = re.split(r"(?m)^(?=diff --git )", upstream_patch.PATCH.read_text())
    targets = {section: re.match(r"diff --git a/(\S+)", section)[1] for section in sections if section}
    absent = {path for section, path in targets.items() if "new file" not in section and not (root / path).exists()}
    assert absent == {upstream_patch.TOCTREE}
    apply_patch(root, "".join(section for section, path in targets.items() if path not in absent))
    return root


def extracted(release: Path, scratch: Path) -> Path:
    """A clean copy of the source release in `scratch`, its tests a package (peft's test modules import each other
    relatively)."""
    with tarfile.open(release) as archive:
        archive.extractall(scratch, filter="data")
    root = scratch / release.name.removesuffix(".tar.gz")
    (root / "tests" / "__init__.py").touch()
    return root


def apply_patch(root: Path, text: str) -> None:
    """Apply a `patch -p1` text to the tree at `root`, as a maintainer would, failing on any hunk that does not fit."""
    patched = subprocess.run(
        ["patch", "-p1", "--batch", "--forward"], input=text, text=True, capture_output=True, cwd=root
    )
    assert patched.returncode == 0, patched.stdout + patched.stderr


def hub_cache(folder: Path) -> Path:
    """The stand-ins saved as the Hub cache holds downloaded models (a snapshot per model, `refs/main` naming it)."""
    for model_id, build in {**STAND_INS, **QUANTIZED_STAND_IN}.items():
        torch.manual_seed(0)
        commit = hashlib.sha1(model_id.encode()).hexdigest()
        repository = folder / f"models--{model_id.replace('/', '--')}"
        build().save_pretrained(repository / "snapshots" / commit)
        (repository / "refs").mkdir()
        (repository / "refs" / "main").write_text(commit)
    return folder


def without_the_plugin(patched_tree: Path, scratch: Path, *more_paths: Path) -> dict[str, str]:
    """The environment of a process on the patched tree, offline, where `peft_neuroada` cannot be imported (a package
    of that name that raises on import comes first on the path) and its start-up hook is off."""
    blocked = scratch / "blocked" / "peft_neuroada"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("the plugin is not installed in this run")\n')
    paths = (patched_tree / "src", blocked.parent, *more_paths)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(path) for path in paths),
        "PEFT_NEUROADA_NO_AUTOLOAD": "1",
        "HF_HUB_OFFLINE": "1",
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    return hub_cache(tmp_path_factory.mktemp("hub"))


def run_peft_tests(tree: Path, scratch: Path, hub: Path, files: tuple[str, ...]) -> dict:
    """peft's test `files`, `-k neuroada`, in a fresh interpreter on `tree` (the Hub-model files' on the `SERVED`
    stand-ins, test_quantization.py's on `QUANTIZED_STAND_IN`): the JUnit test cases and which peft ran."""
    plugin = scratch / "plugin"
    plugin.mkdir()
    shutil.copy(Path(__file__).with_name("peft_tree_plugin.py"), plugin)
    report, junit = scratch / "report.json", scratch / "junit.xml"
    env = {
        **without_the_plugin(tree, scratch, plugin),
        "HF_HUB_CACHE": str(hub),
        "NEUROADA_STAND_INS": json.dumps([*SERVED, QUANTIZED_MODEL]),
        "NEUROADA_HUB_ONLY": json.dumps(HUB_ONLY),
        "NEUROADA_REPORT": str(report),
    }
    command = [sys.executable, "-m", "pytest", *files, "-k", "neuroada", "-x", "-q"]
    command += ["-p", "peft_tree_plugin", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}"]
    run = subprocess.run(command, capture_output=True, text=True, cwd=tree, env=env)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    return {"cases": list(ElementTree.parse(junit).iter("testcase")), "process": json.loads(report.read_text())}


@pytest.fixture(scope="module")
def peft_run(patched_tree, hub, tmp_path_factory) -> dict:
    return run_peft_tests(patched_tree, tmp_path_factory.mktemp("peft-run"), hub, (*RUN_FILES, *HUB_FILES))


def of_file(cases: list[ElementTree.Element], file: str, name_part: str = "") -> list[ElementTree.Element]:
    """The cases of one test file (`tests/x.py`) whose name holds `name_part`."""
    module = file.removesuffix(".py").replace("/", ".")
    return [case for case in cases if case.get("classname").startswith(module) and name_part in case.get("name")]


def ran(cases: list[ElementTree.Element], file: str, name_part: str = "") -> list[ElementTree.Element]:
    """Those of `of_file` that ran (were not skipped)."""
    return [case for case in of_file(cases, file, name_part) if case.find("skipped") is None]


def test_the_committed_patch_is_what_the_script_builds_from_the_tuner_today(upstream_patch, peft_release):
    built = upstream_patch.build_patch(peft_release)
    assert upstream_patch.PATCH.read_text() == built, "stale: run `python benchmarks/upstream_patch.py`"


def test_the_patch_copies_every_tuner_file_and_names_nothing_of_this_project(upstream_patch):
    """The tuner folder goes in as it is: each of its modules is a file of the patch, and no added line of the tuner
    names this project's files or the plugin (peft has neither)."""
    patch = upstream_patch.PATCH.read_text()
    copied = set(re.findall(rf"(?m)^\+\+\+ b/{upstream_patch.TUNER_DIR}/(\w+\.py)$", patch))
    assert copied == {path.name for path in upstream_patch.TUNER.glob("*.py")}
    assert upstream_patch.project_references(patch) == []


def test_the_patched_tree_passes_peft_s_make_quality(upstream_patch, peft_release, patched_tree):
    """`make quality` in the patched tree, whose pyproject.toml is peft's own: `ruff check` and `ruff format --check`
    on src, tests, examples, docs and scripts (those the tree has) with the ruff version peft's setup.py pins, and
    `doc-builder style src/peft tests docs/source --max_len 119 --check_only`: every file the patch adds or changes
    among those peft checks."""
    release = upstream_patch.Release(peft_release)
    assert upstream_patch.quality_pin(release, "ruff") == "0.16.4"  # peft 0.22.0's: a new pin, a new look at this
    folders = [folder for folder in upstream_patch.QUALITY_DIRS if (patched_tree / folder).is_dir()]
    assert {"src", "tests", "examples", "docs"} <= set(folders)
    changed = set(re.findall(r"(?m)^\+\+\+ b/(\S+\.py)$", upstream_patch.PATCH.read_text()))
    assert len(changed) >= 20 and all(path.split("/")[0] in folders for path in changed)
    version = upstream_patch.ruff(release, ["--version"], patched_tree)
    assert version.stdout.split() == ["ruff", "0.16.4"], version.stdout + version.stderr
    for command in (["check", *folders], ["format", "--check", *folders]):
        run = upstream_patch.ruff(release, command, patched_tree)
        assert run.returncode == 0, run.stdout + run.stderr
    run = upstream_patch.doc_style(release, ["src/peft", "tests", "docs/source", "--check_only"], patched_tree)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_peft_s_tests_pass_for_neuroada_in_peft_s_tree_with_the_plugin_absent(peft_run, patched_tree):
    assert peft_run["process"] == {
        "peft": str(patched_tree / "src" / "peft" / "__init__.py"),
        "NeuroAdaConfig": "peft.tuners.neuroada.config",
        "plugin_imported": False,
    }
    assert not [
        case for case in peft_run["cases"] if case.find("failure") is not None or case.find("error") is not None
    ]


def test_every_custom_model_case_runs_peft_s_generic_tuner_tests(peft_run, upstream_patch):
    for name in CUSTOM_MODEL_CASES:  # those peft's parametrization selects (docs/upstream.md: how many)
        tests = {case.get("name").split("[")[0] for case in ran(peft_run["cases"], RUN_FILES[0], f"[{name}-")}
        assert len(tests) >= 40, name
    several = ["NeuroAda Same", "NeuroAda Different"]
    several += ["NeuroAda mixed adapter"]
    for name in several:
        assert len(ran(peft_run["cases"], RUN_FILES[0], f"[{name}-")) >= 5, name
    assert len(ran(peft_run["cases"], RUN_FILES[0], "mixed_modules_to_save")) == 2


def test_neuroada_s_own_tests_and_peft_s_config_tests_run(peft_run):
    assert len(ran(peft_run["cases"], "tests/test_neuroada.py")) >= 15
    config_tests = {case.get("name").split("[")[0] for case in ran(peft_run["cases"], "tests/test_config.py")}
    assert len(config_tests) >= 15 and not config_tests & {name.rsplit("::", 1)[1] for name in HUB_ONLY}


def models_tested(file: Path) -> list[str]:
    """The Hub model ids a test file parametrizes its tests with (its `PEFT_..._MODELS_TO_TEST` list)."""
    return next(
        ast.literal_eval(statement.value)
        for statement in ast.parse(file.read_text()).body
        if isinstance(statement, ast.Assign) and statement.targets[0].id.endswith("_MODELS_TO_TEST")
    )


def test_every_model_peft_tests_on_default_targets_has_neuroada_defaults(upstream_patch, patched_tree):
    """The decoder and sequence-classification rows use `target_modules=None`: every model those files list (on
    peft's CI, from the Hub) must be an architecture the mapping knows, or its cases fail with BaseTuner's refusal."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    mapping = upstream_patch.tuner_mapping()[0]
    for file, classes in (
        ("tests/test_decoder_models.py", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        ("tests/test_seq_classifier.py", MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
    ):
        for model_id in models_tested(patched_tree / file):
            name = model_id.rsplit("/", 1)[1]
            types = {kind for kind, cls in classes.items() if cls in name or name.endswith(f"-{kind}")}
            assert types & mapping.keys(), (file, model_id, types)


def test_every_model_the_hub_model_tests_list_has_a_local_stand_in(patched_tree):
    listed = {model_id for file in HUB_FILES for model_id in models_tested(patched_tree / file)}
    assert listed == STAND_INS.keys()
    loaders = re.findall(r'(?m)^    model_id = "(\S+)"$', (patched_tree / QUANTIZATION_FILE).read_text())
    assert set(loaders) == {QUANTIZED_MODEL, "marcsun13/opt-350m-gptq-4bit"}  # GPTQ's runs with gptqmodel only


def backends_installed() -> set[str]:
    """The `CPU_BACKENDS` whose package this process has (peft's test file lists only those)."""
    from importlib.util import find_spec

    return {
        backend
        for backend in CPU_BACKENDS
        if find_spec("bitsandbytes" if backend.startswith("bnb") else "torchao") is not None
    }


def test_quantization_cases_run_for_neuroada_on_every_cpu_backend_installed(peft_run):
    """test_quantization.py's NeuroAda row: all four tests on each backend the process has, but those peft skips (no
    merge test for bitsandbytes' 4-bit on the CPU)."""
    cases = of_file(peft_run["cases"], QUANTIZATION_FILE)
    backends = {case.get("name").rsplit("-", 1)[1].rstrip("]") for case in cases}
    assert backends == backends_installed()
    for backend in backends:
        tests = {case.get("name").split("[")[0] for case in ran(cases, QUANTIZATION_FILE, f"-{backend}]")}
        expected = {
            "test_quantization_backend_is_set_and_repr",
            "test_forward_changes_output",
            "test_quantized_output_similar_to_non_quantized",
            "test_merge_unmerge_unload",
        }
        assert tests == expected - ({"test_merge_unmerge_unload"} if backend == "bnb_4bit" else set()), backend


@pytest.mark.parametrize("model_id", SERVED)
def test_hub_model_tests_run_neuroada_cases_on_every_model_s_local_stand_in(peft_run, patched_tree, model_id):
    file = next(file for file in HUB_FILES if model_id in models_tested(patched_tree / file))
    assert len(ran(peft_run["cases"], file, model_id)) >= 10


def documented(pattern: str) -> int:
    """The number docs/upstream.md gives where `pattern` (one group; the text's line breaks read as spaces) matches."""
    found = re.findall(pattern, " ".join(UPSTREAM_DOC.read_text().split()))
    assert len(found) == 1, f"docs/upstream.md no longer says {pattern!r}: change this spec with the sentence"
    return int(found[0].replace(",", ""))


# Where docs/upstream.md ("What the spec runs") gives how many cases of each Hub-model file ran on the stand-ins.
STAND_IN_COUNTS = {
    "tests/test_decoder_models.py": r"the decoder file \(([\d,]+) cases on 3 of its 6 models",
    "tests/test_encoder_decoder_models.py": r"the encoder-decoder file \(([\d,]+) on 2\)",
    "tests/test_feature_extraction_models.py": r"feature extraction \(([\d,]+) on 4\)",
    "tests/test_seq_classifier.py": r"sequence classification \(([\d,]+) on 3\)",
}


def test_upstream_md_gives_the_case_counts_of_this_run(peft_run):
    """The counts of cases in docs/upstream.md are this run's (other pages link there instead of repeating them)."""
    cases = peft_run["cases"]
    generic = [of_file(cases, RUN_FILES[0], f"[{name}-") for name in CUSTOM_MODEL_CASES]
    tests = [len({case.get("name").split("[")[0] for case in of}) for of in generic]
    counted = {
        "cases": len(cases),
        "skipped": sum(case.find("skipped") is not None for case in cases),
        "custom-model cases": len(of_file(cases, RUN_FILES[0])),
        "generic tests per single-adapter case": [min(tests), max(tests)],
        **{file: len(ran(cases, file)) for file in HUB_FILES},
    }
    said = {
        "cases": documented(r"\(([\d,]+) cases, [\d,]+ skipped by peft's own conditions"),
        "skipped": documented(r"\([\d,]+ cases, ([\d,]+) skipped by peft's own conditions"),
        "custom-model cases": documented(r"`test_custom_models.py` \(([\d,]+): "),
        "generic tests per single-adapter case": [
            documented(r"single-adapter cases through (\d+) to \d+ generic tests each"),
            documented(r"single-adapter cases through \d+ to (\d+) generic tests each"),
        ],
        **{file: documented(pattern) for file, pattern in STAND_IN_COUNTS.items()},
    }
    assert said == counted


def test_the_example_fine_tunes_and_saves_an_adapter_with_peft_alone(patched_tree, smollm2_tokenizer, tmp_path):
    """examples/neuroada_finetuning as its README runs it, on a local model and a local text dataset."""
    model = save_tiny_llama(tmp_path / "model", smollm2_tokenizer)
    data = tmp_path / "data"
    data.mkdir()
    lines = [f"Question {i}: what is {i} plus {i}? Answer: {2 * i}." for i in range(4)]
    (data / "train.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    adapter = tmp_path / "adapter"
    command = [sys.executable, "examples/neuroada_finetuning/neuroada_finetuning.py", "--base_model", str(model)]
    command += ["--data_path", str(data), "--output_dir", str(adapter), "--k", "2", "--batch_size", "2"]
    command += ["--gradient_accumulation_steps", "1"]
    env = without_the_plugin(patched_tree, tmp_path)
    run = subprocess.run(command, capture_output=True, text=True, cwd=patched_tree, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["k"]) == ("NEUROADA", 2)
    deltas = [t for key, t in load_file(adapter / "adapter_model.safetensors").items() if "neuroada_delta" in key]
    assert len(deltas) == 14 and all(delta.abs().sum() > 0 for delta in deltas)  # 7 projections x 2 layers, trained
