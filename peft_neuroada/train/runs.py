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
from .evaluate import TaskResult, average_accuracy, evaluate_tasks, write_results
from .models import load_adapted_model, load_base_model
from .protocols import get_protocol
from .recipes import Recipe
from .scoring import accuracy_by_task, read_predictions, score_predictions, write_predictions
from .training import fine_tune


@dataclass
class RunSummary:
    """One row of a comparison: a method's accuracies with what it cost to train."""

    label: str
    results: list[TaskResult]
    protocol: str
    trainable_parameters: int = 0
    steps: int = 0
    train_seconds: float = 0.0

    def accuracies(self) -> dict[str, float]:
        return {result.task: result.accuracy for result in self.results} | {"average": average_accuracy(self.results)}


def evaluate_recipe_model(
    recipe: Recipe,
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: Path,
    label: str,
) -> list[TaskResult]:
    """Score `model` on the recipe's evaluation tasks and write results.json/.csv and predictions to `output_dir`."""
    spec = recipe.evaluation
    if not spec.tasks:
        return []
    results = evaluate_tasks(model, tokenizer, recipe.data.dir, spec, recipe.protocol)
    metadata = {"recipe": recipe.name, "model": recipe.model, "method": label, "eval_size_per_task": spec.size}
    path = write_results(results, output_dir, metadata)
    print(format_table([RunSummary(label, results, recipe.protocol)]))
    print(f"results written to {path}")
    return results


def train_and_evaluate(recipe: Recipe, evaluate: bool = True) -> RunSummary:
    outcome = fine_tune(recipe)
    print(f"adapter saved to {outcome.adapter_dir}")
    results = []
    if evaluate:
        results = evaluate_recipe_model(
            recipe, outcome.model, outcome.tokenizer, Path(recipe.output_dir) / "results", recipe.method.label
        )
    return RunSummary(
        recipe.method.label,
        results,
        recipe.protocol,
        outcome.trainable_parameters,
        outcome.steps,
        outcome.seconds,
    )


def evaluate_saved(recipe: Recipe, adapter_dir: str | Path | None, output_dir: str | Path | None = None) -> RunSummary:
    """Evaluate the recipe's base model with the adapter in `adapter_dir`, or the bare base model when None."""
    protocol, max_length = recipe.protocol, recipe.data.max_length
    if adapter_dir is None:
        model, tokenizer = load_base_model(recipe.model, recipe.dtype, protocol, max_length)
        label, default_output = "base model", Path(recipe.output_dir) / "results_base"
    else:
        model, tokenizer = load_adapted_model(recipe.model, adapter_dir, recipe.dtype, protocol, max_length)
        label, default_output = recipe.method.label, Path(recipe.output_dir) / "results"
    results = evaluate_recipe_model(recipe, model, tokenizer, Path(output_dir or default_output), label)
    return RunSummary(label, results, protocol)


def compare(recipes: list[Recipe], output_dir: str | Path, include_base: bool = True) -> list[RunSummary]:
    """Train and evaluate each recipe (plus the untrained base model of the first), then tabulate them."""
    summaries = [evaluate_saved(recipes[0], None)] if include_base else []
    summaries += [train_and_evaluate(recipe) for recipe in recipes]
    write_comparison(summaries, output_dir)
    print(format_table(summaries))
    return summaries


def _columns(summaries: list[RunSummary]) -> list[str]:
    tasks = dict.fromkeys(result.task for summary in summaries for result in summary.results)
    return [*tasks, "average"]


def format_table(summaries: list[RunSummary]) -> str:
    """A Markdown table: one row per method, accuracy (%) per task and on average, with training cost and the
    protocol it was scored with."""
    columns = _columns(summaries)
    lines = [
        "| method | trainable params | steps | train time | " + " | ".join(columns) + " | protocol |",
        "|---|---:|---:|---:|" + "---:|" * len(columns) + "---|",
    ]
    for summary in summaries:
        accuracies = summary.accuracies()
        cells = [f"{100 * accuracies[c]:.1f}" if c in accuracies else "-" for c in columns]
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
            **s.accuracies(),
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
