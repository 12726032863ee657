"""Fine-tune a causal language model with NeuroAda: k trainable weights per neuron on its largest-magnitude inputs."""

import argparse

import torch
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

from peft import NeuroAdaConfig, get_peft_model


# The official code's rates for its math runs (LLaMA-7B): far above LoRA's, since each neuron trains only k weights.
PAPER_LEARNING_RATES = {1: 9e-3, 20: 3e-3}


def main(args: argparse.Namespace) -> None:
    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.base_model, dtype=dtype)

    config = NeuroAdaConfig(
        k=args.k,
        target_modules=args.target_modules.split(",") if args.target_modules else None,  # None: the paper's set
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    model.print_trainable_parameters()

    dataset = load_dataset(args.data_path, split="train")

    def tokenize(batch):
        return tokenizer(batch[args.text_field], truncation=True, max_length=args.cutoff_len)

    dataset = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)
    learning_rate = args.learning_rate or PAPER_LEARNING_RATES.get(args.k, 3e-3)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.num_epochs,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=learning_rate,
        weight_decay=0.0,
        bf16=args.bf16,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train()
    model.save_pretrained(args.output_dir)  # k values and k column indices per neuron
    tokenizer.save_pretrained(args.output_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base_model", default="meta-llama/Llama-3.2-1B")
    parser.add_argument("--data_path", default="timdettmers/openassistant-guanaco")
    parser.add_argument("--text_field", default="text", help="The dataset column holding the training text.")
    parser.add_argument("--output_dir", default="neuroada-llama-3.2-1b")
    parser.add_argument("--k", type=int, default=20, help="Trainable weights per neuron (the paper: 1 or 20).")
    parser.add_argument("--target_modules", default=None, help="Comma-separated names; default: the paper's set.")
    parser.add_argument("--learning_rate", type=float, default=None, help="Default: the paper's rate for this k.")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=8)
    parser.add_argument("--num_epochs", type=int, default=1)
    parser.add_argument("--cutoff_len", type=int, default=512)
    parser.add_argument("--bf16", action="store_true", help="Load the base model and train in bfloat16.")
    main(parser.parse_args())
