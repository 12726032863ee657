"""Re-scoring saved predictions under either protocol, so one set of generations can be read both ways.

A prediction is a JSON object with at least `task`, `prompt`, `response` and `answer`, as the predictions files of
`neuroada eval` hold. The prompt matters: the paper protocol scores prompt + response, as the official code scores
the decoded prompt and generation together.
"""

from __future__ import annotations

import json
from pathlib import Path

from .data import Example
from .protocols import get_protocol

REQUIRED_KEYS = ("task", "prompt", "response", "answer")


class PredictionsError(ValueError):
    """A predictions file is not what `neuroada score` reads: the command prints the message alone."""


def read_predictions(paths: list[Path]) -> list[dict]:
    """Every prediction of the JSON-lines files, in order; a line that is not a JSON object with the required keys is
    an error naming the file and line."""
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise PredictionsError(
                        f"{path}:{number} is not a JSON line; score reads the predictions_TASK.jsonl files of a run."
                    ) from None
                missing = [key for key in REQUIRED_KEYS if not isinstance(record, dict) or key not in record]
                if missing:
                    raise PredictionsError(
                        f"{path}:{number} has no {', '.join(missing)}; each line needs {REQUIRED_KEYS}."
                    )
                records.append(record)
    return records


def score_predictions(records: list[dict], protocol: str) -> list[dict]:
    """The records with `prediction`, `correct` and `protocol` set by `protocol`'s scorer.

    A task's scorer is built from all of its records (the lenient protocol reads the options of a data set it does
    not know from the `Answer format:` line of its prompts).
    """
    chosen = get_protocol(protocol)
    examples: dict[str, list[Example]] = {}
    for record in records:
        example = Example(instruction=record["prompt"], output="", answer=str(record["answer"]), task=record["task"])
        examples.setdefault(record["task"], []).append(example)
    scorers = {task: chosen.scorer(task, task_examples) for task, task_examples in examples.items()}
    scored = []
    for record in records:
        judgement = scorers[record["task"]](record["prompt"], record["response"], str(record["answer"]))
        scored.append(
            record | {"protocol": protocol, "prediction": judgement.prediction, "correct": judgement.correct}
        )
    return scored


def accuracy_by_task(records: list[dict]) -> dict[str, tuple[int, int]]:
    """(correct, total) per task, in order of first appearance."""
    counts: dict[str, tuple[int, int]] = {}
    for record in records:
        correct, total = counts.get(record["task"], (0, 0))
        counts[record["task"]] = (correct + bool(record["correct"]), total + 1)
    return counts


def write_predictions(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
