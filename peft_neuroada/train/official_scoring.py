"""The paper protocol's answer extraction and scoring: the official NeuroAda code's rules, quirks included.

Re-implemented from the behaviour of FightingFighting/NeuroAda's compute_metrics.py (which follows LLM-Adapters'
evaluate.py); line numbers below are of that file. The official code decodes prompt + generation together and
reads the answer from the text after the first "trigger" in it, so a scorer here is given that whole text.

Commonsense: the text after the first `the correct answer is `, left-stripped, must equal the gold answer after
`strip()` on both sides: exact and case-sensitive, and anything the model adds after the label makes it wrong.
Math: everything after the first `### Response:` (the one in the prompt, so the whole generation, including a
made-up next turn); a gold answer `float()` rejects is a letter task (AQuA) scored by the first capital A-E
anywhere, even inside a word; any other by the last number, correct within 1e-3.
"""

from __future__ import annotations

import math
import re

from .answers import Judgement
from .prompts import COMMONSENSE_TRIGGER, MATH_TRIGGER

_NUMBER = re.compile(r"-?\d+\.?\d*")
_LETTER = re.compile(r"A|B|C|D|E")


def is_float(text: str) -> bool:
    """Official `is_float` (L34-L42): whatever Python's `float()` accepts ("1e3", " 3 ", "nan"; not "1,000")."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def extract_answer_number(text: str) -> float:
    """Official `extract_answer_number` (L44-L59): commas removed, the last match of `-?\\d+\\.?\\d*` as a float
    (so "3." reads 3.0 and "1e5" reads 5.0), infinity when there is none."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else math.inf


def extract_answer_letter(text: str) -> str:
    """Official `extract_answer_letter` (L62-L81): the first of A-E anywhere ("Answer: C" gives "A"), or ""."""
    match = _LETTER.search(text)
    return match.group(0) if match else ""


def extract_output(text: str, trigger: str) -> str:
    """Official `extract_output` (L84-L93): what follows the first `trigger`, left-stripped; "" without one."""
    start = text.find(trigger)
    return "" if start < 0 else text[start + len(trigger) :].lstrip()


def judge_commonsense(text: str, answer: str) -> Judgement:
    """Official commonsense scoring (compute_metrics_percell, L394 and L400-L404) of decoded prompt + generation."""
    generation = extract_output(text, COMMONSENSE_TRIGGER)
    return Judgement(generation, generation.strip() == answer.strip())


def judge_math(text: str, answer: str) -> Judgement:
    """Official math scoring (compute_metrics_percell, L394 and L405-L415) of decoded prompt + generation."""
    generation = extract_output(text, MATH_TRIGGER)
    answer = answer.strip()
    if not is_float(answer):
        letter = extract_answer_letter(generation)
        return Judgement(letter, letter == answer)
    number = extract_answer_number(generation)
    return Judgement(str(number), abs(float(answer) - number) <= 0.001)
