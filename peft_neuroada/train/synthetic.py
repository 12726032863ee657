"""Small generated tasks in the LLM-Adapters format, so the demo and the quickstart run without any download.

The tasks have exactly one right answer, an answer format like the paper's test sets, and are hard for a 135M
model zero-shot but learnable from a few hundred examples.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from .data import Example


def largest_number(rng: random.Random) -> Example:
    """Four distinct two-digit numbers; answer with the option that holds the largest (commonsense-style)."""
    numbers = rng.sample(range(10, 100), 4)
    options = " ".join(f"Answer{i}: {n}" for i, n in enumerate(numbers, start=1))
    answer = f"answer{numbers.index(max(numbers)) + 1}"
    instruction = (
        f"Please choose the correct answer to the question: Which number is the largest?\n\n{options}\n\n"
        "Answer format: answer1/answer2/answer3/answer4"
    )
    return Example(instruction=instruction, output=f"the correct answer is {answer}", answer=answer)


def even_or_odd(rng: random.Random) -> Example:
    """Is a three-digit number even? Answer true or false (boolq-style)."""
    number = rng.randrange(100, 1000)
    answer = "true" if number % 2 == 0 else "false"
    instruction = (
        f"Please answer the following question with true or false, question: is {number} an even number?\n\n"
        "Answer format: true/false"
    )
    return Example(instruction=instruction, output=f"the correct answer is {answer}", answer=answer)


def addition(rng: random.Random) -> Example:
    """Add two two-digit numbers; the last number in the response is the answer (arithmetic-style)."""
    a, b = rng.randrange(10, 100), rng.randrange(10, 100)
    return Example(
        instruction=f"What is {a} + {b}?", output=f"{a} + {b} = {a + b}. The answer is {a + b}", answer=str(a + b)
    )


SYNTHETIC_TASKS: dict[str, Callable[[random.Random], Example]] = {
    "largest_number": largest_number,
    "even_or_odd": even_or_odd,
    "addition": addition,
}


def generate(task: str, count: int, seed: int) -> list[Example]:
    rng = random.Random(f"{task}-{seed}")
    return [SYNTHETIC_TASKS[task](rng) for _ in range(count)]


def write_synthetic_data(data_dir: str | Path, tasks: list[str], train_size: int, test_size: int) -> Path:
    """Write TASK/train.json and TASK/test.json for each task, plus `synthetic_mix.json` (all training sets)."""
    data_dir = Path(data_dir)
    mix = []
    for task in tasks:
        (data_dir / task).mkdir(parents=True, exist_ok=True)
        for split, size, seed in (("train", train_size, 0), ("test", test_size, 1)):
            records = [vars(example) for example in generate(task, size, seed)]
            (data_dir / task / f"{split}.json").write_text(json.dumps(records, indent=1))
            if split == "train":
                mix.extend(records)
    (data_dir / "synthetic_mix.json").write_text(json.dumps(mix, indent=1))
    return data_dir
