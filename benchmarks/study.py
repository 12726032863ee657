"""Accuracy for trainable parameters: SmolLM2-135M fine-tuned by NeuroAda, LoRA, SHiRA, Super-Tuning and full
fine-tuning, at several budgets and seeds (the paper's Figure 1 shape).

    python benchmarks/study.py                 # the CPU study, resumable, into docs/study/results.json
    python benchmarks/study.py --device cuda   # the scale-up, into docs/study/results-cuda.json
    python benchmarks/study_figures.py         # the figures and the table, from the committed results
    python benchmarks/study.py --dry-run --results /tmp/study.json   # a tiny random model: the suite's check

The CPU study's task: the second largest of four two-digit numbers (`second(12,85,47,60)=` answered `60`), 60 steps
of 16 examples. Untrained, SmolLM2 answers none of it in this format; NeuroAda k=1 reached 54% in 40 steps of a trial
run, so budgets have room to differ. Training draws its examples per seed and never a dev or test question. The
scale-up trains on commonsense_15k under the paper protocol and scores ARC-Easy and boolq (`STUDIES["cuda"]`).

1. Sweep: per method family, at its middle budget and seed 0, each learning rate of its grid is scored on the dev
   questions; the best becomes the family's learning rate at every budget.
2. Test: every budget of every family, for each seed, at the family's rate, scored on the test questions.

Every finished run is a record in the results file; a run already recorded is skipped, so an interrupted study
resumes. A file made with other settings is refused, not mixed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

import common  # noqa: F401  (this checkout's peft_neuroada first)
import torch
from cost import variants
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
    seeds: tuple[int, ...]


STUDIES = {
    "cpu": Settings("second_largest", "smollm2", "cpu", "float32", 60, 16, 0.1, 128, 256, (0, 1)),
    # The paper's protocol on commonsense_15k (one epoch less the dev examples), scored on all of ARC-Easy and boolq.
    "cuda": Settings("commonsense", "smollm2", "cuda", "bfloat16", 900, 16, 0.1, 200, None, (0, 1)),
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
        seeds=(0,),
    )


# ---------------------------------------------------------------------------------------------------------- tasks


def second_largest(rng: random.Random) -> tuple[str, str]:
    numbers = rng.sample(range(10, 100), 4)
    return f"second({','.join(map(str, numbers))})=", str(sorted(numbers)[-2])


class GeneratedTask:
    """The CPU study's task: fixed dev and test questions; training examples drawn per seed, never one of them."""

    def __init__(self, settings: Settings, tokenizer: PreTrainedTokenizerBase) -> None:
        self.settings, self.tokenizer, self.collate = settings, tokenizer, training_collator(tokenizer)
        self.asked = {"dev": self._questions("dev", settings.dev_questions)}
        self.asked["test"] = self._questions("test", settings.test_questions)
        self.held_out = {prompt for asked in self.asked.values() for prompt, _ in asked}

    @staticmethod
    def _questions(split: str, count: int) -> list[tuple[str, str]]:
        rng, drawn = random.Random(f"study-{split}"), {}
        while len(drawn) < count:
            prompt, answer = second_largest(rng)
            drawn[prompt] = answer
        return list(drawn.items())

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
    def score(self, model: torch.nn.Module, split: str) -> tuple[float, int]:
        """Accuracy of greedy decoding (the first line of the generation, stripped, equals the answer), questions."""
        tokenizer, asked, correct = self.tokenizer, self.asked[split], 0
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
            correct += sum(given == expected for given, (_, expected) in zip(answers, chunk, strict=True))
        return correct / len(asked), len(asked)


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

    def score(self, model: torch.nn.Module, split: str) -> tuple[float, int]:
        if split == "dev":
            results = [evaluate_task(model, self.tokenizer, "commonsense_15k", self.dev, 64, 32, "paper")]
        else:
            spec = EvaluationSpec(tasks=["ARC-Easy", "boolq"], size=self.settings.test_questions, batch_size=64)
            results = evaluate_tasks(model, self.tokenizer, DATASETS, spec, "paper")
        return average_accuracy(results), sum(result.total for result in results)


TASKS = {"second_largest": GeneratedTask, "commonsense": CommonsenseTask}


# -------------------------------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Family:
    """A method at its budgets: `sizes` are k for NeuroAda and Super-Tuning (at NeuroAda's density for that k), the
    rank for LoRA and SHiRA. SHiRA's ranks 1, 3 and 10 are the closest to NeuroAda's k = 1 and 2, 5 and 20 on
    SmolLM2 (budget.lora_rank_for_k)."""

    build: Callable[[PreTrainedModel, int, int], variants.Setup]
    sizes: tuple[int, ...]
    sweep_size: int
    learning_rates: tuple[float, ...]


FAMILIES = {  # benchmarks/cost/variants.py's set-ups, as train_cost.py measures them
    "neuroada": Family(lambda model, k, seed: variants.neuroada(k)(model), (1, 2, 5, 20), 5, (3e-3, 1e-2, 3e-2, 1e-1)),
    "lora": Family(lambda model, r, seed: variants.lora(r)(model), (1, 2, 4, 8, 16), 4, (1e-3, 3e-3, 1e-2, 3e-2)),
    "shira": Family(lambda model, r, seed: variants.shira(r, seed)(model), (1, 3, 10), 3, (3e-3, 1e-2, 3e-2, 1e-1)),
    "supertuning": Family(
        lambda model, k, seed: variants.supertuning(k)(model), (1, 2, 5, 20), 5, (3e-3, 1e-2, 3e-2, 1e-1)
    ),
    "full": Family(lambda model, size, seed: variants.full_finetune(model), (0,), 0, (1e-5, 3e-5, 1e-4, 3e-4)),
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
    return model.to(settings.device)


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


class Study:
    """One results file: the settings its runs share and one record per finished run, rewritten after each run.
    A run already recorded is not run again; a file made with other settings is refused."""

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
        machine = {"cpu": cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__}
        if self.settings.device == "cuda":
            machine["gpu"] = torch.cuda.get_device_name()
        text = json.dumps({"settings": asdict(self.settings), "machine": machine, "runs": self.runs}, indent=1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, lambda temporary: Path(temporary).write_text(text + "\n"))
        print(
            f"{phase:5} {family:11} size={size:<2} lr={learning_rate:.0e} seed={seed}: {run['accuracy']:6.1%} "
            f"({run['trainable']:,} trainable, {run['train_seconds']:.0f} s)",
            flush=True,
        )
        return run

    def _train_and_score(self, family: str, size: int, learning_rate: float, seed: int, split: str) -> dict:
        settings = self.settings
        set_seed(seed)
        model, trainable, _ = FAMILIES[family].build(load_model(settings, self.tokenizer), size, seed)
        optimizer = torch.optim.AdamW(trainable, lr=learning_rate, weight_decay=0.0)
        warmup = max(1, round(settings.warmup * settings.steps))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min((step + 1) / warmup, (settings.steps - step) / max(1, settings.steps - warmup))
        )
        batches = self.task.batches(seed)
        model.train()
        started = time.perf_counter()
        for _ in range(settings.steps):
            loss = model(**{name: tensor.to(settings.device) for name, tensor in next(batches).items()}).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        model.eval()
        accuracy, asked = self.task.score(model, split)
        return {
            "trainable": sum(p.numel() for p in trainable),
            "accuracy": accuracy,
            "questions": asked,
            "final_loss": loss.item(),
            "train_seconds": round(seconds, 1),
        }

    def learning_rate(self, family: str) -> float:
        """The family's sweep: the rate that scores best on the dev questions (the smaller one on a tie)."""
        spec = FAMILIES[family]
        scores = {lr: self.run("sweep", family, spec.sweep_size, lr, 0)["accuracy"] for lr in spec.learning_rates}
        return max(sorted(scores), key=lambda lr: scores[lr])

    def run_all(self, families: list[str], sizes_per_family: int | None = None) -> None:
        for family in families:
            learning_rate = self.learning_rate(family)
            for size in FAMILIES[family].sizes[:sizes_per_family]:
                for seed in self.settings.seeds:
                    self.run("test", family, size, learning_rate, seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=list(STUDIES), default="cpu", help="cuda: the scale-up.")
    parser.add_argument("--results", type=Path, help="The JSON file runs are recorded in (docs/study/ by default).")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads.")
    parser.add_argument("--dry-run", action="store_true", help="A tiny random model on the CPU, 2 budgets a family.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    settings = dry_run(STUDIES[args.device]) if args.dry_run else STUDIES[args.device]
    results = args.results or RESULTS[args.device]
    Study(results, settings).run_all(args.families, 2 if args.dry_run else None)
    print(f"study done in {math.ceil((time.perf_counter() - started) / 60)} min; results in {results}")


if __name__ == "__main__":
    main()
