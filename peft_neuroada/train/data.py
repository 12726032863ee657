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
    """One LLM-Adapters record; `answer` is the gold label the evaluator compares against, `task` the data set it
    came from (the paper protocol prompts commonsense and math data sets differently)."""

    instruction: str
    output: str
    answer: str
    input: str = ""
    task: str = ""

    @property
    def prompt(self) -> str:
        """The lenient protocol's prompt (the Alpaca template)."""
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
        "Point it at your copy of the LLM-Adapters data sets: --set data.dir=PATH for a recipe, --data-dir PATH "
        "for `neuroada prompts`."
    )


def load_examples(path: str | Path, task: str = "") -> list[Example]:
    with open(path, encoding="utf-8") as handle:
        records = json.load(handle)
    return [
        Example(
            instruction=record["instruction"],
            input=record.get("input") or "",
            output=record.get("output", ""),
            answer=str(record.get("answer", "")),
            task=task,
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
    examples = [example for name in names for example in load_examples(dataset_file(data_dir, name, split), name)]
    return sample(examples, size, seed)


def tokenize_for_training(example: Example, tokenizer: PreTrainedTokenizerBase, max_length: int) -> dict[str, list]:
    """The lenient protocol's row: prompt + response + EOS, the prompt's labels -100 so only the response is learned.

    Prompt and response are tokenised separately, so the mask boundary is exact whatever the tokenizer merges.
    Sequences longer than `max_length` are cut at the end (and then lose their EOS), as in LLM-Adapters.
    """
    prompt_ids = tokenizer(example.prompt)["input_ids"]
    response_ids = tokenizer(example.output, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def tokenize_jointly(prompt: str, target: str, tokenizer: PreTrainedTokenizerBase, max_length: int) -> dict[str, list]:
    """The official training row: prompt + target + the EOS *text*, tokenised in one call and cut at `max_length`.

    Official: dataset.py L163-L168 (both calls truncate at model_max_length, which train_our.py L285 sets to
    max_length) and L192-L194: the labels copy the ids with the first len(tokenizer(prompt)) positions set to -100,
    the prompt's own length even where the joint tokenisation merged tokens across the boundary. pyreft's
    ReftDataset (0.0.8, compute_intervention_and_subspaces) then puts one pad token in front, its intervention
    "sink", with label -100 (see `with_sink`).
    """
    prompt_length = len(tokenizer(prompt, max_length=max_length, truncation=True)["input_ids"])
    input_ids = tokenizer(prompt + target + tokenizer.eos_token, max_length=max_length, truncation=True)["input_ids"]
    labels = [IGNORE_INDEX] * min(prompt_length, len(input_ids)) + input_ids[prompt_length:]
    return with_sink(input_ids, tokenizer.pad_token_id, labels)


def tokenize_prompt_cut(prompt: str, tokenizer: PreTrainedTokenizerBase) -> tuple[dict[str, list], bool]:
    """The official evaluation input: the prompt cut at the tokenizer's model_max_length (the recipe's max_length),
    behind the pad "sink" (dataset.py L163-L165, L198-L200). Also says whether the prompt was cut."""
    input_ids = tokenizer(prompt)["input_ids"]
    cut = len(input_ids) > tokenizer.model_max_length
    if cut:
        input_ids = tokenizer(prompt, max_length=tokenizer.model_max_length, truncation=True)["input_ids"]
    return with_sink(input_ids, tokenizer.pad_token_id), cut


def with_sink(input_ids: list[int], pad_token_id: int, labels: list[int] | None = None) -> dict[str, list]:
    """pyreft's layout: one pad token before the sequence (label -100), attention 0 wherever the id is the pad id.

    The sink is masked out, and with rotary positions it changes nothing the model computes beyond rounding; it is
    kept so that every sequence is token for token the official one.
    """
    input_ids = [pad_token_id, *input_ids]
    row = {"input_ids": input_ids, "attention_mask": [int(token != pad_token_id) for token in input_ids]}
    if labels is not None:
        row["labels"] = [IGNORE_INDEX, *labels]
    return row


def has_targets(row: dict[str, list]) -> bool:
    """Whether any token of the row is learned (a long prompt can leave none within max_length)."""
    return any(label != IGNORE_INDEX for label in row["labels"])


def as_dataset(rows: list[dict[str, list]], max_length: int) -> Dataset:
    """The rows as a data set, refusing one in which no token at all would be learned."""
    if not any(has_targets(row) for row in rows):
        raise ValueError(f"max_length={max_length} leaves no response tokens in any training example; raise it.")
    return Dataset.from_list(rows)


def training_dataset(examples: list[Example], tokenizer: PreTrainedTokenizerBase, max_length: int) -> Dataset:
    """The lenient protocol's tokenised examples; those whose response `max_length` cut away entirely are dropped."""
    rows = [tokenize_for_training(example, tokenizer, max_length) for example in examples]
    return as_dataset([row for row in rows if has_targets(row)], max_length)


def training_collator(tokenizer: PreTrainedTokenizerBase) -> DataCollatorForSeq2Seq:
    """Pads each batch to its longest sequence; padded label positions are -100."""
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
