"""The `neuroada` command end to end: train, eval, compare on real data with a tiny random Llama, and the demo."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, set_seed

from peft_neuroada.train import training
from peft_neuroada.train.cli import ESTIMATE_METHODS, PROTOCOL_NAMES, TRAINING_EXTRA, main
from peft_neuroada.train.default_model import default_model_path
from peft_neuroada.train.estimate import METHODS
from peft_neuroada.train.protocols import PROTOCOLS
from peft_neuroada.train.recipes import load_recipe
from tests.conftest import save_tiny_llama
from tests.shared_data import shared_datasets

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Llama with SmolLM2's tokenizer, saved like any local model."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer)


def write_recipe(path: Path, model: Path, output_dir: Path, method: str) -> Path:
    path.write_text(
        f"""
model: {model}
output_dir: {output_dir}
method: {method}
data: {{dir: {shared_datasets()}, train: [commonsense_15k, math_10k], train_size: 6, max_length: 384}}
training: {{learning_rate: 1.0e-2, batch_size: 2, max_steps: 3, warmup: 1, logging_steps: 1, save_steps: 2}}
evaluation: {{tasks: [ARC-Easy, gsm8k], size: 3, batch_size: 3, max_new_tokens_options: 4, max_new_tokens_number: 4}}
"""
    )
    return path


def predictions(results_dir: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (results_dir / f"predictions_{task}.jsonl").open()]


def test_console_script_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["neuroada"] == "peft_neuroada.train.cli:main"


def test_the_training_packages_are_an_extra_that_the_test_extra_includes():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert not any(name in core for name in ("datasets", "pyyaml", "gguf"))
    extra = {spec.split(">")[0] for spec in project["optional-dependencies"]["train"]}
    assert extra == {"datasets", "pyyaml", "gguf", "tqdm"}
    assert "peft-neuroada[train]" in project["optional-dependencies"]["test"]
    assert set(TRAINING_EXTRA) == {"datasets", "yaml", "gguf", "tqdm"}, "the modules the extra's packages provide"


def test_a_missing_training_extra_is_named_with_the_command_that_installs_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if it were not installed
    with pytest.raises(SystemExit, match=r'\(gguf missing\): pip install -e "\.\[train\]"'):
        main(["train", "recipe.yaml"])


def test_the_default_model_names_the_extra_that_converts_it(monkeypatch, tmp_path):
    """Through the library (no `neuroada` command to check the extra first), before transformers' generic error."""
    monkeypatch.setenv("PEFT_NEUROADA_CACHE", str(tmp_path))  # nothing converted yet
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"needs the 'gguf' package, part of the training extra: pip install -e"):
        default_model_path()


def test_the_command_line_knows_the_protocols_and_estimated_methods_without_importing_them():
    assert PROTOCOL_NAMES == tuple(sorted(PROTOCOLS))
    assert ESTIMATE_METHODS == METHODS


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("train", "eval", "compare", "demo", "prompts", "score", "estimate"))


def test_train_then_eval_reproduces_the_scores_from_the_saved_adapter(tiny_llama_dir, tmp_path, capsys):
    output = tmp_path / "run"
    recipe = write_recipe(tmp_path / "neuroada.yaml", tiny_llama_dir, output, "{name: neuroada, k: 2}")
    assert main(["train", str(recipe)]) == 0
    assert re.search(r"\| neuroada k=2 \| [\d,]+ \| 3 \| \d+ s \|", capsys.readouterr().out), "the run's cost is shown"

    adapter_config = json.loads((output / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "NEUROADA" and adapter_config["k"] == 2
    log = json.loads((output / "train_log.json").read_text())
    assert log["steps"] == 3 and log["train_examples"] == 6
    assert [entry["step"] for entry in log["log_history"] if "loss" in entry] == [1, 2, 3]
    assert (output / "checkpoints" / "checkpoint-2").is_dir()
    after_training = json.loads((output / "results" / "results.json").read_text())
    assert set(after_training["tasks"]) == {"ARC-Easy", "gsm8k"} and after_training["method"] == "neuroada k=2"
    trained_predictions = predictions(output / "results", "gsm8k")

    assert main(["eval", str(recipe)]) == 0
    assert predictions(output / "results", "gsm8k") == trained_predictions

    assert main(["eval", str(recipe), "--base", "--output", str(tmp_path / "base")]) == 0
    assert json.loads((tmp_path / "base" / "results.json").read_text())["method"] == "base model"
    assert (tmp_path / "base" / "results.csv").read_text().splitlines()[-1].startswith("average,")


class ModelLoaded(Exception):
    pass


def test_training_seeds_before_it_loads_the_model_as_the_official_run_does(tiny_llama_dir, tmp_path, monkeypatch):
    """A pad row the tokenizer adds (Llama-3) is drawn when the model loads: from the recipe's seed, as officially."""
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama_dir, tmp_path / "run", "{name: neuroada, k: 1}"))
    drawn = []

    def load_base_model(*args, **kwargs):
        drawn.append(torch.rand(4))
        raise ModelLoaded

    monkeypatch.setattr(training, "load_base_model", load_base_model)
    torch.manual_seed(recipe.seed + 1)  # whatever state the process was in
    with pytest.raises(ModelLoaded):
        training.fine_tune(recipe)
    set_seed(recipe.seed)
    assert torch.equal(drawn[0], torch.rand(4))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["train", "no-such-recipe.yaml"], r"neuroada train: error: .*no-such-recipe\.yaml"),
        (
            ["train", "{recipe}", "--set", "training.nope=1"],
            r"neuroada train: error: Unknown recipe key\(s\) \['nope'\]",
        ),
        (["train", "{recipe}", "--set", "data.dir={empty}"], r"No train data for .*--set data\.dir=PATH"),
        (["eval", "{recipe}", "--set", "dtype=float8"], r"neuroada eval: error: dtype must be one of"),
        (
            ["train", "{recipe}", "--set", "task=glue", "--set", "data.train=[nope]", "--set", "evaluation.tasks=[]"],
            r"neuroada train: error: Unknown GLUE task 'nope'",
        ),
        (["train", "{recipe}", "--set", "method.k=0"], r"neuroada train: error: method \(neuroada\): .*k must be"),
        (["train", "{recipe}", "--set", "training.learning_rate=fast"], r"training\.learning_rate must be a number"),
        (["train", "{broken}"], r"error: .*broken\.yaml is not valid YAML"),
        (["train", "{empty}"], r"error: .*empty is a folder; name a recipe file in it"),
        (["eval", "{recipe}"], r"neuroada eval: error: No adapter in .*: train it first"),
        (["score", "{recipe}", "--protocol", "paper", "--out", "{empty}/x.jsonl"], r"r\.yaml:2 is not a JSON line"),
    ],
    ids=[
        "missing recipe",
        "unknown key",
        "missing data",
        "bad value",
        "unknown GLUE task",
        "bad method value",
        "not a number",
        "broken YAML",
        "a folder",
        "eval before train",
        "not predictions",
    ],
)
def test_what_the_user_named_wrong_ends_in_one_message_not_a_traceback(tiny_llama_dir, tmp_path, arguments, message):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama_dir, tmp_path / "out", "{name: neuroada, k: 1}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.yaml").write_text("training: {learning_rate: 1\n")
    places = {"recipe": recipe, "empty": tmp_path / "empty", "broken": tmp_path / "broken.yaml"}
    arguments = [argument.format(**places) for argument in arguments]
    with pytest.raises(SystemExit, match=message) as exit_info:
        main(arguments)
    assert exit_info.value.__cause__ is None and exit_info.value.__suppress_context__


def test_compare_tabulates_neuroada_against_lora(tiny_llama_dir, tmp_path, capsys):
    neuroada = write_recipe(tmp_path / "n.yaml", tiny_llama_dir, tmp_path / "n", "{name: neuroada, k: 1}")
    lora = write_recipe(tmp_path / "l.yaml", tiny_llama_dir, tmp_path / "l", "{name: lora, r: 2, alpha: 4}")
    assert main(["compare", str(neuroada), str(lora), "--output", str(tmp_path / "cmp")]) == 0
    rows = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert [row["method"] for row in rows] == ["base model", "neuroada k=1", "lora r=2"]
    assert (
        all(row["steps"] == 3 for row in rows[1:])
        and rows[1]["trainable_parameters"] < rows[2]["trainable_parameters"]
    )
    assert set(rows[0]) >= {"ARC-Easy", "gsm8k", "average"}
    table = capsys.readouterr().out
    assert "| lora r=2 |" in table
    assert "| base model | - | - | - |" in table, "an untrained row shows no training cost"
    assert (tmp_path / "cmp" / "comparison.csv").read_text().startswith("method,trainable_parameters,steps")


def test_demo_trains_saves_reloads_and_merges_smollm2(tmp_path, capsys):
    code = main(["demo", "--output", str(tmp_path), "--steps", "2", "--train-size", "8", "--test-size", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "reloaded + merged model answers: identical" in out
    assert "average" in out and "trained" in out
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    for name in ("base", "trained", "merged"):
        assert (tmp_path / f"results_{name}" / "results.csv").is_file()
