"""LLM-Adapters JSON data (commonsense_170k/15k, math_10k and the test sets): loading, subsetting, tokenising.

Each file is a JSON list of `{"instruction", "input", "output", "answer"}` records. A data set `NAME` is looked
up in `data_dir` as `NAME/SPLIT.json` (the layout of LLM-Adapters' `dataset/` folder) or as `NAME.json` (the layout
of its `ft-training_set/` folder, e.g. `commonsense_170k.json`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase

from .prompts import build_prompt

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Example:
    """One LLM-Adapters record; `answer` is the gold label the evaluator compares against."""

    instruction: str
    output: str
    answer: str
    input: str = ""

    @property
    def prompt(self) -> str:
        return build_prompt(self.instruction, self.input)


def dataset_file(data_dir: str | Path, name: str, split: str) -> Path:
    """The JSON file of data set `name`, in either of LLM-Adapters' two layouts."""
    data_dir = Path(data_dir)
    candidates = [data_dir / name / f"{split}.json", data_dir / f"{name}.json"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"No {split} data for '{name}' in {data_dir}: looked for {' and '.join(str(c) for c in candidates)}. "
        "Point data_dir at your copy of the LLM-Adapters data sets."
    )


def load_examples(path: str | Path) -> list[Example]:
    with open(path, encoding="utf-8") as handle:
        records = json.load(handle)
    return [
        Example(
            instruction=record["instruction"],
            input=record.get("input") or "",
            output=record.get("output", ""),
            answer=str(record.get("answer", "")),
        )
        for record in records
    ]


def sample(examples: list[Example], size: int | None, seed: int) -> list[Example]:
    """A reproducible random subset (all examples, in file order, when `size` is None or covers them all)."""
    if size is None or size >= len(examples):
        return examples
    return random.Random(seed).sample(examples, size)


def load_split(data_dir: str | Path, names: list[str], split: str, size: int | None, seed: int) -> list[Example]:
    """`size` examples drawn from the union of the named data sets (every example when `size` is None)."""
    examples = [example for name in names for example in load_examples(dataset_file(data_dir, name, split))]
    return sample(examples, size, seed)


def tokenize_for_training(example: Example, tokenizer: PreTrainedTokenizerBase, max_length: int) -> dict[str, list]:
    """Prompt + response + EOS, with the prompt's labels set to -100 so only the response is learned.

    Prompt and response are tokenised separately, so the mask boundary is exact whatever the tokenizer merges.
    Sequences longer than `max_length` are cut at the end (and then lose their EOS), as in LLM-Adapters.
    """
    prompt_ids = tokenizer(example.prompt)["input_ids"]
    response_ids = tokenizer(example.output, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def training_dataset(examples: list[Example], tokenizer: PreTrainedTokenizerBase, max_length: int) -> Dataset:
    """Tokenised examples; those whose response was cut away entirely by `max_length` are dropped."""
    rows = [tokenize_for_training(example, tokenizer, max_length) for example in examples]
    rows = [row for row in rows if any(label != IGNORE_INDEX for label in row["labels"])]
    if not rows:
        raise ValueError(f"max_length={max_length} leaves no response tokens in any training example; raise it.")
    return Dataset.from_list(rows)


def training_collator(tokenizer: PreTrainedTokenizerBase) -> DataCollatorForSeq2Seq:
    """Pads each batch to its longest sequence; padded label positions are -100."""
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
