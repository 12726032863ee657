"""GLUE, the paper's third family of results: sequence classification with a trained head, scored as the official
code's `glue` task scores it (FightingFighting/NeuroAda train_our.py and dataset.py, on pyreft 0.0.8, after LoReFT's
examples/loreft/train.py, which follows RED's protocol).

* Data: `datasets.load_dataset("glue", TASK)`, or local files `DIR/TASK/{train,validation}.{csv,json,jsonl,parquet}`
  with GLUE's column names (MNLI's validation file may be named `validation_matched`). Only the validation set is
  scored: GLUE's test labels are hidden.
* The validation set is split in two (`split_validation`): the best epoch is chosen on the in-training part and
  reported on the held-out part.
* Metric per task: Matthews correlation (CoLA), Pearson correlation (STS-B), accuracy otherwise; MNLI is scored on
  its matched validation set.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, load_dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

LOCAL_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
LARGE_VALIDATION = 5000
"""Official train_our.py L338-L341: a validation set larger than this gives 1,000 examples to in-training
evaluation (QQP, MNLI, QNLI), a smaller one half of its examples."""
LARGE_IN_TRAINING_SIZE = 1000


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its text columns (official dataset.py L15-L25), label count (1 = regression, dataset.py
    L56-L61) and metric (train_our.py L48-L57), and the validation split the paper reports on."""

    name: str
    text_columns: tuple[str, str | None]
    num_labels: int
    metric: str
    validation_split: str = "validation"

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1


GLUE_TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in (
        GlueTask("cola", ("sentence", None), 2, "matthews_correlation"),
        GlueTask("sst2", ("sentence", None), 2, "accuracy"),
        GlueTask("mrpc", ("sentence1", "sentence2"), 2, "accuracy"),
        GlueTask("stsb", ("sentence1", "sentence2"), 1, "pearson"),
        GlueTask("qqp", ("question1", "question2"), 2, "accuracy"),
        GlueTask("mnli", ("premise", "hypothesis"), 3, "accuracy", "validation_matched"),
        GlueTask("qnli", ("question", "sentence"), 2, "accuracy"),
        GlueTask("rte", ("sentence1", "sentence2"), 2, "accuracy"),
    )
}


def glue_task(name: str) -> GlueTask:
    if name not in GLUE_TASKS:
        raise ValueError(f"Unknown GLUE task {name!r}; the paper's are {sorted(GLUE_TASKS)}.")
    return GLUE_TASKS[name]


def _local_file(folder: Path, splits: Sequence[str]) -> Path | None:
    for split in splits:
        for suffix in LOCAL_FORMATS:
            if (folder / f"{split}{suffix}").is_file():
                return folder / f"{split}{suffix}"
    return None


def _read_local(path: Path) -> Dataset:
    return load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")


def _load_from_hub(task: GlueTask) -> tuple[Dataset, Dataset]:
    """GLUE from the Hugging Face hub, as the official code loads it (pyreft's ReftDataset.load_dataset)."""
    loaded = load_dataset("glue", task.name)
    return loaded["train"], loaded[task.validation_split]


def load_glue(task: GlueTask, data_dir: str | Path) -> tuple[Dataset, Dataset]:
    """The task's training and validation sets: local files in `data_dir/TASK/` when there are any, else the hub."""
    folder = Path(data_dir) / task.name
    validation_names = dict.fromkeys((task.validation_split, "validation"))
    train_file, validation_file = _local_file(folder, ["train"]), _local_file(folder, list(validation_names))
    if train_file and validation_file:
        train, validation = _read_local(train_file), _read_local(validation_file)
    else:
        try:
            train, validation = _load_from_hub(task)
        except Exception as error:
            formats = "/".join(suffix.lstrip(".") for suffix in LOCAL_FORMATS)
            raise FileNotFoundError(
                f"No GLUE data for '{task.name}': {folder} has no train.{{{formats}}} and "
                f"{' or '.join(validation_names)}.{{{formats}}} files, and datasets.load_dataset('glue', "
                f"'{task.name}') failed ({type(error).__name__}: {error}). Put the two files there (GLUE's columns: "
                f"{', '.join(c for c in task.text_columns if c)}, label), or go online."
            ) from error
    for name, split in (("training", train), ("validation", validation)):
        missing = {column for column in (*task.text_columns, "label") if column} - set(split.column_names)
        if missing:
            raise ValueError(f"GLUE '{task.name}' {name} data lacks the column(s) {sorted(missing)}.")
    return train, validation


def in_training_size(validation_size: int) -> int:
    """How many validation examples choose the best epoch (official train_our.py L338-L341)."""
    return LARGE_IN_TRAINING_SIZE if validation_size > LARGE_VALIDATION else validation_size // 2


def split_validation(validation_size: int, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """(in-training, held-out) validation indices, as `torch.utils.data.random_split(validation, [held-out size,
    in-training size])` draws them (official train_our.py L343-L347): one permutation, the held-out part first.

    The official code draws it from torch's global generator right after `set_seed(seed)` (train_our.py L506), so
    each run seed gets its own split; pass `torch.default_generator` just seeded to get the official one.
    """
    held_out_size = validation_size - in_training_size(validation_size)
    order = torch.randperm(validation_size, generator=generator).tolist()
    return order[held_out_size:], order[:held_out_size]


def encode(
    task: GlueTask, records: Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> list[dict[str, Any]]:
    """The official rows: the text (pair) tokenised and cut at `max_length` (dataset.py L68-L74), then one pad token
    appended with attention 0, attention being 0 wherever the id is the pad id (pyreft's pad_mode "last",
    dataset.py L48). Like the official rows they carry no token_type_ids."""
    first, second = task.text_columns
    rows = []
    for record in records:
        texts = (record[first],) if second is None else (record[first], record[second])
        input_ids = [*tokenizer(*texts, max_length=max_length, truncation=True)["input_ids"], tokenizer.pad_token_id]
        label = float(record["label"]) if task.is_regression else int(record["label"])
        rows.append(
            {
                "input_ids": input_ids,
                "attention_mask": [int(token != tokenizer.pad_token_id) for token in input_ids],
                "labels": label,
            }
        )
    return rows


def accuracy(predictions: Sequence[float], labels: Sequence[float]) -> float:
    return sum(p == y for p, y in zip(predictions, labels, strict=True)) / len(labels)


def matthews_correlation(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Matthews correlation for any number of classes (Gorodkin's R_K, sklearn's matthews_corrcoef); 0 when every
    prediction or every label is one class."""
    classes = sorted(set(predictions) | set(labels))
    total = len(labels)
    correct = sum(p == y for p, y in zip(predictions, labels, strict=True))
    predicted = [sum(p == c for p in predictions) for c in classes]
    actual = [sum(y == c for y in labels) for c in classes]
    covariance = correct * total - sum(p * a for p, a in zip(predicted, actual, strict=True))
    spread = (total**2 - sum(p * p for p in predicted)) * (total**2 - sum(a * a for a in actual))
    return covariance / math.sqrt(spread) if spread else 0.0


def pearson_correlation(predictions: Sequence[float], labels: Sequence[float]) -> float:
    """Pearson's r (scipy's pearsonr statistic); 0 for constant predictions or labels, where r is undefined."""
    mean_p, mean_y = sum(predictions) / len(predictions), sum(labels) / len(labels)
    covariance = sum((p - mean_p) * (y - mean_y) for p, y in zip(predictions, labels, strict=True))
    spread = sum((p - mean_p) ** 2 for p in predictions) * sum((y - mean_y) ** 2 for y in labels)
    return covariance / math.sqrt(spread) if spread else 0.0


METRICS = {"accuracy": accuracy, "matthews_correlation": matthews_correlation, "pearson": pearson_correlation}


def predictions(task: GlueTask, logits: torch.Tensor) -> list[float]:
    """The score itself for regression, else the arg-max class (official train_our.py L359)."""
    logits = logits.float()
    return logits.squeeze(-1).tolist() if task.is_regression else logits.argmax(-1).tolist()


def score(task: GlueTask, logits: torch.Tensor, labels: Sequence[float]) -> float:
    """The task's metric of the model's logits against the gold labels."""
    return METRICS[task.metric](predictions(task, logits), list(labels))


@torch.no_grad()
def classify(model: PreTrainedModel, rows: list[dict[str, Any]], batch_size: int, pad_token_id: int) -> torch.Tensor:
    """The model's logits for encoded rows, in their order, batches padded on the right as the official collator
    (DataCollatorWithPadding, padding="longest") pads them."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    outputs = []
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            width = max(len(row["input_ids"]) for row in batch)
            input_ids = [row["input_ids"] + [pad_token_id] * (width - len(row["input_ids"])) for row in batch]
            attention = [row["attention_mask"] + [0] * (width - len(row["attention_mask"])) for row in batch]
            logits = model(
                input_ids=torch.tensor(input_ids, device=device), attention_mask=torch.tensor(attention, device=device)
            ).logits
            outputs.append(logits.float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(outputs)


def write_glue_results(
    task: GlueTask, value: float, records: list[dict[str, Any]], output_dir: str | Path, metadata: dict[str, Any]
) -> Path:
    """results.json (the task's metric on the held-out examples, with the run's metadata), results.csv (one row) and
    predictions_TASK.jsonl (validation index, label, prediction and logits of each held-out example)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    summary = {"task": task.name, "metric": task.metric, "score": value, "held_out_size": len(records), **metadata}
    (output_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(output_dir / "results.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "metric", "score", "held_out_size", "seed", "protocol"])
        writer.writerow([task.name, task.metric, f"{value:.4f}", len(records), metadata["seed"], metadata["protocol"]])
    with open(output_dir / f"predictions_{task.name}.jsonl", "w") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    return output_dir / "results.json"
