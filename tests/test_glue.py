"""GLUE as the official code runs it: each task's data and columns, the seeded split of the validation set, the
paper's metrics, and `neuroada train` on a GLUE recipe end to end with the real MiniLM encoder, offline."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import RobertaConfig, RobertaForSequenceClassification

from peft_neuroada.train import glue, runs
from peft_neuroada.train.cli import main
from peft_neuroada.train.glue import (
    GLUE_TASKS,
    encode,
    glue_task,
    in_training_size,
    load_glue,
    matthews_correlation,
    pearson_correlation,
    split_validation,
)
from peft_neuroada.train.models import load_adapted_model, load_base_model, load_tokenizer
from peft_neuroada.train.recipes import load_recipe
from peft_neuroada.train.training import glue_data
from tests.conftest import minilm_path

WORDS = "film acting plot music scene story actor ending score script".split()
GOOD, BAD = "fine wonderful moving lovely smart".split(), "dull awful boring clumsy flat".split()


def records(task: str, count: int, seed: int = 0) -> list[dict]:
    """`count` rows with the task's columns; a positive or negative word decides the label, so a model can learn it."""
    rng = random.Random(seed)
    spec = GLUE_TASKS[task]
    first, second = spec.text_columns
    rows = []
    for index in range(count):
        positive = index % 2 == 1
        label = (4.5 if positive else 0.5) if spec.is_regression else index % spec.num_labels
        mood = GOOD if positive else BAD
        row = {first: f"a {rng.choice(mood)} {rng.choice(WORDS)}", "label": label, "idx": index}
        if second:
            row[second] = f"the {rng.choice(WORDS)} was {rng.choice(mood)}"
        rows.append(row)
    return rows


def write(path, rows: list[dict]) -> None:
    """Rows in the file format the suffix names: csv, json (a list), jsonl or parquet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        Dataset.from_list(rows).to_parquet(str(path))


# The validation split


@pytest.mark.parametrize(
    ("task", "validation_size", "in_training"),
    [
        ("rte", 277, 138),
        ("mrpc", 408, 204),
        ("sst2", 872, 436),
        ("cola", 1043, 521),
        ("stsb", 1500, 750),
        ("qnli", 5463, 1000),
        ("mnli", 9815, 1000),
        ("qqp", 40430, 1000),
    ],
)
def test_large_validation_sets_give_1000_examples_to_training_and_small_ones_half(task, validation_size, in_training):
    assert in_training_size(validation_size) == in_training
    chosen, held_out = split_validation(validation_size, torch.Generator().manual_seed(42))
    assert len(chosen) == in_training and len(held_out) == validation_size - in_training
    assert sorted(chosen + held_out) == list(range(validation_size)), "a partition of the validation set"


def test_the_boundary_is_more_than_5000_examples():
    assert (in_training_size(5000), in_training_size(5001)) == (2500, 1000)


def test_the_split_is_the_official_random_split_of_the_seeded_global_generator():
    size = 277
    torch.manual_seed(42)
    held_out, chosen = torch.utils.data.random_split(
        range(size), [size - in_training_size(size), in_training_size(size)]
    )
    torch.manual_seed(42)
    assert split_validation(size, torch.default_generator) == (list(chosen.indices), list(held_out.indices))


def test_a_seed_fixes_the_split_and_each_seed_has_its_own():
    first = split_validation(500, torch.Generator().manual_seed(43))
    assert split_validation(500, torch.Generator().manual_seed(43)) == first
    assert split_validation(500, torch.Generator().manual_seed(44)) != first


# Metrics


def test_matthews_correlation_of_two_classes_is_the_textbook_formula():
    rng = random.Random(0)
    labels = [rng.randint(0, 1) for _ in range(200)]
    predictions = [label if rng.random() < 0.7 else 1 - label for label in labels]
    tp = sum(p == y == 1 for p, y in zip(predictions, labels, strict=True))
    tn = sum(p == y == 0 for p, y in zip(predictions, labels, strict=True))
    fp = sum(p == 1 and y == 0 for p, y in zip(predictions, labels, strict=True))
    fn = sum(p == 0 and y == 1 for p, y in zip(predictions, labels, strict=True))
    expected = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert matthews_correlation(predictions, labels) == pytest.approx(expected, abs=1e-12)


def test_matthews_correlation_of_three_classes_is_the_correlation_of_one_hot_codes():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, 300)
    predictions = np.where(rng.random(300) < 0.6, labels, rng.integers(0, 3, 300))
    x, y = np.eye(3)[predictions], np.eye(3)[labels]
    covariance = lambda a, b: np.sum((a - a.mean(0)) * (b - b.mean(0)))  # noqa: E731
    expected = covariance(x, y) / math.sqrt(covariance(x, x) * covariance(y, y))
    assert matthews_correlation(predictions.tolist(), labels.tolist()) == pytest.approx(expected, abs=1e-12)


def test_pearson_correlation_is_scipys():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(2)
    labels = rng.uniform(0, 5, 150)
    predictions = labels + rng.normal(0, 1.5, 150)
    expected = stats.pearsonr(predictions, labels).statistic
    assert pearson_correlation(predictions.tolist(), labels.tolist()) == pytest.approx(expected, abs=1e-12)
    assert pearson_correlation(predictions.tolist(), labels.tolist()) == pytest.approx(
        np.corrcoef(predictions, labels)[0, 1], abs=1e-12
    )


def test_a_constant_prediction_correlates_with_nothing():
    assert matthews_correlation([1, 1, 1, 1], [0, 1, 0, 1]) == 0.0
    assert pearson_correlation([2.0, 2.0, 2.0], [1.0, 3.0, 5.0]) == 0.0


def test_each_task_is_scored_with_the_papers_metric():
    metrics = {name: task.metric for name, task in GLUE_TASKS.items()}
    assert metrics.pop("cola") == "matthews_correlation" and metrics.pop("stsb") == "pearson"
    assert set(metrics.values()) == {"accuracy"} and len(metrics) == 6
    assert GLUE_TASKS["mnli"].validation_split == "validation_matched" and GLUE_TASKS["mnli"].num_labels == 3
    logits = torch.tensor([[0.2, 0.9], [0.8, 0.1], [0.3, 0.4]])
    assert glue.score(glue_task("sst2"), logits, [1, 0, 0]) == pytest.approx(2 / 3)
    assert glue.predictions(glue_task("stsb"), torch.tensor([[1.5], [4.0]])) == [1.5, 4.0]


# Data


@pytest.mark.parametrize("task", sorted(GLUE_TASKS))
@pytest.mark.parametrize("suffix", [".csv", ".json", ".jsonl", ".parquet"])
def test_local_files_load_with_each_tasks_columns(task, suffix, tmp_path):
    validation_name = "validation_matched" if task == "mnli" else "validation"
    write(tmp_path / task / f"train{suffix}", records(task, 6))
    write(tmp_path / task / f"{validation_name}{suffix}", records(task, 4, seed=1))
    train, validation = load_glue(glue_task(task), tmp_path)
    assert (len(train), len(validation)) == (6, 4)
    assert validation[1] == records(task, 4, seed=1)[1]


def test_mnli_also_takes_a_file_named_validation(tmp_path):
    write(tmp_path / "mnli" / "train.csv", records("mnli", 3))
    write(tmp_path / "mnli" / "validation.csv", records("mnli", 5))
    assert len(load_glue(glue_task("mnli"), tmp_path)[1]) == 5


def test_missing_data_names_the_files_to_provide_when_the_hub_is_out_of_reach(tmp_path, monkeypatch):
    def offline(task):
        raise ConnectionError("no network")

    monkeypatch.setattr(glue, "_load_from_hub", offline)
    write(tmp_path / "rte" / "train.csv", records("rte", 3))
    with pytest.raises(FileNotFoundError) as error:
        load_glue(glue_task("rte"), tmp_path)
    message = str(error.value)
    assert str(tmp_path / "rte") in message and "validation.{csv/json/jsonl/parquet}" in message
    assert "sentence1, sentence2, label" in message and "ConnectionError: no network" in message


def test_files_without_the_tasks_columns_are_refused(tmp_path):
    write(tmp_path / "qnli" / "train.csv", [{"sentence1": "a", "sentence2": "b", "label": 0}])
    write(tmp_path / "qnli" / "validation.csv", records("qnli", 2))
    with pytest.raises(ValueError, match=r"'qnli' training data lacks the column\(s\) \['question', 'sentence'\]"):
        load_glue(glue_task("qnli"), tmp_path)


def test_rows_are_the_official_ones_cut_at_max_length_with_a_masked_pad_token_appended(minilm_tokenizer):
    tokenizer = load_tokenizer(str(minilm_path()), "paper", 8)
    assert tokenizer.pad_token == tokenizer.unk_token == "[UNK]", "the official pad token is unk"
    pair = Dataset.from_list([{"sentence1": "a fine film", "sentence2": "the film was fine", "label": 1}])
    (row,) = encode(glue_task("rte"), pair, tokenizer, max_length=64)
    expected = minilm_tokenizer("a fine film", "the film was fine")["input_ids"]
    assert row["input_ids"] == [*expected, tokenizer.pad_token_id]
    assert row["attention_mask"] == [1] * len(expected) + [0] and row["labels"] == 1
    (cut,) = encode(glue_task("rte"), pair, tokenizer, max_length=8)
    assert len(cut["input_ids"]) == 9 and cut["input_ids"][-2] == tokenizer.sep_token_id
    scored = Dataset.from_list([{"sentence1": "a", "sentence2": "b", "label": 3}])
    assert encode(glue_task("stsb"), scored, tokenizer, 16)[0]["labels"] == 3.0


# neuroada train on a GLUE recipe, offline, with the real MiniLM encoder


def glue_recipe(tmp_path, task: str, epochs: int = 2, model: Path | None = None) -> str:
    validation_name = "validation_matched" if task == "mnli" else "validation"
    write(tmp_path / "data" / task / "train.csv", records(task, 32))
    write(tmp_path / "data" / task / f"{validation_name}.csv", records(task, 24, seed=1))
    path = tmp_path / f"{task}.yaml"
    path.write_text(
        f"""
model: {model or minilm_path()}
protocol: paper
task: glue
output_dir: {tmp_path / "run"}
method: {{name: neuroada, k: 1}}
data: {{dir: {tmp_path / "data"}, train: [{task}], max_length: 32}}
training: {{learning_rate: 1.0e-2, batch_size: 8, epochs: {epochs}, warmup: 0.0, logging_steps: 1}}
evaluation: {{batch_size: 8}}
"""
    )
    return str(path)


def saved_logits(results_dir, task: str) -> tuple[list[int], torch.Tensor]:
    lines = [json.loads(line) for line in (results_dir / f"predictions_{task}.jsonl").open()]
    return [line["index"] for line in lines], torch.tensor([line["logits"] for line in lines])


@pytest.mark.parametrize("task", ["sst2", "stsb"])
def test_train_keeps_the_best_epoch_and_reports_it_on_the_held_out_examples(task, tmp_path):
    recipe_path = glue_recipe(tmp_path, task)
    assert main(["train", recipe_path]) == 0

    run = tmp_path / "run"
    results = json.loads((run / "results" / "results.json").read_text())
    metric = "accuracy" if task == "sst2" else "pearson"
    assert (results["task"], results["metric"], results["protocol"], results["seed"]) == (task, metric, "paper", 42)
    assert (results["held_out_size"], results["in_training_size"]) == (12, 12)
    assert results["merged"] is True, "the paper protocol evaluates the merged model"
    epochs = [entry["score"] for entry in results["epochs"]]
    assert len(epochs) == 2 and results["best_epoch"] == 1 + epochs.index(max(epochs))
    assert results["in_training_score"] == max(epochs)
    assert -1 <= results["score"] <= 1 and results["head_parameters"] > 0

    recipe = load_recipe(recipe_path)
    data = glue_data(recipe)
    indices, logits = saved_logits(run / "results", task)
    assert indices == data.held_out, "the predictions are the held-out examples', in the split's order"
    torch.manual_seed(7)  # another fresh head underneath: the saved one must replace it
    model, tokenizer = load_adapted_model(
        recipe.model, recipe.adapter_dir, "float32", "paper", 32, num_labels=glue_task(task).num_labels
    )
    held_out = encode(data.task, data.validation.select(data.held_out), tokenizer, 32)
    reloaded = glue.classify(model, held_out, 8, tokenizer.pad_token_id)
    torch.testing.assert_close(reloaded, logits, rtol=1e-5, atol=1e-5)
    in_training = encode(data.task, data.validation.select(data.in_training), tokenizer, 32)
    labels = [row["labels"] for row in in_training]
    best = glue.score(data.task, glue.classify(model, in_training, 8, tokenizer.pad_token_id), labels)
    assert best == pytest.approx(results["in_training_score"], abs=1e-6), "the saved adapter is the best epoch's"


def test_a_roberta_recipe_scores_its_merged_model(tmp_path, minilm_tokenizer):
    """The paper's GLUE runs adapt RoBERTa, whose classification head (dense + out_proj, no weight of its own) trains
    through `modules_to_save` and is merged with the deltas before scoring. A small random RoBERTa, with the MiniLM
    tokenizer's vocabulary."""
    config = RobertaConfig(vocab_size=minilm_tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64, max_position_embeddings=40, type_vocab_size=2,
                           pad_token_id=minilm_tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    RobertaForSequenceClassification(config).save_pretrained(tmp_path / "roberta")
    minilm_tokenizer.save_pretrained(tmp_path / "roberta")
    recipe_path = glue_recipe(tmp_path, "rte", epochs=1, model=tmp_path / "roberta")
    assert main(["train", recipe_path]) == 0
    results = json.loads((tmp_path / "run" / "results" / "results.json").read_text())
    assert results["merged"] is True and 0 <= results["score"] <= 1 and results["head_parameters"] > 0
    recipe = load_recipe(recipe_path)
    data = glue_data(recipe)
    model, tokenizer = load_adapted_model(recipe.model, recipe.adapter_dir, "float32", "paper", 32, num_labels=2)
    held_out = encode(data.task, data.validation.select(data.held_out), tokenizer, 32)
    unmerged = glue.classify(model, held_out, 8, tokenizer.pad_token_id)  # the trained head, the deltas apart
    torch.testing.assert_close(saved_logits(tmp_path / "run" / "results", "rte")[1], unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bf16", [False, True])
def test_held_out_examples_are_scored_under_the_autocast_the_recipe_trains_with(bf16, tmp_path, monkeypatch):
    """As the official code's final test, which runs the model accelerate wrapped for training: under bf16 autocast
    when training used it (the official runs did not: docs/fidelity.md, precision)."""
    recipe = load_recipe(glue_recipe(tmp_path, "rte"), [f"training.bf16={str(bf16).lower()}"])
    data = glue_data(recipe)
    model, tokenizer = load_base_model(recipe.model, "float32", recipe.protocol, 32, data.task.num_labels)
    autocast, classify = [], runs.classify

    def recording_autocast(*args):
        autocast.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return classify(*args)

    monkeypatch.setattr(runs, "classify", recording_autocast)
    runs.evaluate_glue_model(recipe, model, tokenizer, data, tmp_path / "scored", "base model")
    assert autocast == [bf16]


def test_eval_reproduces_the_score_and_another_seed_splits_otherwise(tmp_path):
    recipe_path = glue_recipe(tmp_path, "rte", epochs=1)
    assert main(["train", recipe_path]) == 0
    trained = json.loads((tmp_path / "run" / "results" / "results.json").read_text())
    assert main(["eval", recipe_path, "--output", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["score"] == pytest.approx(trained["score"], abs=1e-6) and again["held_out_size"] == 12

    seed_42 = glue_data(load_recipe(recipe_path)).held_out
    assert glue_data(load_recipe(recipe_path, ["seed=43"])).held_out != seed_42
    assert glue_data(load_recipe(recipe_path)).held_out == seed_42
