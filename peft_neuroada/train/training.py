"""Fine-tuning a recipe with transformers' Trainer and PEFT; the adapter and the loss log land in output_dir."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from transformers import PreTrainedTokenizerBase, Trainer, TrainingArguments

from .data import load_split, training_collator
from .models import load_base_model
from .protocols import get_protocol
from .recipes import Recipe


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


def training_arguments(recipe: Recipe) -> TrainingArguments:
    spec = recipe.training
    return TrainingArguments(
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
        seed=spec.seed,
        report_to="none",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def fine_tune(recipe: Recipe) -> TrainingOutcome:
    """Train the recipe's adapter on its data, tokenised as its protocol does, and save it (with the tokenizer) to
    `recipe.adapter_dir`."""
    base, tokenizer = load_base_model(recipe.model, recipe.dtype, recipe.protocol, recipe.data.max_length)
    examples = load_split(recipe.data.dir, recipe.data.train, "train", recipe.data.train_size, recipe.data.seed)
    dataset = get_protocol(recipe.protocol).training_dataset(examples, tokenizer, recipe.data.max_length)
    model = get_peft_model(base, recipe.method.peft_config())
    trainable, _ = model.get_nb_trainable_parameters()
    trainer = Trainer(
        model=model,
        args=training_arguments(recipe),
        train_dataset=dataset,
        data_collator=training_collator(tokenizer),
        processing_class=tokenizer,
    )
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    model.save_pretrained(recipe.adapter_dir)
    tokenizer.save_pretrained(recipe.adapter_dir)
    outcome = TrainingOutcome(
        model,
        tokenizer,
        recipe.adapter_dir,
        trainer.state.log_history,
        len(dataset),
        result.global_step,
        seconds,
        trainable,
    )
    summary = {
        "recipe": recipe.name,
        "method": recipe.method.label,
        "protocol": recipe.protocol,
        "trainable_parameters": trainable,
        "train_examples": outcome.train_examples,
        "steps": outcome.steps,
        "train_seconds": round(seconds, 1),
        "log_history": outcome.log_history,
    }
    (Path(recipe.output_dir) / "train_log.json").write_text(json.dumps(summary, indent=2) + "\n")
    return outcome
