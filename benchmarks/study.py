"""Accuracy for trainable parameters: SmolLM2-135M fine-tuned by NeuroAda, LoRA, SHiRA, Super-Tuning, mask-based
sparse tuning and full fine-tuning, each budget at its own swept learning rate, over three test seeds (the paper's
Figure 1 shape).

    python benchmarks/study.py                 # the CPU study, resumable, into docs/study/results.json
    python benchmarks/study.py --device cuda   # the scale-up, into docs/study/results-cuda.json
    python benchmarks/study_figures.py         # the figures and the table, from the committed results
    python benchmarks/study.py --dry-run --results /tmp/study.json   # a tiny random model: the suite's check

The CPU study's task: the second largest of four two-digit numbers (`second(12,85,47,60)=` answered `60`), 60 steps
of 16 examples. Untrained, SmolLM2 answers none of it in this format; NeuroAda k=1 reached 54% in 40 steps of a trial
run, so budgets have room to differ. Training draws its examples per seed and never a dev or test question. The
scale-up trains on commonsense_15k under the paper protocol and scores ARC-Easy and boolq (`STUDIES["cuda"]`).

1. Sweep: for every budget of every method, each learning rate of the method's grid is trained with the sweep seed
   and scored on the dev questions; while the best rate is the grid's smallest or largest, the next rate beyond it
   (a half-decade step) is tried too. The best rate (the smaller one on a tie) is that budget's rate.
2. Test: every budget of every method, at its own rate, trained with each test seed (never the sweep seed) and scored
   on the test questions; each answer is recorded, so study_figures.py can pair methods question by question.

Every finished run is a record in the results file; a run already recorded is skipped, so an interrupted study
resumes. A file made with other settings is refused, not mixed.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

import common  # this checkout's peft_neuroada first
import torch
from cost import meters, variants
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, set_seed

from peft_neuroada.atomic_file import write_atomically
from peft_neuroada.train.data import IGNORE_INDEX, dataset_file, load_examples, training_collator
from peft_neuroada.train.evaluate import average_accuracy, evaluate_task, evaluate_tasks
from peft_neuroada.train.models import load_base_model
from peft_neuroada.train.models import load_tokenizer as load_tokenizer_for
from peft_neuroada.train.protocols import get_protocol
from peft_neuroada.train.recipes import EvaluationSpec

RESULTS = {"cpu": common.REPO_ROOT / "docs" / "study" / "results.json"}
RESULTS["cuda"] = RESULTS["cpu"].with_name("results-cuda.json")
DATASETS = common.REPO_ROOT.parent / "shared" / "datasets"


@dataclass(frozen=True)
class Settings:
    """What every record of one results file shares."""

    task: str
    model: str
    device: str
    dtype: str
    steps: int
    batch: int
    warmup: float
    dev_questions: int
    test_questions: int | None
    sweep_seed: int
    test_seeds: tuple[int, ...]


STUDIES = {
    "cpu": Settings("second_largest", "smollm2", "cpu", "float32", 60, 16, 0.1, 128, 256, 0, (1, 2, 3)),
    # The paper's protocol on commonsense_15k (one epoch less the dev examples), scored on all of ARC-Easy and boolq.
    "cuda": Settings("commonsense", "smollm2", "cuda", "bfloat16", 900, 16, 0.1, 200, None, 0, (1, 2, 3)),
}


def dry_run(settings: Settings) -> Settings:
    """The same study on a tiny random model, on the CPU, a few steps and questions per run: the suite's check."""
    return replace(
        settings,
        model="tiny",
        device="cpu",
        dtype="float32",
        steps=2,
        batch=4,
        dev_questions=4,
        test_questions=4,
        test_seeds=(1,),
    )


# ---------------------------------------------------------------------------------------------------------- tasks


def second_largest(rng: random.Random) -> tuple[str, str]:
    numbers = rng.sample(range(10, 100), 4)
    return f"second({','.join(map(str, numbers))})=", str(sorted(numbers)[-2])


def draw_questions(salt: str, count: int) -> list[tuple[str, str]]:
    """`count` distinct questions of the generated task, the same for the same salt on every machine."""
    rng, drawn = random.Random(salt), {}
    while len(drawn) < count:
        prompt, answer = second_largest(rng)
        drawn[prompt] = answer
    return list(drawn.items())


class GeneratedTask:
    """The CPU study's task: fixed dev and test questions; training examples drawn per seed, never one of them."""

    def __init__(self, settings: Settings, tokenizer: PreTrainedTokenizerBase) -> None:
        self.settings, self.tokenizer, self.collate = settings, tokenizer, training_collator(tokenizer)
        self.asked = {"dev": self.questions("dev", settings.dev_questions)}
        self.asked["test"] = self.questions("test", settings.test_questions)
        self.held_out = {prompt for asked in self.asked.values() for prompt, _ in asked}

    def questions(self, split: str, count: int) -> list[tuple[str, str]]:
        return draw_questions(f"study-{split}", count)

    def batches(self, seed: int) -> Iterator[dict]:
        rng = random.Random(f"study-train-{seed}")
        while True:
            examples = []
            while len(examples) < self.settings.batch:
                example = second_largest(rng)
                if example[0] not in self.held_out:
                    examples.append(example)
            yield self._encode(examples)

    def _encode(self, examples: list[tuple[str, str]]) -> dict:
        """Prompt + answer + EOS, right-padded by the project's collator; the loss is on the answer and EOS only."""
        rows = []
        for prompt, answer in examples:
            asked = self.tokenizer.encode(prompt, add_special_tokens=False)
            taught = self.tokenizer.encode(answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            ids, labels = asked + taught, [IGNORE_INDEX] * len(asked) + taught
            rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
        return self.collate(rows)

    @torch.no_grad()
    def score(self, model: torch.nn.Module, split: str) -> tuple[float, list[bool]]:
        """The accuracy of greedy decoding and, per question, whether it answers (the first line of the generation,
        stripped, equals the answer)."""
        tokenizer, asked, correct = self.tokenizer, self.asked[split], []
        for start in range(0, len(asked), 64):
            chunk = asked[start : start + 64]
            prompts = [prompt for prompt, _ in chunk]
            inputs = tokenizer(
                prompts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt"
            )
            inputs = inputs.to(self.settings.device)
            output = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            answers = [text.strip().split("\n")[0].strip() for text in texts]
            correct += [given == expected for given, (_, expected) in zip(answers, chunk, strict=True)]
        return sum(correct) / len(correct), correct


class CommonsenseTask:
    """The scale-up: commonsense_15k under the paper protocol (its prompts, training rows and scoring); the first
    `dev_questions` examples of a fixed shuffle are the dev set, the test sets are ARC-Easy and boolq (their mean)."""

    def __init__(self, settings: Settings, tokenizer: PreTrainedTokenizerBase) -> None:
        self.settings, self.tokenizer, self.protocol = settings, tokenizer, get_protocol("paper")
        examples = load_examples(dataset_file(DATASETS, "commonsense_15k", "train"), "commonsense_15k")
        random.Random("study-dev").shuffle(examples)
        self.dev, train = examples[: settings.dev_questions], examples[settings.dev_questions :]
        self.train = self.protocol.training_dataset(train, tokenizer, max_length=256)

    def batches(self, seed: int) -> Iterator[dict]:
        collate, generator = training_collator(self.tokenizer), torch.Generator().manual_seed(seed)
        while True:
            for indices in torch.randperm(len(self.train), generator=generator).split(self.settings.batch):
                yield collate([self.train[i] for i in indices.tolist()])

    def score(self, model: torch.nn.Module, split: str) -> tuple[float, list[bool]]:
        """The mean of the test sets' accuracies (the paper's average) and, per question, whether it is answered."""
        if split == "dev":
            results = [evaluate_task(model, self.tokenizer, "commonsense_15k", self.dev, 64, 32, "paper")]
        else:
            spec = EvaluationSpec(tasks=["ARC-Easy", "boolq"], size=self.settings.test_questions, batch_size=64)
            results = evaluate_tasks(model, self.tokenizer, DATASETS, spec, "paper")
        return average_accuracy(results), [p.correct for result in results for p in result.predictions]


TASKS = {"second_largest": GeneratedTask, "commonsense": CommonsenseTask}


# -------------------------------------------------------------------------------------------------------- methods


# The learning rates a sweep may try, in half-decade steps; each family starts from four of them.
LADDER = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)


def dense_count(parameters: list[torch.nn.Parameter], size: int) -> int:
    return sum(parameter.numel() for parameter in parameters)


@dataclass(frozen=True)
class Family:
    """A method at its budgets: `sizes` are k for NeuroAda, Super-Tuning (at NeuroAda's density for that k) and the
    mask-based arm, the rank for LoRA and SHiRA. The ranks 1, 3 and 10 are the closest to NeuroAda's k = 2, 5 and 20
    on SmolLM2 (budget.lora_rank_for_k); k=1 has no rank that close. `tuned` counts the entries training changes."""

    build: Callable[[PreTrainedModel, int, int], variants.Setup]
    sizes: tuple[int, ...]
    learning_rates: tuple[float, ...]
    tuned: Callable[[list[torch.nn.Parameter], int], int] = dense_count


FAMILIES = {  # benchmarks/cost/variants.py's set-ups, as train_cost.py measures them
    "neuroada": Family(lambda model, k, seed: variants.neuroada(k)(model), (1, 2, 5, 20), (3e-3, 1e-2, 3e-2, 1e-1)),
    "lora": Family(lambda model, r, seed: variants.lora(r)(model), (1, 3, 10), (1e-3, 3e-3, 1e-2, 3e-2)),
    "shira": Family(lambda model, r, seed: variants.shira(r, seed)(model), (1, 3, 10), (3e-3, 1e-2, 3e-2, 1e-1)),
    "supertuning": Family(
        lambda model, k, seed: variants.supertuning(k)(model), (1, 2, 5, 20), (3e-3, 1e-2, 3e-2, 1e-1)
    ),
    # The paper's Question 1: the same top-k entries as NeuroAda, trained as dense weights with masked gradients
    # (AdamW without weight decay leaves the masked-out entries exactly as they were).
    "mask": Family(
        lambda model, k, seed: variants.mask_based(model, k),
        (20,),
        (3e-3, 1e-2, 3e-2, 1e-1),
        lambda parameters, k: k * sum(parameter.shape[0] for parameter in parameters),
    ),
    "full": Family(lambda model, size, seed: variants.full_finetune(model), (0,), (1e-5, 3e-5, 1e-4, 3e-4)),
}


# ------------------------------------------------------------------------------------------------------------ runs


def load_tokenizer(settings: Settings) -> PreTrainedTokenizerBase:
    """The paper protocol's tokenizer for the commonsense task (pad = unk, right padding, prompts cut at 256 tokens),
    the lenient one (EOS as the pad token) for the generated task."""
    protocol, max_length = ("paper", 256) if settings.task == "commonsense" else ("lenient", None)
    return load_tokenizer_for("default", protocol, max_length)


def load_model(settings: Settings, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    if settings.model == "smollm2":
        model, _ = load_base_model("default", settings.dtype, "paper" if settings.task == "commonsense" else "lenient")
    else:
        model = LlamaForCausalLM(variants.llama_config(len(tokenizer), 64, 128, 2, 4, 2, 128))
    return model.to(settings.device, getattr(torch, settings.dtype))


STEP_TIME = {"cpu": "step_cpu_seconds", "cuda": "step_seconds"}  # a run's record names what its step time is


class PeakMemory:
    """A training run's peak memory growth over the loaded model: CUDA's `max_memory_allocated`, or on the CPU the
    process's peak RSS (weights mapped from their file are made resident before the baseline)."""

    def __init__(self, device: str, model: torch.nn.Module) -> None:
        self.on_cuda = device == "cuda"
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            meters.fault_in(model)
            self.baseline = meters.rss_bytes()
            meters.reset_peak_rss()

    def growth(self) -> int:
        return (torch.cuda.max_memory_allocated() if self.on_cuda else meters.peak_rss_bytes()) - self.baseline


class Study:
    """One results file: the settings its runs share and one record per finished run, rewritten after each run.
    A run already recorded is not run again; a file made with other settings is refused."""

    families: dict[str, Family] = FAMILIES
    isolated = False  # each run in a fresh process (`_train_and_score`), so that its peak memory is its own

    def __init__(self, path: Path, settings: Settings) -> None:
        self.path, self.settings = path, settings
        wanted = json.loads(json.dumps(asdict(settings)))
        saved = json.loads(path.read_text()) if path.exists() else {"settings": wanted, "runs": []}
        if saved["settings"] != wanted:
            raise SystemExit(
                f"{path} holds runs made with other settings ({saved['settings']}, not {wanted}): "
                "give another --results file, or delete this one to start over."
            )
        self.runs: list[dict] = saved["runs"]

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.settings)

    @cached_property
    def task(self) -> GeneratedTask | CommonsenseTask:
        return TASKS[self.settings.task](self.settings, self.tokenizer)

    def run(self, phase: str, family: str, size: int, learning_rate: float, seed: int) -> dict:
        """The recorded run with this key, trained and scored now if it is not recorded yet."""
        key = {"phase": phase, "family": family, "size": size, "learning_rate": learning_rate, "seed": seed}
        if (done := next((run for run in self.runs if key.items() <= run.items()), None)) is not None:
            return done
        run = key | self._train_and_score(family, size, learning_rate, seed, "dev" if phase == "sweep" else "test")
        self.runs.append(run)
        gpu = torch.cuda.get_device_name() if self.settings.device == "cuda" else None
        machine = common.machine(gpu) | {"torch": torch.__version__}
        text = json.dumps({"settings": asdict(self.settings), "machine": machine, "runs": self.runs}, indent=1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, lambda temporary: Path(temporary).write_text(text + "\n"))
        print(
            f"{phase:5} {family:11} size={size:<2} lr={learning_rate:.1e} seed={seed}: {run['accuracy']:6.1%} "
            f"({run['trainable']:,} trainable, {run['train_seconds']:.0f} s)",
            flush=True,
        )
        return run

    def _train_and_score(self, family: str, size: int, learning_rate: float, seed: int, split: str) -> dict:
        """One run, recorded with its loss at every step and the median process CPU time of a step; a study whose
        runs are `isolated` runs each in a fresh process and records its peak memory too."""
        if not self.isolated:
            return self._train_here(family, size, learning_rate, seed, split)
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            where = (type(self), self.arguments(), torch.get_num_threads())
            return pool.submit(train_alone, *where, family, size, learning_rate, seed, split).result()

    def arguments(self) -> tuple:
        """What this study was made with: a fresh process makes it again from them (`train_alone`)."""
        return self.path, self.settings

    def _train_here(self, family: str, size: int, learning_rate: float, seed: int, split: str) -> dict:
        settings = self.settings
        set_seed(seed)
        model, trainable, _ = self.families[family].build(load_model(settings, self.tokenizer), size, seed)
        tuned = self.families[family].tuned(trainable, size)
        optimizer = torch.optim.AdamW(trainable, lr=learning_rate, weight_decay=0.0)
        warmup = max(1, round(settings.warmup * settings.steps))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min((step + 1) / warmup, (settings.steps - step) / max(1, settings.steps - warmup))
        )
        batches = self.task.batches(seed)
        model.train()
        memory = PeakMemory(settings.device, model)
        # A CUDA step is timed by the wall clock (`loss.item()` waits for its kernels); a CPU step by its CPU time.
        clock = time.perf_counter if settings.device == "cuda" else time.process_time
        losses, step_seconds = [], []
        started = time.perf_counter()
        for _ in range(settings.steps):
            step_started = clock()
            loss = model(**{name: tensor.to(settings.device) for name, tensor in next(batches).items()}).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 4))
            step_seconds.append(clock() - step_started)
        seconds = time.perf_counter() - started
        peak_growth = memory.growth()
        model.eval()
        accuracy, correct = self.task.score(model, split)
        record = {
            "trainable": tuned,
            "accuracy": accuracy,
            "questions": len(correct),
            "answered": "".join("1" if answered else "0" for answered in correct),
            "final_loss": losses[-1],
            "train_seconds": round(seconds, 1),
            "losses": losses,
            STEP_TIME[settings.device]: round(statistics.median(step_seconds[1:] or step_seconds), 3),
        }
        # In a process that ran other runs before, the allocator's cached memory would hide part of the growth.
        return record | ({"peak_growth_bytes": peak_growth} if self.isolated else {})

    def sweep_seeds(self) -> tuple[int, ...]:
        """The seeds every rate of a sweep trains with; their mean dev accuracy scores the rate."""
        return (self.settings.sweep_seed,)

    def first_rates(self, family: str, size: int) -> list[float]:
        """The grid a budget's sweep starts from: its family's four half-decade rates."""
        return list(self.families[family].learning_rates)

    def beyond(self, rate: float, step: int) -> float | None:
        """The next rate past a grid's edge, a half-decade step up (step 1) or down (-1); None past the ladder."""
        index = LADDER.index(rate) + step
        return LADDER[index] if 0 <= index < len(LADDER) else None

    def learning_rate(self, family: str, size: int) -> float:
        """This budget's sweep: the rate that scores best on the dev questions (mean over the sweep seeds; the
        smaller rate on a tie), the grid extended a step while the best rate sits on its edge."""
        scores: dict[float, float] = {}
        rates = self.first_rates(family, size)
        while rates:
            for rate in rates:
                runs = [self.run("sweep", family, size, rate, seed) for seed in self.sweep_seeds()]
                scores[rate] = statistics.mean(run["accuracy"] for run in runs)
            best = common.best_learning_rate(scores)
            step = -1 if best == min(scores) else 1 if best == max(scores) else 0
            alone = list(scores.values()).count(scores[best]) == 1  # a tie is no direction to go in
            further = self.beyond(best, step) if step and alone else None
            rates = [further] if further is not None else []
        return best

    def run_all(self, families: list[str], smallest_and_largest: bool = False, only: set[int] | None = None) -> None:
        for family in families:
            sizes = self.families[family].sizes
            sizes = sorted({sizes[0], sizes[-1]}) if smallest_and_largest else sizes
            for size in [size for size in sizes if only is None or size in only]:
                learning_rate = self.learning_rate(family, size)
                for seed in self.settings.test_seeds:
                    self.run("test", family, size, learning_rate, seed)


def train_alone(
    kind: type[Study],
    arguments: tuple,
    threads: int,
    family: str,
    size: int,
    learning_rate: float,
    seed: int,
    split: str,
) -> dict:
    """One run of `kind`'s study in this (fresh) process: what an isolated study's `_train_and_score` runs."""
    torch.set_num_threads(threads)
    return kind(*arguments)._train_here(family, size, learning_rate, seed, split)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=list(STUDIES), default="cpu", help="cuda: the scale-up.")
    parser.add_argument("--results", type=Path, help="The JSON file runs are recorded in (docs/study/ by default).")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--sizes", type=int, nargs="+", help="Only these budgets (k, or a rank) of each family.")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads.")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="A tiny random model on the CPU, each family's smallest and largest budget.",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    settings = dry_run(STUDIES[args.device]) if args.dry_run else STUDIES[args.device]
    results = args.results or RESULTS[args.device]
    Study(results, settings).run_all(
        args.families, smallest_and_largest=args.dry_run, only=set(args.sizes) if args.sizes else None
    )
    print(f"study done in {math.ceil((time.perf_counter() - started) / 60)} min; results in {results}")


if __name__ == "__main__":
    main()
