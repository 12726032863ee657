"""Fine-tuning a recipe with transformers' Trainer and PEFT; the adapter and the loss log land in output_dir.

A generation recipe trains a causal LM on its data sets; a GLUE recipe trains a sequence classifier (deltas and the
head) and keeps the epoch that scores best on the in-training part of the validation set, as the official code
does (train_our.py L584-L587: evaluation and a checkpoint per epoch, the best one loaded at the end).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model
from transformers import (
    DataCollatorWithPadding,
    EvalPrediction,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerState,
    TrainingArguments,
    set_seed,
)

from .data import load_split, training_collator
from .glue import GlueTask, encode, load_glue, score, split_validation
from .models import load_base_model
from .protocols import get_protocol
from .recipes import Recipe

HEAD_NAMES = ("classifier", "score")
"""Where transformers' sequence classifiers keep their head (BERT/RoBERTa: classifier; decoder models: score)."""


@dataclass
class TrainingOutcome:
    model: PeftModel
    tokenizer: PreTrainedTokenizerBase
    adapter_dir: Path
    log_history: list[dict]
    train_examples: int
    steps: int
    seconds: float
    trainable_parameters: int

    @property
    def losses(self) -> list[tuple[int, float]]:
        """(step, training loss) pairs, for loss curves."""
        return [(entry["step"], entry["loss"]) for entry in self.log_history if "loss" in entry]


def use_bf16(setting: str | bool) -> bool:
    """`auto` means bf16 mixed precision exactly when a CUDA GPU supports it (CPU bf16 autocast is slower)."""
    if setting == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(setting)


def training_autocast(recipe: Recipe, model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The bf16 autocast the recipe trains under (`training.bf16`), to score under as well: the official code scores
    the very model accelerate wrapped for training, whose forward keeps that autocast (on CUDA it runs layer norms in
    float32, so a bf16 RoBERTa scores differently without it)."""
    if not use_bf16(recipe.training.bf16):
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16)


def training_arguments(recipe: Recipe, **overrides: object) -> TrainingArguments:
    spec = recipe.training
    arguments = dict(
        output_dir=str(Path(recipe.output_dir) / "checkpoints"),
        per_device_train_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.gradient_accumulation_steps,
        learning_rate=spec.learning_rate,
        warmup_steps=int(spec.warmup) if spec.warmup >= 1 else spec.warmup,
        num_train_epochs=spec.epochs,
        max_steps=spec.max_steps,
        weight_decay=spec.weight_decay,
        lr_scheduler_type=spec.lr_scheduler,
        optim="adamw_torch",
        logging_steps=spec.logging_steps,
        save_strategy="steps",
        save_steps=spec.save_steps,
        save_total_limit=2,
        bf16=use_bf16(spec.bf16),
        seed=recipe.seed,
        report_to="none",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    return TrainingArguments(**(arguments | overrides))


def make_trainer(recipe: Recipe, model: PeftModel, **kwargs: object) -> Trainer:
    """transformers' Trainer for `recipe`, averaging the loss as `training.loss_average` says.

    Told that the model takes no loss arguments, the Trainer lets the model average each micro-batch's loss and
    divides it by the accumulation steps itself. A sequence classifier must always run that way: it accepts
    `num_items_in_batch` but ignores it, and the Trainer would then skip the division (twice the gradient at 2
    accumulation steps)."""
    trainer = Trainer(model=model, **kwargs)
    if recipe.task == "glue" or recipe.training.loss_average == "micro_batch":
        trainer.model_accepts_loss_kwargs = False
    return trainer


def train_and_save(
    trainer: Trainer, model: PeftModel, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, train_examples: int
) -> TrainingOutcome:
    """Run `trainer`, timed, then save the adapter it leaves in `model` (the best epoch's when the trainer keeps the
    best) and the tokenizer to `recipe.adapter_dir`."""
    trainable, _ = model.get_nb_trainable_parameters()
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    model.save_pretrained(recipe.adapter_dir)
    tokenizer.save_pretrained(recipe.adapter_dir)
    return TrainingOutcome(
        model, tokenizer, recipe.adapter_dir, trainer.state.log_history, train_examples, result.global_step, seconds,
        trainable,
    )  # fmt: skip


def write_train_log(recipe: Recipe, outcome: TrainingOutcome, details: dict) -> None:
    """`train_log.json` in the recipe's output folder: which run it was, `details` of its kind, and how it went."""
    summary = {
        "recipe": recipe.name,
        "method": recipe.method.label,
        "protocol": recipe.protocol,
        "seed": recipe.seed,
        **details,
        "train_examples": outcome.train_examples,
        "steps": outcome.steps,
        "train_seconds": round(outcome.seconds, 1),
        "log_history": outcome.log_history,
    }
    (Path(recipe.output_dir) / "train_log.json").write_text(json.dumps(summary, indent=2) + "\n")


def fine_tune(recipe: Recipe) -> TrainingOutcome:
    """Train the recipe's adapter on its data, tokenised as its protocol does, and save it (with the tokenizer) to
    `recipe.adapter_dir`. Seeded first, as the official run (`set_seed(seed)` before its data and model, train_our.py
    L506): a pad row the tokenizer adds to the embeddings (Llama-3) is drawn from that state."""
    set_seed(recipe.seed)
    base, tokenizer = load_base_model(recipe.model, recipe.dtype, recipe.protocol, recipe.data.max_length)
    examples = load_split(recipe.data.dir, recipe.data.train, "train", recipe.data.train_size, recipe.data.seed)
    dataset = get_protocol(recipe.protocol).training_dataset(examples, tokenizer, recipe.data.max_length)
    model = get_peft_model(base, recipe.method.peft_config())
    trainer = make_trainer(
        recipe,
        model,
        args=training_arguments(recipe),
        train_dataset=dataset,
        data_collator=training_collator(tokenizer),
        processing_class=tokenizer,
    )
    outcome = train_and_save(trainer, model, tokenizer, recipe, len(dataset))
    write_train_log(recipe, outcome, {"trainable_parameters": outcome.trainable_parameters})
    return outcome


@dataclass
class GlueData:
    """A GLUE recipe's task, its training and validation sets, and the validation split: `in_training` chooses the
    best epoch, `held_out` is reported."""

    task: GlueTask
    train: Dataset
    validation: Dataset
    in_training: list[int]
    held_out: list[int]


def glue_data(recipe: Recipe) -> GlueData:
    """The recipe's GLUE data, drawn as the official run draws it: `set_seed(seed)` (train_our.py L506), the data,
    then the split from torch's global generator (L343), so a seed gives the official split. A model loaded next
    draws its new head from that generator, as the official build_model does (with this transformers' initialisation,
    so not the official head's values)."""
    task = recipe.glue
    set_seed(recipe.seed)
    train, validation = load_glue(task, recipe.data.dir)
    if recipe.data.train_size is not None and recipe.data.train_size < len(train):
        train = train.shuffle(seed=recipe.data.seed).select(range(recipe.data.train_size))
    in_training, held_out = split_validation(len(validation), torch.default_generator)
    return GlueData(task, train, validation, in_training, held_out)


def head_names(model: PreTrainedModel) -> list[str]:
    """The classification head of a sequence classifier, which trains fully beside the adapter."""
    names = [name for name in HEAD_NAMES if isinstance(getattr(model, name, None), torch.nn.Module)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no classification head named {' or '.join(HEAD_NAMES)}.")
    return names


@dataclass
class GlueTraining:
    """A GLUE run's training: the best epoch on the in-training examples and the score of every epoch there; the
    trainable parameters without the head as a share of the model without its head (the paper's "Params (%)")."""

    outcome: TrainingOutcome
    data: GlueData
    best_epoch: float
    epoch_scores: list[tuple[float, float]]
    head_parameters: int
    share_without_head: float

    @property
    def best_score(self) -> float:
        return dict(self.epoch_scores)[self.best_epoch]

    def summary(self) -> dict:
        return {
            "best_epoch": self.best_epoch,
            "in_training_score": self.best_score,
            "epochs": [{"epoch": epoch, "score": value} for epoch, value in self.epoch_scores],
            "trainable_parameters": self.outcome.trainable_parameters,
            "head_parameters": self.head_parameters,
            "share_without_head_percent": 100 * self.share_without_head,
        }


def best_epoch(state: TrainerState, metric: str) -> tuple[float, list[tuple[float, float]]]:
    """The epoch whose checkpoint the Trainer kept as best, and (epoch, in-training score) for every evaluation."""
    key = f"eval_{metric}"
    evaluations = [entry for entry in state.log_history if key in entry]
    if state.best_model_checkpoint is None or not evaluations:
        raise RuntimeError("No epoch was evaluated, so there is no best epoch; train for at least one step.")
    best_step = int(Path(state.best_model_checkpoint).name.rpartition("-")[2])
    epochs = [int(entry["epoch"]) if float(entry["epoch"]).is_integer() else entry["epoch"] for entry in evaluations]
    best = next(epoch for epoch, entry in zip(epochs, evaluations, strict=True) if entry["step"] == best_step)
    return best, [(epoch, entry[key]) for epoch, entry in zip(epochs, evaluations, strict=True)]


def fine_tune_glue(recipe: Recipe) -> GlueTraining:
    """Train the deltas and the head of a GLUE recipe, evaluating on the in-training validation examples after
    every epoch, keep the best epoch's adapter (official train_our.py L584-L587, L627) and save it, with its head and
    tokenizer, to `recipe.adapter_dir`."""
    data = glue_data(recipe)
    task, max_length = data.task, recipe.data.max_length
    base, tokenizer = load_base_model(recipe.model, recipe.dtype, recipe.protocol, max_length, task.num_labels)
    heads = head_names(base)
    head_size = sum(p.numel() for name in heads for p in getattr(base, name).parameters())
    body_size = sum(p.numel() for p in base.parameters()) - head_size
    model = get_peft_model(base, recipe.method.peft_config("SEQ_CLS", heads))

    def metrics(prediction: EvalPrediction) -> dict[str, float]:
        logits = prediction.predictions
        logits = logits[0] if isinstance(logits, tuple) else logits
        return {task.metric: score(task, torch.as_tensor(logits), prediction.label_ids.tolist())}

    trainer = make_trainer(
        recipe,
        model,
        args=training_arguments(
            recipe,
            eval_strategy="epoch",
            save_strategy="epoch",
            save_total_limit=1,
            load_best_model_at_end=True,
            metric_for_best_model=task.metric,
            greater_is_better=True,
            per_device_eval_batch_size=recipe.evaluation.batch_size,
        ),
        train_dataset=Dataset.from_list(encode(task, data.train, tokenizer, max_length)),
        eval_dataset=Dataset.from_list(encode(task, data.validation.select(data.in_training), tokenizer, max_length)),
        data_collator=DataCollatorWithPadding(tokenizer, padding="longest"),
        processing_class=tokenizer,
        compute_metrics=metrics,
    )
    outcome = train_and_save(trainer, model, tokenizer, recipe, len(data.train))
    epoch, epoch_scores = best_epoch(trainer.state, task.metric)
    body_share = (outcome.trainable_parameters - head_size) / body_size
    training = GlueTraining(outcome, data, epoch, epoch_scores, head_size, body_share)
    write_train_log(recipe, outcome, {"task": task.name, "metric": task.metric, **training.summary()})
    return training
