"""Loading base models (a path, a hub id, or `default` = the embedded SmolLM2-135M-Instruct) and trained adapters."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

import peft_neuroada  # noqa: F401  (registers the NEUROADA peft type, so saved NeuroAda adapters load)

from .default_model import default_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model(model: str) -> str:
    return str(default_model_path()) if model == "default" else model


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer, given a pad token (its EOS) if it has none, as batching needs one."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(model: str, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r}).")
    path = resolve_model(model)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    tokenizer = load_tokenizer(model)
    loaded.generation_config.pad_token_id = tokenizer.pad_token_id
    return loaded, tokenizer


def load_adapted_model(
    model: str, adapter_dir: str | Path, dtype: str = "float32"
) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    """The base model with a saved adapter (NeuroAda or LoRA) loaded on top, for inference."""
    base, tokenizer = load_base_model(model, dtype)
    return PeftModel.from_pretrained(base, str(adapter_dir)), tokenizer
