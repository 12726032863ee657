"""The prompts of both protocols. Training and evaluation must see byte-identical prompts, so both build them here.

`lenient`: the Alpaca template of LLM-Adapters for every task, with an `### Input:` section when a record has one.
`paper`: what the official NeuroAda code (FightingFighting/NeuroAda) gives the model: the bare instruction and a
newline for commonsense tasks, the Alpaca template without input for math tasks. The official code also relies on
a "trigger" string to find the answer in the decoded text, so those live here too.
"""

from __future__ import annotations

RESPONSE_MARKER = "### Response:\n"

_PREAMBLE = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
_PREAMBLE_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)

COMMONSENSE_TRIGGER = "the correct answer is "
"""Official: task_config.py L12, the text the official code searches for in prompt + generation."""

MATH_TRIGGER = "### Response:"
"""Official: task_config.py L37; it is in every math prompt, so all of the generation after it counts."""


def build_prompt(instruction: str, input_text: str = "") -> str:
    """The prompt up to and including the response marker; the model's answer follows it directly."""
    if input_text:
        sections = f"### Instruction:\n{instruction}\n\n### Input:\n{input_text}"
        return f"{_PREAMBLE_WITH_INPUT}\n\n{sections}\n\n{RESPONSE_MARKER}"
    return f"{_PREAMBLE}\n\n### Instruction:\n{instruction}\n\n{RESPONSE_MARKER}"


def cut_response(generated: str) -> str:
    """The answer alone: generation that runs on into a new `### ...` section is a hallucinated next turn."""
    return generated.split("\n### ", 1)[0].strip()


def commonsense_prompt(instruction: str) -> str:
    """Official: `"%s\\n" % instruction` (task_config.py L11, dataset.py L127), no template, train and test alike."""
    return f"{instruction}\n"


def commonsense_target(answer: str) -> str:
    """What a commonsense example teaches after its prompt: the trigger and the gold label (dataset.py L128).

    The official code builds it from `answer`, not from the record's `output` (they agree in LLM-Adapters' data).
    """
    return COMMONSENSE_TRIGGER + answer


def math_prompt(instruction: str) -> str:
    """Official: the Alpaca template without input (task_config.py L36, dataset.py L130), whatever `input` holds.

    It is LoReFT's `alpaca_prompt_no_input_template` (templates.py), byte-identical to `build_prompt(instruction)`.
    """
    return build_prompt(instruction)
