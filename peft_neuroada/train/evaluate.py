"""Evaluation: greedy generation from each protocol's prompts, answer extraction, accuracy per task.

The lenient protocol sorts prompts by length so a batch wastes little compute on padding; the paper protocol keeps
the test set's order, as the official code does. Prompts are left-padded for generation in both.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from .data import Example, dataset_file, load_examples, sample
from .protocols import get_protocol

if TYPE_CHECKING:
    from .recipes import EvaluationSpec


@dataclass
class Prediction:
    """One scored response; a predictions file holds these, one JSON object a line, and `neuroada score` reads it."""

    task: str
    protocol: str
    instruction: str
    prompt: str
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
    protocol: str = "lenient"

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def _left_padded(rows: list[dict[str, list]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A batch padded on the left with the pad token and attention 0, as the official evaluation collator does."""
    width = max(len(row["input_ids"]) for row in rows)
    padding = [width - len(row["input_ids"]) for row in rows]
    return {
        "input_ids": torch.tensor(
            [[pad_token_id] * n + row["input_ids"] for n, row in zip(padding, rows, strict=True)]
        ),
        "attention_mask": torch.tensor(
            [[0] * n + row["attention_mask"] for n, row in zip(padding, rows, strict=True)]
        ),
    }


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    inputs: list[dict[str, list]],
    batch_size: int,
    max_new_tokens: int,
    sort_by_length: bool,
    description: str = "generating",
) -> list[str]:
    """Greedy continuations (the new tokens decoded, special tokens skipped) of encoded prompts, in their order."""
    was_training = model.training
    model.eval()
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    order = list(range(len(inputs)))
    if sort_by_length:
        order.sort(key=lambda i: len(inputs[i]["input_ids"]), reverse=True)
    generated_texts: list[str] = [""] * len(inputs)
    try:
        for start in tqdm(range(0, len(order), batch_size), desc=description, unit="batch"):
            batch = order[start : start + batch_size]
            encoded = _left_padded([inputs[i] for i in batch], tokenizer.pad_token_id)
            generated = model.generate(**{k: v.to(model.device) for k, v in encoded.items()}, generation_config=config)
            new_tokens = generated[:, encoded["input_ids"].shape[1] :]
            texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            for index, text in zip(batch, texts, strict=True):
                generated_texts[index] = text
    finally:
        model.train(was_training)
    return generated_texts


def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    batch_size: int,
    max_new_tokens: int,
    description: str = "generating",
    protocol: str = "lenient",
) -> list[str]:
    """Greedy responses to `prompts` (in their order), encoded and kept as `protocol` does."""
    chosen = get_protocol(protocol)
    inputs = [chosen.encode_prompt(prompt, tokenizer)[0] for prompt in prompts]
    texts = generate(model, tokenizer, inputs, batch_size, max_new_tokens, chosen.sort_by_length, description)
    return [chosen.response(text) for text in texts]


def _prompt_seen(prompt: str, inputs: dict[str, list], cut: bool, tokenizer: PreTrainedTokenizerBase) -> str:
    """The prompt as the model saw it: a prompt cut at max_length is recorded (and scored) as its kept part."""
    return tokenizer.decode(inputs["input_ids"], skip_special_tokens=True) if cut else prompt


def evaluate_task(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    examples: list[Example],
    batch_size: int,
    max_new_tokens: int,
    protocol: str = "lenient",
) -> TaskResult:
    """Every example's prompt, response and judgement under `protocol`, with the task's accuracy."""
    chosen = get_protocol(protocol)
    score = chosen.scorer(task, examples)
    prompts = chosen.prompts(task, examples)
    encoded = [chosen.encode_prompt(prompt, tokenizer) for prompt in prompts]
    texts = generate(
        model, tokenizer, [inputs for inputs, _ in encoded], batch_size, max_new_tokens, chosen.sort_by_length, task
    )
    predictions = []
    for example, prompt, (inputs, cut), text in zip(examples, prompts, encoded, texts, strict=True):
        seen, response = _prompt_seen(prompt, inputs, cut, tokenizer), chosen.response(text)
        judgement = score(seen, response, example.answer)
        predictions.append(
            Prediction(
                task,
                chosen.name,
                example.instruction,
                seen,
                response,
                judgement.prediction,
                example.answer,
                judgement.correct,
            )
        )
    return TaskResult(task, sum(p.correct for p in predictions), len(predictions), predictions, chosen.name)


def evaluate_tasks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data_dir: str | Path,
    spec: EvaluationSpec,
    protocol: str = "lenient",
) -> list[TaskResult]:
    """Accuracy on `spec.size` seeded random test examples of each of `spec.tasks` (all of them when the size is
    None), each task generating with the budget `protocol` picks for it from the spec's two."""
    results = []
    for task in spec.tasks:
        examples = sample(load_examples(dataset_file(data_dir, task, "test"), task), spec.size, spec.seed)
        budget = spec.max_new_tokens[get_protocol(protocol).budget(task, examples)]
        results.append(evaluate_task(model, tokenizer, task, examples, spec.batch_size, budget, protocol))
    return results


def average_accuracy(results: list[TaskResult]) -> float:
    """Unweighted mean over tasks, as the paper's "Avg." column."""
    return sum(result.accuracy for result in results) / len(results) if results else 0.0


def results_protocol(results: list[TaskResult]) -> str:
    """The one protocol the results were scored with; results of different protocols are not comparable."""
    protocols = {r.protocol for r in results}
    if len(protocols) > 1:
        raise ValueError(f"These results were scored with different protocols ({sorted(protocols)}); keep them apart.")
    return protocols.pop() if protocols else ""


def write_results(results: list[TaskResult], output_dir: str | Path, metadata: dict | None = None) -> Path:
    """results.json (accuracies, the protocol and metadata), results.csv (one row per task plus the average, each
    naming the protocol) and one predictions_TASK.jsonl per task with every response, for error analysis and for
    re-scoring with `neuroada score`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    protocol = results_protocol(results)
    summary = {
        **(metadata or {}),
        "protocol": protocol,
        "tasks": {r.task: {"accuracy": r.accuracy, "correct": r.correct, "total": r.total} for r in results},
        "average": average_accuracy(results),
    }
    (output_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(output_dir / "results.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "accuracy", "correct", "total", "protocol"])
        for r in results:
            writer.writerow([r.task, f"{r.accuracy:.4f}", r.correct, r.total, protocol])
        writer.writerow(["average", f"{average_accuracy(results):.4f}", "", "", protocol])
    for r in results:
        with open(output_dir / f"predictions_{r.task}.jsonl", "w") as handle:
            handle.writelines(json.dumps(asdict(p)) + "\n" for p in r.predictions)
    return output_dir / "results.json"
