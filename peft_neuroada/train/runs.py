"""What the `neuroada` subcommands do: train and evaluate recipes, evaluate saved adapters, compare methods, show
a protocol's prompts and re-score saved predictions."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .data import dataset_file, load_examples
from .evaluate import evaluate_tasks, write_results
from .glue import classify, encode, predictions, score, write_glue_results
from .models import load_adapted_model, load_base_model
from .protocols import get_protocol
from .recipes import Recipe
from .scoring import accuracy_by_task, read_predictions, score_predictions, write_predictions
from .training import GlueData, GlueTraining, fine_tune, fine_tune_glue, glue_data, training_autocast


@dataclass
class RunSummary:
    """One row of a comparison: a method's score per task (accuracy, or a GLUE task's metric) and on average, with
    what it cost to train."""

    label: str
    scores: dict[str, float]
    protocol: str
    trainable_parameters: int = 0
    steps: int = 0
    train_seconds: float = 0.0

    def with_average(self) -> dict[str, float]:
        """The scores and their unweighted mean over tasks, as the paper's "Avg." column."""
        if not self.scores:
            return {}
        return self.scores | {"average": sum(self.scores.values()) / len(self.scores)}


def _for_evaluation(recipe: Recipe, model: PreTrainedModel | PeftModel) -> PreTrainedModel | PeftModel:
    """The model merged (a new model; the adapter is gone from `model`) when the recipe evaluates merged models."""
    return model.merge_and_unload() if recipe.merge_before_evaluation and isinstance(model, PeftModel) else model


def evaluate_recipe_model(
    recipe: Recipe,
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: Path,
    label: str,
) -> dict[str, float]:
    """Score `model` on the recipe's evaluation tasks (under the autocast it trains with) and write results.json/.csv
    and predictions to `output_dir`."""
    spec = recipe.evaluation
    if not spec.tasks:
        return {}
    model = _for_evaluation(recipe, model)
    with training_autocast(recipe, model):
        results = evaluate_tasks(model, tokenizer, recipe.data.dir, spec, recipe.protocol)
    metadata = {
        "recipe": recipe.name,
        "model": recipe.model,
        "method": label,
        "eval_size_per_task": spec.size,
        "merged": recipe.merge_before_evaluation,
    }
    path = write_results(results, output_dir, metadata)
    print(f"results written to {path}")
    return {result.task: result.accuracy for result in results}


def evaluate_glue_model(
    recipe: Recipe,
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    data: GlueData,
    output_dir: Path,
    label: str,
    training: GlueTraining | None = None,
) -> dict[str, float]:
    """Score `model` on the held-out validation examples of the recipe's GLUE task (under the autocast it trains
    with) and write results.json/.csv and the predictions to `output_dir`."""
    task = data.task
    rows = encode(task, data.validation.select(data.held_out), tokenizer, recipe.data.max_length)
    model = _for_evaluation(recipe, model)
    with training_autocast(recipe, model):
        logits = classify(model, rows, recipe.evaluation.batch_size, tokenizer.pad_token_id)
    labels = [row["labels"] for row in rows]
    value = score(task, logits, labels)
    metadata = {
        "recipe": recipe.name,
        "model": recipe.model,
        "method": label,
        "protocol": recipe.protocol,
        "seed": recipe.seed,
        "merged": recipe.merge_before_evaluation,
        "in_training_size": len(data.in_training),
        **(training.summary() if training else {}),
    }
    records = [
        {"index": index, "label": label_, "prediction": prediction, "logits": row_logits}
        for index, label_, prediction, row_logits in zip(
            data.held_out, labels, predictions(task, logits), logits.tolist(), strict=True
        )
    ]
    path = write_glue_results(task, value, records, output_dir, metadata)
    print(f"results written to {path}")
    return {task.name: value}


def train_and_evaluate(recipe: Recipe, evaluate: bool = True) -> RunSummary:
    """Train the recipe's adapter, save it, and score it unless `evaluate` is False."""
    output, label = Path(recipe.output_dir) / "results", recipe.method.label
    scores: dict[str, float] = {}
    if recipe.glue:
        training = fine_tune_glue(recipe)
        outcome = training.outcome
        print(f"adapter saved to {outcome.adapter_dir} (best epoch {training.best_epoch:g})")
        if evaluate:
            scores = evaluate_glue_model(
                recipe, outcome.model, outcome.tokenizer, training.data, output, label, training
            )
    else:
        outcome = fine_tune(recipe)
        print(f"adapter saved to {outcome.adapter_dir}")
        if evaluate:
            scores = evaluate_recipe_model(recipe, outcome.model, outcome.tokenizer, output, label)
    summary = RunSummary(label, scores, recipe.protocol, outcome.trainable_parameters, outcome.steps, outcome.seconds)
    print(format_table([summary]))
    return summary


def evaluate_saved(recipe: Recipe, adapter_dir: str | Path | None, output_dir: str | Path | None = None) -> RunSummary:
    """Evaluate the recipe's base model with the adapter in `adapter_dir`, or the bare base model when None."""
    if adapter_dir is not None and not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"No adapter in {adapter_dir}: train it first (neuroada train CONFIG), or name one with --adapter DIR."
        )
    protocol, max_length = recipe.protocol, recipe.data.max_length
    data = glue_data(recipe) if recipe.glue else None
    num_labels = data.task.num_labels if data else None
    if adapter_dir is None:
        model, tokenizer = load_base_model(recipe.model, recipe.dtype, protocol, max_length, num_labels)
        label, default_output = "base model", Path(recipe.output_dir) / "results_base"
    else:
        model, tokenizer = load_adapted_model(
            recipe.model, adapter_dir, recipe.dtype, protocol, max_length, num_labels
        )
        label, default_output = recipe.method.label, Path(recipe.output_dir) / "results"
    output = Path(output_dir or default_output)
    if data:
        scores = evaluate_glue_model(recipe, model, tokenizer, data, output, label)
    else:
        scores = evaluate_recipe_model(recipe, model, tokenizer, output, label)
    summary = RunSummary(label, scores, protocol)
    print(format_table([summary]))
    return summary


def compare(recipes: list[Recipe], output_dir: str | Path, include_base: bool = True) -> list[RunSummary]:
    """Train and evaluate each recipe (plus the untrained base model of the first), then tabulate them."""
    summaries = [evaluate_saved(recipes[0], None)] if include_base else []
    summaries += [train_and_evaluate(recipe) for recipe in recipes]
    write_comparison(summaries, output_dir)
    print(format_table(summaries))
    return summaries


def _columns(summaries: list[RunSummary]) -> list[str]:
    tasks = dict.fromkeys(task for summary in summaries for task in summary.scores)
    return [*tasks, "average"]


def format_table(summaries: list[RunSummary]) -> str:
    """A Markdown table: one row per method, its score (%) per task and on average, with training cost and the
    protocol it was scored with."""
    columns = _columns(summaries)
    lines = [
        "| method | trainable params | steps | train time | " + " | ".join(columns) + " | protocol |",
        "|---|---:|---:|---:|" + "---:|" * len(columns) + "---|",
    ]
    for summary in summaries:
        scores = summary.with_average()
        cells = [f"{100 * scores[c]:.1f}" if c in scores else "-" for c in columns]
        cost = [f"{summary.trainable_parameters:,}", str(summary.steps), f"{summary.train_seconds:.0f} s"]
        if not summary.steps:  # the base model, or an adapter evaluated apart from its training
            cost = ["-"] * len(cost)
        lines.append(f"| {summary.label} | " + " | ".join([*cost, *cells, summary.protocol]) + " |")
    return "\n".join(lines)


def write_comparison(summaries: list[RunSummary], output_dir: str | Path) -> None:
    """comparison.json, comparison.csv and comparison.md in `output_dir`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "method": s.label,
            "trainable_parameters": s.trainable_parameters,
            "steps": s.steps,
            "train_seconds": round(s.train_seconds, 1),
            **s.with_average(),
            "protocol": s.protocol,
        }
        for s in summaries
    ]
    (output_dir / "comparison.json").write_text(json.dumps(rows, indent=2) + "\n")
    with open(output_dir / "comparison.csv", "w", newline="") as handle:
        writer = csv.DictWriter(
            handle,
            fieldnames=["method", "trainable_parameters", "steps", "train_seconds", *_columns(summaries), "protocol"],
        )
        writer.writeheader()
        writer.writerows(rows)
    (output_dir / "comparison.md").write_text(format_table(summaries) + "\n")


def print_prompts(data_dir: str | Path, task: str, count: int, protocol: str) -> None:
    """One JSON object a line: the exact prompt string `protocol` gives the model for each of the first `count` test
    examples of `task`, with the gold answer."""
    examples = load_examples(dataset_file(data_dir, task, "test"), task)[:count]
    prompts = get_protocol(protocol).prompts(task, examples)
    for index, (example, prompt) in enumerate(zip(examples, prompts, strict=True)):
        record = {"task": task, "index": index, "prompt": prompt, "answer": example.answer}
        print(json.dumps(record, ensure_ascii=False))


def rescore(paths: list[Path], protocol: str, output: Path) -> dict[str, tuple[int, int]]:
    """Score saved predictions under `protocol`, write them to `output` with `correct` (and the `prediction` and
    `protocol` behind it) set, and print the accuracy per task."""
    scored = score_predictions(read_predictions(paths), protocol)
    write_predictions(scored, output)
    counts = accuracy_by_task(scored)
    print(f"| task | accuracy ({protocol}) | correct | total |\n|---|---:|---:|---:|")
    for task, (correct, total) in counts.items():
        print(f"| {task} | {100 * correct / total:.1f} | {correct} | {total} |")
    average = sum(correct / total for correct, total in counts.values()) / len(counts) if counts else 0.0
    print(f"| average | {100 * average:.1f} | | |")
    print(f"scored predictions written to {output}")
    return counts
