"""The Alpaca-style prompt template of LLM-Adapters, which NeuroAda's paper uses for training and evaluation.

Training and evaluation must see byte-identical prompts, so both build them here.
"""

from __future__ import annotations

RESPONSE_MARKER = "### Response:\n"

_PREAMBLE = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
_PREAMBLE_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)


def build_prompt(instruction: str, input_text: str = "") -> str:
    """The prompt up to and including the response marker; the model's answer follows it directly."""
    if input_text:
        sections = f"### Instruction:\n{instruction}\n\n### Input:\n{input_text}"
        return f"{_PREAMBLE_WITH_INPUT}\n\n{sections}\n\n{RESPONSE_MARKER}"
    return f"{_PREAMBLE}\n\n### Instruction:\n{instruction}\n\n{RESPONSE_MARKER}"


def cut_response(generated: str) -> str:
    """The answer alone: generation that runs on into a new `### ...` section is a hallucinated next turn."""
    return generated.split("\n### ", 1)[0].strip()
