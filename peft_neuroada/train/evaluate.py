"""The paper's evaluation: greedy generation from the prompt template, answer extraction, accuracy per task.

Prompts are generated in batches, left-padded and sorted by length so a batch wastes little compute on padding.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from .answers import answer_rule
from .data import Example, dataset_file, load_examples, sample
from .prompts import cut_response


@dataclass
class Prediction:
    instruction: str
    response: str
    prediction: str
    answer: str
    correct: bool


@dataclass
class TaskResult:
    task: str
    correct: int
    total: int
    predictions: list[Prediction] = field(default_factory=list, repr=False)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


@torch.no_grad()
def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    batch_size: int,
    max_new_tokens: int,
    description: str = "generating",
) -> list[str]:
    """Greedy continuations of `prompts` (in their order), cut at the end of the answer."""
    was_training = model.training
    model.eval()
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    order = sorted(range(len(prompts)), key=lambda i: lengths[i], reverse=True)
    responses: list[str] = [""] * len(prompts)
    try:
        for start in tqdm(range(0, len(order), batch_size), desc=description, unit="batch"):
            batch = order[start : start + batch_size]
            encoded = tokenizer([prompts[i] for i in batch], return_tensors="pt", padding=True).to(model.device)
            generated = model.generate(**encoded, generation_config=config)
            texts = tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
            for index, text in zip(batch, texts, strict=True):
                responses[index] = cut_response(text)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return responses


def evaluate_task(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    examples: list[Example],
    batch_size: int,
    max_new_tokens: int,
) -> TaskResult:
    rule = answer_rule(task, examples)
    responses = generate_responses(
        model, tokenizer, [example.prompt for example in examples], batch_size, max_new_tokens, description=task
    )
    predictions = []
    for example, response in zip(examples, responses, strict=True):
        prediction = rule.extract(response)
        predictions.append(
            Prediction(
                example.instruction, response, prediction, example.answer, rule.is_correct(prediction, example.answer)
            )
        )
    return TaskResult(task, sum(p.correct for p in predictions), len(predictions), predictions)


def evaluate_tasks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data_dir: str | Path,
    tasks: list[str],
    size: int | None,
    seed: int,
    batch_size: int,
    max_new_tokens: dict[str, int] | int,
) -> list[TaskResult]:
    """Accuracy on `size` seeded random test examples of each task (all of them when `size` is None).

    `max_new_tokens` is one budget for all tasks or a budget per answer kind: `{"options": .., "number": ..}`.
    """
    results = []
    for task in tasks:
        examples = sample(load_examples(dataset_file(data_dir, task, "test")), size, seed)
        budget = max_new_tokens
        if isinstance(budget, dict):
            budget = budget["number" if answer_rule(task, examples).options is None else "options"]
        results.append(evaluate_task(model, tokenizer, task, examples, batch_size, budget))
    return results


def average_accuracy(results: list[TaskResult]) -> float:
    """Unweighted mean over tasks, as the paper's "Avg." column."""
    return sum(result.accuracy for result in results) / len(results) if results else 0.0


def write_results(results: list[TaskResult], output_dir: str | Path, metadata: dict | None = None) -> Path:
    """results.json (accuracies and metadata), results.csv (one row per task plus the average) and one
    predictions_TASK.jsonl per task with every response, for error analysis."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        **(metadata or {}),
        "tasks": {r.task: {"accuracy": r.accuracy, "correct": r.correct, "total": r.total} for r in results},
        "average": average_accuracy(results),
    }
    (output_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(output_dir / "results.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "accuracy", "correct", "total"])
        for r in results:
            writer.writerow([r.task, f"{r.accuracy:.4f}", r.correct, r.total])
        writer.writerow(["average", f"{average_accuracy(results):.4f}", "", ""])
    for r in results:
        with open(output_dir / f"predictions_{r.task}.jsonl", "w") as handle:
            handle.writelines(json.dumps(asdict(p)) + "\n" for p in r.predictions)
    return output_dir / "results.json"
