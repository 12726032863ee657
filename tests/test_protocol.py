"""The paper protocol is the official NeuroAda code's protocol; the lenient one stays as it was.

The official rules are re-implemented below from the behaviour of FightingFighting/NeuroAda (compute_metrics.py,
task_config.py, dataset.py, train_our.py; pyreft 0.0.8 underneath), independently of the package's code, and the
package is checked against them: scoring on many generated responses, prompts on the shared data sets, and the
training rows on a SentencePiece-style Llama tokenizer built here, offline.
"""

from __future__ import annotations

import itertools
import json
import re
from copy import deepcopy
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer, PreTrainedTokenizerFast

from peft_neuroada.train.answers import Judgement
from peft_neuroada.train.cli import main
from peft_neuroada.train.data import IGNORE_INDEX, Example, dataset_file, load_examples, sample, tokenize_jointly
from peft_neuroada.train.evaluate import generate_responses
from peft_neuroada.train.models import load_base_model
from peft_neuroada.train.protocols import get_protocol, task_family
from tests.conftest import save_tiny_llama
from tests.shared_data import shared_datasets

PAPER, LENIENT = get_protocol("paper"), get_protocol("lenient")

# ---------------------------------------------------------------------------------------------------------------
# The official rules, from their behaviour.

OFFICIAL_COMMONSENSE_TEMPLATE = "%s\n"  # task_config.py L11
OFFICIAL_COMMONSENSE_TRIGGER = "the correct answer is "  # task_config.py L12
OFFICIAL_MATH_TRIGGER = "### Response:"  # task_config.py L37
# templates.py alpaca_prompt_no_input_template (task_config.py L36), LoReFT's template written with `\` line breaks.
OFFICIAL_MATH_TEMPLATE = """Below is an instruction that \
describes a task. Write a response that appropriately \
completes the request.

### Instruction:
%s

### Response:
"""


def official_is_float(value) -> bool:
    """compute_metrics.py L34-L42."""
    if value is None:
        return False
    try:
        float(value)
        return True
    except ValueError:
        return False


def official_number(sentence: str) -> float:
    """compute_metrics.py L44-L59."""
    found = re.findall(r"-?\d+\.?\d*", sentence.replace(",", ""))
    if not found:
        return float("inf")
    return float(found[-1])


def official_letter(sentence: str) -> str:
    """compute_metrics.py L62-L81."""
    found = re.findall(r"A|B|C|D|E", sentence.strip())
    return found[0] if found else ""


def official_output(pred: str, trigger: str) -> str:
    """compute_metrics.py L84-L93."""
    start = pred.find(trigger)
    if start < 0:
        return ""
    return pred[start + len(trigger) :].lstrip()


def official_judge(commonsense: bool, decoded: str, answer: str) -> tuple[object, bool]:
    """compute_metrics_percell L389-L415: (generation, correct) for the decoded prompt + generation."""
    if commonsense:
        generation = official_output(decoded, OFFICIAL_COMMONSENSE_TRIGGER)
        return generation, generation.strip() == answer.strip()
    raw = official_output(decoded, OFFICIAL_MATH_TRIGGER)
    answer = answer.strip()
    if not official_is_float(answer):
        generation = official_letter(raw)
        return generation, generation.strip() == answer.strip()
    generation = official_number(raw)
    return generation, abs(float(answer) - generation) <= 0.001


def official_training_row(prompt: str, target: str, tokenizer, max_length: int) -> dict[str, list]:
    """dataset.py L163-L168 and L192-L194, then pyreft's pad "sink" before the sequence and its attention mask."""
    prompt_length = len(tokenizer(prompt, max_length=max_length, truncation=True, return_tensors="pt")["input_ids"][0])
    input_ids = tokenizer(prompt + target + tokenizer.eos_token, max_length=max_length, truncation=True)["input_ids"]
    labels = deepcopy(input_ids)
    labels[:prompt_length] = [IGNORE_INDEX] * len(labels[:prompt_length])
    input_ids = [tokenizer.pad_token_id] + input_ids
    return {
        "input_ids": input_ids,
        "attention_mask": [0 if token == tokenizer.pad_token_id else 1 for token in input_ids],
        "labels": [IGNORE_INDEX] + labels,
    }


# ---------------------------------------------------------------------------------------------------------------
# A small SentencePiece-style Llama tokenizer (byte-fallback BPE behind a Metaspace pre-tokenizer), built offline.

CORPUS = [
    "Please answer the following question with true or false, question: is the sky blue? Answer format: true/false",
    "Please choose the correct answer to the question: Which tool cuts wood? Answer1: saw Answer2: spoon "
    "Answer3: cup Answer4: pen Answer format: answer1/answer2/answer3/answer4",
    "the correct answer is answer1. the correct answer is answer2. the correct answer is true or false.",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "Instruction: Response: Tom has 3 apples and buys 24 more. How many apples does he have? He has 3 + 24 = 27 "
    "apples. The answer is 27.",
]


def sentencepiece_llama_tokenizer(with_unk: bool = True) -> PreTrainedTokenizerFast:
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    specials = ["<unk>", "<s>", "</s>"] if with_unk else ["<s>", "</s>"]
    model = models.BPE(unk_token="<unk>" if with_unk else None, byte_fallback=True, fuse_unk=with_unk)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[*specials, *byte_tokens], show_progress=False)
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    backend.train_from_iterator(CORPUS * 5, trainer)
    state = json.loads(backend.to_str())["model"]
    merges = [tuple(merge) for merge in state["merges"]]
    if with_unk:
        return LlamaTokenizer(vocab=state["vocab"], merges=merges, add_bos_token=True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def llama_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer as the paper protocol sets it up: unk as pad, right padding, model_max_length the max length."""
    tokenizer = sentencepiece_llama_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side, tokenizer.model_max_length = tokenizer.unk_token, "right", 64
    return tokenizer


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama saved with the SentencePiece-style tokenizer, like any local model."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-sp"), sentencepiece_llama_tokenizer(), 1024)


# ---------------------------------------------------------------------------------------------------------------
# Scoring.

FRAGMENTS = [
    "the correct answer is ",
    "The correct answer is ",
    "the correct answer is",
    "answer1",
    "answer2",
    "Answer1",
    "true",
    "false",
    "True",
    "ending3",
    " ",
    "\n",
    "\n\n",
    ".",
    ",",
    "### Response:",
    "### Response:\n",
    "\n### Instruction:\n",
    "The answer is ",
    "Answer: ",
    "A",
    "B",
    "(C)",
    "E",
    "5",
    "-3",
    "3.",
    "2.50",
    "1,234",
    "576",
    "576.0",
    "0.0004",
    "1e5",
    "x",
]
ANSWERS = {
    "boolq": ["true", "false", " true "],
    "ARC-Easy": ["answer1", "answer2"],
    "gsm8k": ["576.0", "5", "-3", "1234", "2.5", "0", " 27 "],
    "AQuA": ["A", "C", "E", " B"],
}
INSTRUCTIONS = {
    "boolq": ["Is the sky blue?\n\nAnswer format: true/false", "Say 'the correct answer is true'.\n\nAnswer format:"],
    "ARC-Easy": ["Which cuts wood? Answer1: saw Answer2: cup\n\nAnswer format: answer1/answer2"],
    "gsm8k": ["Tom has 3 apples and buys 24 more. How many?", "What follows '### Response:' here?"],
    "AQuA": ["Pick the even number. Answer Choices: (A)1 (B)2 (C)3 (D)5 (E)7"],
}
free_form = st.lists(st.sampled_from(FRAGMENTS), max_size=10).map("".join)


LEADS = ["", " ", "\n", "### Response:\n", "Sure. "]
TRIGGERS = ["the correct answer is ", "The correct answer is ", "the correct answer is", "The answer is ", ""]
NEAR_MISSES = ["Answer1", "True", "(E)", "2.50", "1,234", "answer2", "A"]
TAILS = ["", " ", "\n", ".", " because", "\n\n### Instruction:\nNext? 7"]


def answer_shaped(answer: str) -> st.SearchStrategy[str]:
    """Some lead-in, a trigger or a near miss, the gold label or a near miss, a tail: often right."""
    return st.tuples(
        st.sampled_from(LEADS),
        st.sampled_from(TRIGGERS),
        st.sampled_from([answer.strip()] * 4 + NEAR_MISSES),
        st.sampled_from(TAILS),
    ).map("".join)


cases = (
    st.sampled_from(sorted(INSTRUCTIONS))
    .flatmap(
        lambda task: st.tuples(st.just(task), st.sampled_from(INSTRUCTIONS[task]), st.sampled_from(ANSWERS[task]))
    )
    .flatmap(
        lambda case: st.tuples(
            st.just(case[0]), st.just(case[1]), st.one_of(free_form, answer_shaped(case[2])), st.just(case[2])
        )
    )
)


@settings(max_examples=2000, deadline=None)
@given(case=cases)
def test_paper_scoring_matches_the_official_rules_on_generated_responses(case):
    task, instruction, response, answer = case
    example = Example(instruction, "", answer, task=task)
    [prompt] = PAPER.prompts(task, [example])
    judgement = PAPER.scorer(task, [example])(prompt, response, answer)
    generation, correct = official_judge(task in ("boolq", "ARC-Easy"), prompt + response, answer)
    assert judgement.correct == correct
    assert judgement.prediction == str(generation)


def test_paper_scoring_matches_the_official_rules_on_every_answer_shaped_response():
    for task, instructions in INSTRUCTIONS.items():
        for instruction, answer in itertools.product(instructions, ANSWERS[task]):
            example = Example(instruction, "", answer, task=task)
            [prompt] = PAPER.prompts(task, [example])
            score = PAPER.scorer(task, [example])
            for parts in itertools.product(LEADS, TRIGGERS, [answer.strip(), *NEAR_MISSES], TAILS):
                response = "".join(parts)
                official = official_judge(task in ("boolq", "ARC-Easy"), prompt + response, answer)
                assert score(prompt, response, answer) == Judgement(str(official[0]), official[1]), response


@settings(max_examples=300, deadline=None)
@given(case=cases)
def test_scoring_prompt_plus_response_equals_scoring_the_official_joint_decode(case, llama_tokenizer):
    """The official code decodes prompt and generation in one call; the protocol scores prompt + the generation
    decoded alone. On a SentencePiece tokenizer they differ by a space at the seam, which never changes a score."""
    task, instruction, response, answer = case
    example = Example(instruction, "", answer, task=task)
    [prompt] = PAPER.prompts(task, [example])
    prompt_ids = [llama_tokenizer.pad_token_id, *llama_tokenizer(prompt)["input_ids"]]
    generated_ids = llama_tokenizer(response, add_special_tokens=False)["input_ids"]
    official_decode = llama_tokenizer.decode(prompt_ids + generated_ids, skip_special_tokens=True)
    own_response = llama_tokenizer.decode(generated_ids, skip_special_tokens=True)
    judgement = PAPER.scorer(task, [example])(prompt, own_response, answer)
    assert judgement.correct == official_judge(task in ("boolq", "ARC-Easy"), official_decode, answer)[1]


@pytest.mark.parametrize(
    ("response", "answer", "paper", "lenient"),
    [
        ("the correct answer is answer1", "answer1", True, True),
        (" the correct answer is answer1 \n", "answer1", True, True),
        ("the correct answer is answer1.", "answer1", False, True),
        ("the correct answer is answer1, not answer2", "answer1", False, True),
        ("The correct answer is answer1", "answer1", False, True),
        ("the correct answer is Answer1", "answer1", False, True),
        ("answer1", "answer1", False, True),
        ("the correct answer is answer2", "answer1", False, False),
    ],
)
def test_commonsense_is_exact_after_the_first_trigger(response, answer, paper, lenient):
    example = Example("Which? Answer1: a Answer2: b\n\nAnswer format: answer1/answer2", "", answer, task="ARC-Easy")
    for protocol, expected in ((PAPER, paper), (LENIENT, lenient)):
        [prompt] = protocol.prompts("ARC-Easy", [example])
        assert protocol.scorer("ARC-Easy", [example])(prompt, response, answer).correct is expected, protocol.name


def test_a_trigger_inside_the_instruction_is_the_one_the_official_code_finds():
    example = Example("Is 'the correct answer is answer1' a sentence?\n\nAnswer format: true/false", "", "true")
    [prompt] = PAPER.prompts("boolq", [example])
    judgement = PAPER.scorer("boolq", [example])(prompt, "the correct answer is true", "true")
    assert not judgement.correct and judgement.prediction.startswith("answer1' a sentence?")


@pytest.mark.parametrize(
    ("task", "response", "answer", "paper", "lenient"),
    [
        ("gsm8k", "3 + 24 = 27. The answer is 27.", "27", True, True),
        ("gsm8k", "\n### Response:\nThe answer is 27", "27", True, False),
        ("gsm8k", "The answer is 27.\n\n### Instruction:\nAnd 2 + 2?\n\n### Response:\n4", "27", False, True),
        ("gsm8k", "no number here", "0", False, False),
        ("AQuA", "The answer is (C).", "C", True, True),
        ("AQuA", "Answer: C", "C", False, False),
        ("AQuA", "\n### Response:\nthe answer is D", "D", True, False),
    ],
)
def test_math_reads_the_whole_generation(task, response, answer, paper, lenient):
    example = Example("How many?", "", answer, task=task)
    for protocol, expected in ((PAPER, paper), (LENIENT, lenient)):
        [prompt] = protocol.prompts(task, [example])
        assert protocol.scorer(task, [example])(prompt, response, answer).correct is expected, protocol.name


def test_generation_budgets_follow_the_task_family_in_the_paper_and_the_answer_kind_in_the_lenient_protocol():
    aqua = [Example("Pick one. Answer Choices: (A)1 (B)2", "", "A")]
    assert (PAPER.budget("AQuA", aqua), LENIENT.budget("AQuA", aqua)) == ("number", "options")
    assert PAPER.budget("boolq", []) == LENIENT.budget("boolq", []) == "options"
    assert PAPER.budget("gsm8k", []) == LENIENT.budget("gsm8k", []) == "number"


def test_unknown_data_sets_are_placed_by_their_records_or_refused():
    assert task_family("colours", [Example("Pick.\n\nAnswer format: red/blue", "", "red")]) == "commonsense"
    assert task_family("sums", [Example("1+1?", "", "2"), Example("Pick", "", "B")]) == "math"
    with pytest.raises(ValueError, match="commonsense or a math data set"):
        task_family("poems", [Example("Write a poem.", "", "Roses are red")])


# ---------------------------------------------------------------------------------------------------------------
# Prompts.


@pytest.mark.parametrize(
    ("name", "split", "template"),
    [
        ("ARC-Easy", "test", OFFICIAL_COMMONSENSE_TEMPLATE),
        ("boolq", "test", OFFICIAL_COMMONSENSE_TEMPLATE),
        ("commonsense_15k", "train", OFFICIAL_COMMONSENSE_TEMPLATE),
        ("gsm8k", "test", OFFICIAL_MATH_TEMPLATE),
        ("math_10k", "train", OFFICIAL_MATH_TEMPLATE),
    ],
)
def test_paper_prompts_are_the_official_ones_on_the_shared_data_sets(name, split, template):
    examples = load_examples(dataset_file(shared_datasets(), name, split), name)
    assert PAPER.prompts(name, examples) == [template % example.instruction for example in examples]


def test_the_math_prompt_is_the_alpaca_one_and_the_commonsense_target_is_the_records_output():
    math = load_examples(dataset_file(shared_datasets(), "math_10k", "train"), "math_10k")
    assert PAPER.prompts("math_10k", math) == LENIENT.prompts("math_10k", math)
    commonsense = load_examples(dataset_file(shared_datasets(), "commonsense_15k", "train"), "commonsense_15k")
    assert all(e.output == OFFICIAL_COMMONSENSE_TRIGGER + e.answer for e in commonsense)


def test_prompts_command_prints_the_exact_prompts_as_json_lines(capsys):
    assert (
        main(["prompts", "--data-dir", str(shared_datasets()), "--task", "boolq", "--n", "3", "--protocol", "paper"])
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    examples = load_examples(dataset_file(shared_datasets(), "boolq", "test"))[:3]
    assert lines == [
        {"task": "boolq", "index": i, "prompt": e.instruction + "\n", "answer": e.answer}
        for i, e in enumerate(examples)
    ]
    assert main(["prompts", "--data-dir", str(shared_datasets()), "--task", "gsm8k", "--n", "1"]) == 0
    [lenient] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lenient["prompt"].endswith("### Response:\n") and lenient["answer"] == "576.0"


# ---------------------------------------------------------------------------------------------------------------
# Tokenisation, masking, padding, truncation.


@pytest.mark.parametrize("name", ["commonsense_15k", "math_10k"])
def test_training_rows_are_the_official_ones(name, llama_tokenizer):
    examples = load_examples(dataset_file(shared_datasets(), name, "train"), name)[:40]
    rows = PAPER.training_dataset(examples, llama_tokenizer, max_length=256)
    if name == "math_10k":
        assert any(len(row["input_ids"]) == 1 + 256 for row in rows), "long solutions are cut at max_length"
    for example, row in zip(examples, rows, strict=True):
        if name == "commonsense_15k":
            prompt, target = example.instruction + "\n", OFFICIAL_COMMONSENSE_TRIGGER + example.answer
        else:
            prompt, target = OFFICIAL_MATH_TEMPLATE % example.instruction, example.output
        assert row == official_training_row(prompt, target, llama_tokenizer, max_length=256)


def test_prompt_output_and_eos_are_tokenised_together_and_masked_by_the_prompts_own_length(llama_tokenizer):
    prompt, answer = "Which cuts wood?\n", "answer1"
    row = PAPER.training_dataset([Example(prompt[:-1], "", answer, task="ARC-Easy")], llama_tokenizer, 64)[0]
    prompt_ids = llama_tokenizer(prompt)["input_ids"]
    joint_ids = llama_tokenizer(prompt + "the correct answer is answer1</s>")["input_ids"]
    assert row["input_ids"] == [llama_tokenizer.pad_token_id, *joint_ids]
    assert row["attention_mask"] == [0] + [1] * len(joint_ids)
    assert row["labels"] == [IGNORE_INDEX] * (1 + len(prompt_ids)) + joint_ids[len(prompt_ids) :]
    learned = [token for token in row["labels"] if token != IGNORE_INDEX]
    assert learned[-1] == llama_tokenizer.eos_token_id
    assert llama_tokenizer.decode(learned, skip_special_tokens=True) == "the correct answer is answer1"
    # Tokenised on its own (as the lenient protocol does), the answer would start with a word-initial piece that
    # the model never sees after the prompt's newline.
    alone = llama_tokenizer("the correct answer is answer1", add_special_tokens=False)["input_ids"]
    assert alone != learned[:-1]


def test_the_mask_counts_prompt_tokens_even_when_the_joint_tokenisation_merges_across_the_seam(llama_tokenizer):
    prompt, target = "Tom has the correct answ", "er1 and 27 apples"
    row = official_training_row(prompt, target, llama_tokenizer, 64)
    prompt_length = len(llama_tokenizer(prompt)["input_ids"])
    joint_ids = llama_tokenizer(prompt + target + "</s>")["input_ids"]
    assert joint_ids[:prompt_length] != llama_tokenizer(prompt)["input_ids"], "the seam merged"
    assert row["labels"] == [IGNORE_INDEX] * (1 + prompt_length) + joint_ids[prompt_length:]
    assert tokenize_jointly(prompt, target, llama_tokenizer, 64) == row


def test_max_length_cuts_the_end_and_keeps_rows_with_nothing_left_to_learn(llama_tokenizer):
    long_output = Example("Add them.", "He has 3 + 24 = 27 apples. " * 20, "27", task="gsm8k")
    long_prompt = Example("How many apples? " * 40, "27", "27", task="gsm8k")
    rows = PAPER.training_dataset([long_output, long_prompt], llama_tokenizer, max_length=96)
    assert len(rows) == 2, "the official code keeps every example"
    assert [len(row["input_ids"]) for row in rows] == [97, 97], "max_length tokens behind the sink"
    assert rows[0]["labels"][-1] != llama_tokenizer.eos_token_id
    assert all(label == IGNORE_INDEX for label in rows[1]["labels"])
    with pytest.raises(ValueError, match="raise it"):
        PAPER.training_dataset([long_prompt], llama_tokenizer, max_length=96)


def test_evaluation_prompts_sit_behind_the_sink_and_are_cut_at_max_length(llama_tokenizer):
    inputs, cut = PAPER.encode_prompt("Is the sky blue?\n", llama_tokenizer)
    assert not cut and inputs["input_ids"] == [
        llama_tokenizer.pad_token_id,
        *llama_tokenizer("Is the sky blue?\n")["input_ids"],
    ]
    assert inputs["attention_mask"] == [0] + [1] * (len(inputs["input_ids"]) - 1)
    inputs, cut = PAPER.encode_prompt("How many apples? " * 40, llama_tokenizer)
    assert cut and len(inputs["input_ids"]) == 1 + llama_tokenizer.model_max_length


def test_paper_tokenizer_pads_right_with_unk_and_adds_a_pad_token_where_there_is_neither(tiny_llama_dir, tmp_path):
    model, tokenizer = load_base_model(str(tiny_llama_dir), protocol="paper", max_length=48)
    assert (tokenizer.padding_side, tokenizer.pad_token, tokenizer.model_max_length) == ("right", "<unk>", 48)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)

    no_unk = sentencepiece_llama_tokenizer(with_unk=False)
    assert no_unk.unk_token is None and no_unk.pad_token is None
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(no_unk), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with torch.no_grad():  # rows far from the model's initialisation, N(0, 0.02)
        llama.get_input_embeddings().weight.fill_(3.0)
        llama.get_output_embeddings().weight.fill_(3.0)
    llama.save_pretrained(tmp_path)
    no_unk.save_pretrained(tmp_path)
    model, tokenizer = load_base_model(str(tmp_path), protocol="paper", max_length=48)
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == len(no_unk)
    assert model.get_input_embeddings().num_embeddings == len(no_unk) + 1, "embeddings grew to the pad token"
    for embeddings in (model.get_input_embeddings(), model.get_output_embeddings()):
        # initialised as the model initialises weights, as transformers 4.45 (the official runs') did; not from the
        # other rows' mean, as transformers does by default since 4.46
        assert embeddings.weight[-1].abs().max() < 0.2 and torch.all(embeddings.weight[:-1] == 3.0)


@pytest.mark.parametrize("protocol", ["paper", "lenient"])
def test_batched_generation_matches_one_at_a_time(protocol, tiny_llama_dir):
    model, tokenizer = load_base_model(str(tiny_llama_dir), protocol=protocol, max_length=64)
    prompts = ["Is the sky blue?\n", "Which tool cuts wood? Answer1: saw Answer2: spoon\n", "Tom has 3 apples.\n"]
    batched = generate_responses(model, tokenizer, prompts, 3, 6, protocol=protocol)
    single = [generate_responses(model, tokenizer, [p], 1, 6, protocol=protocol)[0] for p in prompts]
    assert batched == single


# ---------------------------------------------------------------------------------------------------------------
# The commands.


def test_score_rescores_predictions_under_either_protocol(tmp_path, capsys):
    lines = [
        {
            "task": "boolq",
            "prompt": "Is it?\n\nAnswer format: true/false\n",
            "response": "the correct answer is true",
            "answer": "true",
        },
        {"task": "boolq", "prompt": "Is it?\n\nAnswer format: true/false\n", "response": "True", "answer": "true"},
        {
            "task": "gsm8k",
            "prompt": OFFICIAL_MATH_TEMPLATE % "2+3?",
            "response": "5\n### Instruction:\n1+1?\n### Response:\n2",
            "answer": "5",
        },
    ]
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for protocol, expected in (("paper", [True, False, False]), ("lenient", [True, True, True])):
        out = tmp_path / f"{protocol}.jsonl"
        assert main(["score", str(predictions), "--protocol", protocol, "--out", str(out)]) == 0
        scored = [json.loads(line) for line in out.open()]
        assert [line["correct"] for line in scored] == expected
        assert all(line["protocol"] == protocol for line in scored)
        assert [{k: line[k] for k in lines[0]} for line in scored] == lines
        table = capsys.readouterr().out
        assert f"| boolq | {50.0 if protocol == 'paper' else 100.0} | " in table and "| gsm8k |" in table


def test_score_names_a_line_without_a_required_key(tmp_path):
    predictions = tmp_path / "bad.jsonl"
    predictions.write_text(json.dumps({"task": "boolq", "response": "true", "answer": "true"}) + "\n")
    with pytest.raises(SystemExit, match=r"neuroada score: error: .*bad\.jsonl:1 has no prompt"):
        main(["score", str(predictions), "--protocol", "paper", "--out", str(tmp_path / "out.jsonl")])


def test_paper_recipe_trains_evaluates_and_its_predictions_rescore_identically(tiny_llama_dir, tmp_path):
    output = tmp_path / "run"
    recipe = tmp_path / "paper.yaml"
    recipe.write_text(
        f"""
model: {tiny_llama_dir}
protocol: paper
output_dir: {output}
method: {{name: neuroada, k: 1}}
data: {{dir: {shared_datasets()}, train: [commonsense_15k, math_10k], train_size: 6, max_length: 96}}
training: {{learning_rate: 1.0e-2, batch_size: 2, max_steps: 2, warmup: 1, logging_steps: 1, save_steps: 2}}
evaluation: {{tasks: [boolq, gsm8k], size: 3, batch_size: 2, max_new_tokens_options: 3, max_new_tokens_number: 5}}
"""
    )
    assert main(["train", str(recipe)]) == 0
    results = output / "results"
    summary = json.loads((results / "results.json").read_text())
    assert summary["protocol"] == "paper"
    assert json.loads((output / "train_log.json").read_text())["protocol"] == "paper"
    assert (results / "results.csv").read_text().splitlines()[0].endswith(",protocol")
    saved = [
        json.loads(line) for task in ("boolq", "gsm8k") for line in (results / f"predictions_{task}.jsonl").open()
    ]
    assert {line["protocol"] for line in saved} == {"paper"}
    prompts = [
        prompt
        for task in ("boolq", "gsm8k")
        for prompt in PAPER.prompts(task, sample(load_examples(dataset_file(shared_datasets(), task, "test")), 3, 42))
    ]
    kept = [line["prompt"] for line in saved]
    assert all(seen == prompt or prompt.startswith(seen) for seen, prompt in zip(kept, prompts, strict=True))
    assert kept[0] == prompts[0] and kept[-1] != prompts[-1], (
        "a prompt over max_length is recorded as the model saw it"
    )

    rescored = tmp_path / "rescored.jsonl"
    files = [str(results / f"predictions_{task}.jsonl") for task in ("boolq", "gsm8k")]
    assert main(["score", *files, "--protocol", "paper", "--out", str(rescored)]) == 0
    assert [json.loads(line) for line in rescored.open()] == saved
