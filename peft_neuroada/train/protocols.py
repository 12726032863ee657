"""The two protocols a recipe can be trained and scored with, one object per name.

A protocol owns everything that decides a score besides the model: the tokenizer's set-up, the prompts, how
training examples are tokenised and masked, how prompts are encoded for generation, which generation budget a
task gets, what is kept of a generation, and how it is scored.

`paper` is what the official NeuroAda code (FightingFighting/NeuroAda: task_config.py, dataset.py,
compute_metrics.py, train_our.py, on pyreft 0.0.8) does, quirks included; configs/paper/* use it. It knows the two
task families of the paper's runs, commonsense and math (gsm8k's test set is math's). That code's other tasks are
not implemented: its `gsm8k` task (GSM8K's training set, LoftQ's prompt, 256 new tokens) and `commonsense_15k`
(commonsense prompts on a 15k subset), the hyperparameter searches' own settings, and pyreft's alpaca, instruct and
ultrafeedback tasks. `lenient` is this project's earlier protocol (the Alpaca prompt
everywhere, the answer read generously from the response) and remains the default for other recipes. GLUE recipes
have no prompts: glue.py builds their rows as the official code does under either protocol, which sets up only
their tokenizer (the paper protocol's pad token is unk, as there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from typing import ClassVar, Literal

from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .answers import ANSWER_FORMAT, ARITHMETIC_TASKS, COMMONSENSE_OPTIONS, LETTER_TASKS, Judgement, answer_rule
from .data import Example, as_dataset, tokenize_jointly, tokenize_prompt_cut, training_dataset
from .official_scoring import is_float, judge_commonsense, judge_math
from .prompts import commonsense_prompt, commonsense_target, cut_response, math_prompt

Family = Literal["commonsense", "math"]
Budget = Literal["options", "number"]
Scorer = Callable[[str, str, str], Judgement]
"""Scores one (prompt, response, gold answer)."""

COMMONSENSE_SETS = (*COMMONSENSE_OPTIONS, "commonsense_170k", "commonsense_15k")
"""Official task_config.py L4-L10 (and its commonsense_15k task)."""
MATH_SETS = (*LETTER_TASKS, *ARITHMETIC_TASKS, "math_10k")
"""Official task_config.py L29-L35."""
_LETTERS = frozenset("ABCDE")


def task_family(task: str, examples: list[Example]) -> Family:
    """Which of the official code's two tasks a data set belongs to: by name for the paper's data sets, else by its
    records (commonsense ones all carry an `Answer format:` line, math ones have number or A-E answers)."""
    if task in COMMONSENSE_SETS:
        return "commonsense"
    if task in MATH_SETS:
        return "math"
    formats = {bool(ANSWER_FORMAT.search(example.instruction)) for example in examples}
    if formats == {True}:
        return "commonsense"
    if formats == {False} and all(is_float(e.answer) or e.answer.strip() in _LETTERS for e in examples):
        return "math"
    raise ValueError(
        f"The paper protocol cannot tell whether '{task}' is a commonsense or a math data set: it is not one of the "
        "paper's, and its records neither all have an 'Answer format:' line nor all have number or A-E answers."
    )


class Protocol(ABC):
    """Prompts, tokenisation, budgets and scoring of one protocol; see the module docstring."""

    name: ClassVar[str]
    sort_by_length: ClassVar[bool]
    """Whether evaluation batches prompts of similar length together (faster) or keeps the data set's order."""

    @abstractmethod
    def load_tokenizer(self, path: str, max_length: int | None) -> PreTrainedTokenizerBase:
        """The model's tokenizer, with a pad token, set up as the protocol trains and evaluates with it."""

    @abstractmethod
    def prompts(self, task: str, examples: list[Example]) -> list[str]:
        """The exact prompt string the model is given for each example."""

    @abstractmethod
    def training_dataset(
        self, examples: list[Example], tokenizer: PreTrainedTokenizerBase, max_length: int
    ) -> Dataset:
        """Tokenised training rows (input_ids, attention_mask, labels with -100 where nothing is learned)."""

    @abstractmethod
    def encode_prompt(self, prompt: str, tokenizer: PreTrainedTokenizerBase) -> tuple[dict[str, list], bool]:
        """The generation input (input_ids, attention_mask) for a prompt, and whether the prompt was cut."""

    @abstractmethod
    def response(self, generated: str) -> str:
        """What is kept (and saved) of the decoded new tokens."""

    @abstractmethod
    def budget(self, task: str, examples: list[Example]) -> Budget:
        """Which of the recipe's generation budgets (max_new_tokens_options / _number) the task gets."""

    @abstractmethod
    def scorer(self, task: str, examples: list[Example]) -> Scorer:
        """How the task's responses are scored; `examples` are its records (for data sets the rules do not know)."""


class PaperProtocol(Protocol):
    """The official NeuroAda code's protocol."""

    name = "paper"
    sort_by_length = False  # official: a DataLoader over the test set in file order (compute_metrics.py L328)

    def load_tokenizer(self, path: str, max_length: int | None) -> PreTrainedTokenizerBase:
        """Official train_our.py L283-L296: right padding, model_max_length = max_length (which cuts evaluation
        prompts), and unk as the pad token, or an added `[PAD]` when the tokenizer has neither (Llama-3; the
        model's embeddings grow to match, see models.load_base_model).

        Two deliberate differences: the official code asks for the slow SentencePiece tokenizer (`use_fast=False`),
        which transformers 5 no longer keeps apart, so this loads the fast one built from the same vocabulary and
        merges; and a tokenizer with a pad token but no unk keeps its pad token, where the official code would set
        it to None and fail at the first padded batch."""
        options = {} if max_length is None else {"model_max_length": max_length}
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="right", **options)
        if tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        elif tokenizer.pad_token is None:
            tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        return tokenizer

    def prompts(self, task: str, examples: list[Example]) -> list[str]:
        build = commonsense_prompt if task_family(task, examples) == "commonsense" else math_prompt
        return [build(example.instruction) for example in examples]

    def training_dataset(
        self, examples: list[Example], tokenizer: PreTrainedTokenizerBase, max_length: int
    ) -> Dataset:
        """Official dataset.py L126-L131 and L163-L194: commonsense rows teach the trigger and the gold label,
        math rows the record's output; see `tokenize_jointly`. Rows left with nothing to learn are kept, as there."""
        by_task: dict[str, list[Example]] = defaultdict(list)
        for example in examples:
            by_task[example.task].append(example)
        families = {task: task_family(task, records) for task, records in by_task.items()}
        rows = []
        for example in examples:
            if families[example.task] == "commonsense":
                prompt, target = commonsense_prompt(example.instruction), commonsense_target(example.answer)
            else:
                prompt, target = math_prompt(example.instruction), example.output
            rows.append(tokenize_jointly(prompt, target, tokenizer, max_length))
        return as_dataset(rows, max_length)

    def encode_prompt(self, prompt: str, tokenizer: PreTrainedTokenizerBase) -> tuple[dict[str, list], bool]:
        """Cut at max_length, behind pyreft's pad sink; generation then runs greedily with the recipe's batch size
        (official: eos as the only stop token, task_config.py L15-L18 and L41-L44, compute_metrics.py L367-L374)."""
        return tokenize_prompt_cut(prompt, tokenizer)

    def response(self, generated: str) -> str:
        """All of it: the official scorer reads the whole decoded generation."""
        return generated

    def budget(self, task: str, examples: list[Example]) -> Budget:
        """Per family (task_config.py L15-L18, L41-L44): commonsense 32 new tokens, math 512, AQuA included."""
        return "options" if task_family(task, examples) == "commonsense" else "number"

    def scorer(self, task: str, examples: list[Example]) -> Scorer:
        """Official compute_metrics.py L389-L415 on prompt + response, the text its batch_decode gives."""
        judge = judge_commonsense if task_family(task, examples) == "commonsense" else judge_math
        return lambda prompt, response, answer: judge(prompt + response, answer)


class LenientProtocol(Protocol):
    """The project's earlier protocol: Alpaca prompts, prompt and response tokenised apart, generous scoring."""

    name = "lenient"
    sort_by_length = True

    def load_tokenizer(self, path: str, max_length: int | None) -> PreTrainedTokenizerBase:
        """The tokenizer as it comes, given its EOS as pad token if it has none; prompts are never cut."""
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def prompts(self, task: str, examples: list[Example]) -> list[str]:
        return [example.prompt for example in examples]

    def training_dataset(
        self, examples: list[Example], tokenizer: PreTrainedTokenizerBase, max_length: int
    ) -> Dataset:
        return training_dataset(examples, tokenizer, max_length)

    def encode_prompt(self, prompt: str, tokenizer: PreTrainedTokenizerBase) -> tuple[dict[str, list], bool]:
        input_ids = tokenizer(prompt)["input_ids"]
        return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids)}, False

    def response(self, generated: str) -> str:
        return cut_response(generated)

    def budget(self, task: str, examples: list[Example]) -> Budget:
        """By answer kind: a number to compute gets the long budget, an option to pick (AQuA's letters too) the
        short one."""
        return "number" if answer_rule(task, examples).options is None else "options"

    def scorer(self, task: str, examples: list[Example]) -> Scorer:
        """The answer rule of `answers.py` on the response cut at a made-up next `### ` section."""
        rule = answer_rule(task, examples)

        def score(prompt: str, response: str, answer: str) -> Judgement:
            prediction = rule.extract(cut_response(response))
            return Judgement(prediction, rule.is_correct(prediction, answer))

        return score


PROTOCOLS: dict[str, Protocol] = {protocol.name: protocol for protocol in (PaperProtocol(), LenientProtocol())}


def get_protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"Unknown protocol {name!r}; choose one of {sorted(PROTOCOLS)}.")
    return PROTOCOLS[name]
