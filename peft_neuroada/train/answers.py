"""The lenient protocol's answer extraction and scoring, after LLM-Adapters' evaluators.

Commonsense tasks: the first option word of the task's answer format in the response (`answer1`, `true`,
`solution2`, ...). Arithmetic tasks: the last number in the response, correct within 1e-3. AQuA: the first option
letter A-E. A data set not listed here is scored from its own records: the options of its
`Answer format: a/b/c` line if the instruction has one, else as arithmetic when its gold answers are numbers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .data import Example

_ANSWER_OPTIONS = tuple(f"answer{i}" for i in range(1, 6))

COMMONSENSE_OPTIONS: dict[str, tuple[str, ...]] = {
    "boolq": ("true", "false"),
    "piqa": ("solution1", "solution2"),
    "social_i_qa": _ANSWER_OPTIONS,
    "ARC-Challenge": _ANSWER_OPTIONS,
    "ARC-Easy": _ANSWER_OPTIONS,
    "openbookqa": _ANSWER_OPTIONS,
    "hellaswag": ("ending1", "ending2", "ending3", "ending4"),
    "winogrande": ("option1", "option2"),
}
ARITHMETIC_TASKS = ("gsm8k", "MultiArith", "AddSub", "SingleEq", "SVAMP", "mawps")
LETTER_TASKS: dict[str, tuple[str, ...]] = {"AQuA": ("A", "B", "C", "D", "E")}

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ANSWER_FORMAT = re.compile(r"Answer format:\s*(\S+(?:/\S+)+)")
NO_ANSWER = ""


@dataclass(frozen=True)
class Judgement:
    """What a protocol read from one response, and whether it matches the gold answer."""

    prediction: str
    correct: bool


@dataclass(frozen=True)
class AnswerRule:
    """How a task's responses are read: pick one of `options`, or (when None) read the last number."""

    options: tuple[str, ...] | None
    case_sensitive: bool = False

    def extract(self, response: str) -> str:
        """The predicted answer, or "" when the response contains none."""
        if self.options is None:
            numbers = _NUMBER.findall(response.replace(",", ""))
            return numbers[-1] if numbers else NO_ANSWER
        pattern = "|".join(re.escape(option) for option in sorted(self.options, key=len, reverse=True))
        match = re.search(pattern, response, flags=0 if self.case_sensitive else re.IGNORECASE)
        if match is None:
            return NO_ANSWER
        return match.group(0) if self.case_sensitive else match.group(0).lower()

    def is_correct(self, prediction: str, gold: str) -> bool:
        if self.options is not None:
            return prediction != NO_ANSWER and prediction == (gold if self.case_sensitive else gold.lower())
        try:
            return math.isclose(float(prediction), float(gold), rel_tol=0.0, abs_tol=1e-3)
        except ValueError:
            return False


def answer_rule(task: str, examples: list[Example]) -> AnswerRule:
    """The rule for `task`: the paper's for its data sets, otherwise inferred from the examples themselves."""
    if task in COMMONSENSE_OPTIONS:
        return AnswerRule(COMMONSENSE_OPTIONS[task])
    if task in LETTER_TASKS:
        return AnswerRule(LETTER_TASKS[task], case_sensitive=True)
    if task in ARITHMETIC_TASKS:
        return AnswerRule(None)
    formats = {match.group(1) for example in examples if (match := ANSWER_FORMAT.search(example.instruction))}
    if formats:
        return AnswerRule(tuple(sorted({option for line in formats for option in line.split("/")})))
    if examples and all(_NUMBER.fullmatch(example.answer.replace(",", "")) for example in examples):
        return AnswerRule(None)
    raise ValueError(
        f"Cannot tell how to score task '{task}': it is not one of the paper's data sets, its instructions have no "
        "'Answer format: a/b/...' line and its answers are not all numbers."
    )
