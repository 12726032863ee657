"""The prompt template, LLM-Adapters data loading, and the training targets (prompt masked from the loss)."""

from __future__ import annotations

import json

import pytest
import torch

from peft_neuroada.train.data import (
    IGNORE_INDEX,
    Example,
    dataset_file,
    load_examples,
    load_split,
    tokenize_for_training,
    training_collator,
    training_dataset,
)
from peft_neuroada.train.prompts import build_prompt, cut_response
from tests.shared_data import shared_datasets


def test_prompt_without_input_is_the_alpaca_template():
    assert build_prompt("Add 2 and 3.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n"
    )


def test_prompt_with_input_has_an_input_section():
    assert build_prompt("Summarise.", "Some text.") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request."
        "\n\n### Instruction:\nSummarise.\n\n### Input:\nSome text.\n\n### Response:\n"
    )


def test_response_is_cut_where_the_model_starts_a_new_section():
    assert (
        cut_response(" the correct answer is answer2\n\n### Instruction:\nanswer3") == "the correct answer is answer2"
    )
    assert cut_response("12 + 3 = 15\nThe answer is 15  ") == "12 + 3 = 15\nThe answer is 15"


def test_real_commonsense_example_loads_with_all_fields():
    examples = load_examples(dataset_file(shared_datasets(), "commonsense_15k", "train"))
    first = examples[0]
    assert first.answer == "answer1" and first.output == "the correct answer is answer1" and first.input == ""
    assert first.prompt.endswith("Answer format: answer1/answer2/answer3/answer4\n\n### Response:\n")


def test_numeric_answers_load_as_strings():
    example = load_examples(dataset_file(shared_datasets(), "gsm8k", "test"))[0]
    assert example.answer == "576.0"


def test_both_llm_adapters_layouts_are_found(tmp_path):
    (tmp_path / "boolq").mkdir()
    (tmp_path / "boolq" / "test.json").write_text("[]")
    (tmp_path / "commonsense_170k.json").write_text("[]")
    assert dataset_file(tmp_path, "boolq", "test") == tmp_path / "boolq" / "test.json"
    assert dataset_file(tmp_path, "commonsense_170k", "train") == tmp_path / "commonsense_170k.json"
    with pytest.raises(
        FileNotFoundError,
        match=r"Point it at your copy .*--set data\.dir=PATH for a recipe, --data-dir PATH for `neuroada prompts`",
    ):
        dataset_file(tmp_path, "piqa", "test")


def test_subsets_are_reproducible_and_drawn_from_all_named_sets():
    data_dir = shared_datasets()
    first = load_split(data_dir, ["ARC-Easy", "boolq"], "test", 40, seed=3)
    again = load_split(data_dir, ["ARC-Easy", "boolq"], "test", 40, seed=3)
    assert first == again and len(first) == 40
    assert {example.answer for example in first} & {"true", "false"}
    assert {example.answer for example in first} & {"answer1", "answer2", "answer3", "answer4"}
    assert load_split(data_dir, ["ARC-Easy"], "test", 10, seed=4) != load_split(data_dir, ["ARC-Easy"], "test", 10, 5)


def test_only_the_response_and_eos_are_learned(smollm2_tokenizer):
    example = load_examples(dataset_file(shared_datasets(), "commonsense_15k", "train"))[0]
    row = tokenize_for_training(example, smollm2_tokenizer, max_length=512)
    prompt_ids = smollm2_tokenizer(example.prompt)["input_ids"]
    response_ids = smollm2_tokenizer(example.output, add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == prompt_ids + response_ids + [smollm2_tokenizer.eos_token_id]
    assert row["labels"] == [IGNORE_INDEX] * len(prompt_ids) + response_ids + [smollm2_tokenizer.eos_token_id]
    assert row["attention_mask"] == [1] * len(row["input_ids"])
    learned = smollm2_tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX], skip_special_tokens=True)
    assert learned == "the correct answer is answer1"


def test_max_length_cuts_the_end_and_drops_examples_with_no_response_left(smollm2_tokenizer):
    short = Example(instruction="Say hi.", output="hi " * 50, answer="")
    row = tokenize_for_training(short, smollm2_tokenizer, max_length=40)
    assert len(row["input_ids"]) == len(row["labels"]) == 40
    assert row["labels"][-1] != smollm2_tokenizer.eos_token_id
    long_prompt = Example(instruction="word " * 100, output="yes", answer="yes")
    assert len(training_dataset([short, long_prompt], smollm2_tokenizer, max_length=40)) == 1
    with pytest.raises(ValueError, match="raise it"):
        training_dataset([long_prompt], smollm2_tokenizer, max_length=40)


def test_collator_pads_labels_with_ignore_index(smollm2_tokenizer):
    examples = [
        Example("Pick one.", "the correct answer is true", "true"),
        Example("Q?", "a much longer answer " * 3, ""),
    ]
    dataset = training_dataset(examples, smollm2_tokenizer, max_length=128)
    batch = training_collator(smollm2_tokenizer)([dataset[0], dataset[1]])
    assert batch["input_ids"].shape == batch["labels"].shape
    padded = batch["attention_mask"] == 0
    assert padded.any() and torch.all(batch["labels"][padded] == IGNORE_INDEX)


def test_records_without_input_or_answer_load(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([{"instruction": "Hi?", "output": "Hello."}]))
    assert load_examples(path) == [Example(instruction="Hi?", output="Hello.", answer="")]
