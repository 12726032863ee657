"""The lenient protocol's answer extraction and scoring (after LLM-Adapters), batched greedy generation, results
files (the paper protocol's rules are specified in test_protocol.py)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from peft_neuroada.train.answers import NO_ANSWER, AnswerRule, answer_rule
from peft_neuroada.train.data import Example, dataset_file, load_examples
from peft_neuroada.train.evaluate import evaluate_tasks, generate_responses, write_results
from peft_neuroada.train.recipes import EvaluationSpec
from peft_neuroada.train.scoring import read_predictions, score_predictions
from tests.shared_data import shared_datasets


@pytest.mark.parametrize(
    ("task", "response", "expected"),
    [
        ("ARC-Easy", "the correct answer is answer3", "answer3"),
        ("ARC-Easy", "answer2, not answer1", "answer2"),
        ("ARC-Easy", "I think Answer4 is right", "answer4"),
        ("openbookqa", "the correct answer is answer5", "answer5"),
        ("social_i_qa", "no idea", NO_ANSWER),
        ("boolq", "the correct answer is false", "false"),
        ("boolq", "True.", "true"),
        ("piqa", "the correct answer is solution2", "solution2"),
        ("hellaswag", "the correct answer is ending3", "ending3"),
        ("winogrande", "the correct answer is option1", "option1"),
        ("gsm8k", "5 + 7 = 12 apples, so the answer is 12.", "12"),
        ("gsm8k", "Total: 1,234 dollars", "1234"),
        ("SVAMP", "it drops to -3.5 degrees", "-3.5"),
        ("MultiArith", "I cannot tell", NO_ANSWER),
        ("AQuA", "The answer is (C).", "C"),
        ("AQuA", "the correct answer is c", NO_ANSWER),
    ],
)
def test_lenient_answer_extraction(task, response, expected):
    assert answer_rule(task, []).extract(response) == expected


@pytest.mark.parametrize(
    ("task", "prediction", "gold", "correct"),
    [
        ("gsm8k", "576", "576.0", True),
        ("gsm8k", "576.0004", "576.0", True),
        ("gsm8k", "576.01", "576.0", False),
        ("gsm8k", NO_ANSWER, "0.0", False),
        ("boolq", "true", "true", True),
        ("boolq", "false", "true", False),
        ("ARC-Easy", NO_ANSWER, "answer1", False),
        ("AQuA", "B", "B", True),
    ],
)
def test_scoring(task, prediction, gold, correct):
    assert answer_rule(task, []).is_correct(prediction, gold) is correct


def test_unknown_task_reads_its_options_from_the_answer_format_line():
    examples = [Example("Pick one.\n\nAnswer format: red/green/blue", "the correct answer is green", "green")]
    rule = answer_rule("colours", examples)
    assert rule.extract("the correct answer is Blue, not red") == "blue"
    assert rule.is_correct("green", "green")


def test_unknown_task_with_numeric_answers_is_scored_as_arithmetic():
    rule = answer_rule("my_sums", [Example("2+2?", "4", "4"), Example("1+2?", "3", "3.0")])
    assert rule == AnswerRule(None)


def test_unknown_task_that_cannot_be_scored_says_why():
    with pytest.raises(ValueError, match="Cannot tell how to score task 'poems'"):
        answer_rule("poems", [Example("Write a poem.", "Roses...", "Roses...")])


def test_batched_left_padded_generation_matches_one_at_a_time(smollm2, smollm2_tokenizer):
    examples = load_examples(dataset_file(shared_datasets(), "boolq", "test"))[:2]
    examples += load_examples(dataset_file(shared_datasets(), "ARC-Easy", "test"))[:1]
    prompts = [example.prompt for example in examples]
    batched = generate_responses(smollm2, smollm2_tokenizer, prompts, batch_size=3, max_new_tokens=8)
    single = [generate_responses(smollm2, smollm2_tokenizer, [p], batch_size=1, max_new_tokens=8)[0] for p in prompts]
    assert batched == single
    assert smollm2_tokenizer.padding_side == "right" and not smollm2.training


def test_evaluation_writes_accuracy_per_task_average_and_predictions(smollm2, smollm2_tokenizer, tmp_path):
    torch.manual_seed(0)
    spec = EvaluationSpec(
        ["boolq", "gsm8k"], size=3, seed=0, batch_size=3, max_new_tokens_options=8, max_new_tokens_number=8
    )
    results = evaluate_tasks(smollm2, smollm2_tokenizer, shared_datasets(), spec)
    assert [(r.task, r.total) for r in results] == [("boolq", 3), ("gsm8k", 3)]
    assert all(0 <= r.accuracy <= 1 and r.correct == sum(p.correct for p in r.predictions) for r in results)
    write_results(results, tmp_path, {"method": "base model"})
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["method"] == "base model" and summary["protocol"] == "lenient"
    assert summary["tasks"]["boolq"]["total"] == 3
    assert summary["average"] == pytest.approx((results[0].accuracy + results[1].accuracy) / 2)
    rows = list(csv.reader((tmp_path / "results.csv").open()))
    assert rows[0] == ["task", "accuracy", "correct", "total", "protocol"]
    assert [row[0] for row in rows[1:]] == ["boolq", "gsm8k", "average"] and {row[-1] for row in rows[1:]} == {
        "lenient"
    }
    predictions = [json.loads(line) for line in (tmp_path / "predictions_gsm8k.jsonl").open()]
    assert len(predictions) == 3 and set(predictions[0]) == {
        "task",
        "protocol",
        "instruction",
        "prompt",
        "response",
        "prediction",
        "answer",
        "correct",
    }
    assert predictions[0]["task"] == "gsm8k" and predictions[0]["prompt"].endswith("### Response:\n")
    saved = read_predictions([tmp_path / "predictions_boolq.jsonl", tmp_path / "predictions_gsm8k.jsonl"])
    assert score_predictions(saved, "lenient") == saved, "re-scoring reproduces the evaluation"
