"""Loading base models (a path, a hub id, or `default` = the embedded SmolLM2-135M-Instruct) and trained adapters.

Every model the `neuroada` command, the tests and the benchmarks use comes through `load_base_model`, so each gets
its tokenizer set up by a protocol and embeddings that fit that tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

import peft_neuroada  # noqa: F401  (registers the NEUROADA peft type, so saved NeuroAda adapters load)
from peft_neuroada.tuner.config import DTYPES

from .default_model import default_model_path


def resolve_model(model: str) -> str:
    return str(default_model_path()) if model == "default" else model


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype given by name (as recipes and command lines give it) or as itself."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r}).")
    return DTYPES[dtype]


def load_tokenizer(model: str, protocol: str = "lenient", max_length: int | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer as `protocol` sets it up (pad token, padding side, the prompt length limit)."""
    from .protocols import get_protocol  # here: protocols need `datasets`, which loading a model does not

    return get_protocol(protocol).load_tokenizer(resolve_model(model), max_length)


def load_base_model(
    model: str,
    dtype: str | torch.dtype = "float32",
    protocol: str = "lenient",
    max_length: int | None = None,
    num_labels: int | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and its tokenizer: a causal LM, or with `num_labels` a sequence classifier with a new head (drawn
    from torch's global generator; 1 label = regression). Embeddings grow to a tokenizer that gained a pad token
    (official train_our.py L397-L398, for Llama-3), so its id is valid; the new rows are initialised as the model
    initialises weights, as the official runs' transformers 4.45 did (not from the other rows' mean)."""
    path = resolve_model(model)
    if num_labels is None:
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    else:
        loaded = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=num_labels, dtype=torch_dtype(dtype)
        )
    tokenizer = load_tokenizer(model, protocol, max_length)
    if len(tokenizer) > loaded.get_input_embeddings().num_embeddings:
        loaded.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    if loaded.can_generate():
        loaded.generation_config.pad_token_id = tokenizer.pad_token_id
    return loaded, tokenizer


def load_default_model(
    dtype: str | torch.dtype = "float32", protocol: str = "lenient"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct and its tokenizer, ready for `get_peft_model`."""
    return load_base_model("default", dtype, protocol)


def load_adapted_model(
    model: str,
    adapter_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    protocol: str = "lenient",
    max_length: int | None = None,
    num_labels: int | None = None,
) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    """The base model with a saved adapter (NeuroAda or LoRA, with a classification head if it saved one) loaded on
    top, for inference."""
    base, tokenizer = load_base_model(model, dtype, protocol, max_length, num_labels)
    return PeftModel.from_pretrained(base, str(adapter_dir)), tokenizer
