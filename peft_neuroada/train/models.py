"""Loading base models (a path, a hub id, or `default` = the embedded SmolLM2-135M-Instruct) and trained adapters."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

import peft_neuroada  # noqa: F401  (registers the NEUROADA peft type, so saved NeuroAda adapters load)

from .default_model import default_model_path
from .protocols import get_protocol

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model(model: str) -> str:
    return str(default_model_path()) if model == "default" else model


def load_tokenizer(model: str, protocol: str = "lenient", max_length: int | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer as `protocol` sets it up (pad token, padding side, the prompt length limit)."""
    return get_protocol(protocol).load_tokenizer(resolve_model(model), max_length)


def load_base_model(
    model: str, dtype: str = "float32", protocol: str = "lenient", max_length: int | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and its tokenizer; embeddings grow to a tokenizer that gained a pad token (official
    train_our.py L397-L398, for Llama-3), so its id is valid."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r}).")
    path = resolve_model(model)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    tokenizer = load_tokenizer(model, protocol, max_length)
    if len(tokenizer) > loaded.get_input_embeddings().num_embeddings:
        loaded.resize_token_embeddings(len(tokenizer))
    loaded.generation_config.pad_token_id = tokenizer.pad_token_id
    return loaded, tokenizer


def load_adapted_model(
    model: str,
    adapter_dir: str | Path,
    dtype: str = "float32",
    protocol: str = "lenient",
    max_length: int | None = None,
) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    """The base model with a saved adapter (NeuroAda or LoRA) loaded on top, for inference."""
    base, tokenizer = load_base_model(model, dtype, protocol, max_length)
    return PeftModel.from_pretrained(base, str(adapter_dir)), tokenizer
