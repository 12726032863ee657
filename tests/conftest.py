"""Shared models: tiny random ones for fast checks, and the two real pretrained models shipped by packages."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from peft_neuroada import NeuroAdaLayer  # importing the package registers the NEUROADA peft type
from peft_neuroada.train.default_model import default_model_path, encoder_model_path
from peft_neuroada.train.models import load_default_model

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The suite runs in two pytest-xdist workers on the two cores: one torch thread each, in the processes specs start
    # too, so that the workers do not take each other's cores.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


# What the suite ran with, in its header (and so in every CI log): a fresh install resolves the newest releases, and an
# older package left on a machine can hide a failure.
REPORTED_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "trl",
    "bitsandbytes",
    "torchao",
    "lm-eval",
    "triton",
)


def pytest_report_header() -> str:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    return "packages: " + ", ".join(f"{name} {version(name)}" for name in REPORTED_PACKAGES)


@pytest.fixture(scope="session")
def upstream_patch():
    """benchmarks/upstream_patch.py, the script that builds the peft patch and writes its counts in the docs."""
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        return importlib.import_module("upstream_patch")
    finally:
        sys.path.remove(benchmarks)


@pytest.fixture(scope="session")
def peft_release(upstream_patch) -> Path:
    """The source release of the peft the patches target (`TARGET_PEFT`, whatever peft is installed; its tests ship
    there, not in the wheel), the tree the patches apply to."""
    try:
        return upstream_patch.default_release()
    except FileNotFoundError as error:
        pytest.skip(f"no source release of peft {upstream_patch.TARGET_PEFT}: {error}")


def train_on_batch(model: torch.nn.Module, tokens: torch.Tensor, steps: int, lr: float) -> list[float]:
    """`steps` Adam steps of language modelling on one token batch; returns the loss before each step."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def save_tiny_llama(path: Path, tokenizer, max_position_embeddings: int = 512) -> Path:
    """A random 2-layer Llama sized for `tokenizer`, saved with it to `path` like any local model."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_llama(**overrides) -> LlamaForCausalLM:
    """A random 2-layer Llama (seed 0) in eval mode; `overrides` change its config (e.g. tie_word_embeddings)."""
    torch.manual_seed(0)
    defaults = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return LlamaForCausalLM(LlamaConfig(**(defaults | overrides))).eval()


# Tiny MoE configs in transformers 5's layouts: experts as 3-D parameters, (E, d_out, d_in) or, for GPT-OSS,
# (E, d_in, d_out) (`is_transposed`).
TINY_MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=8),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8),
}


def tiny_causal_lm(model_type: str, **options):
    """A random 2-layer model of any transformers architecture (MoE ones with 4 experts, 2 per token), vocab 100."""
    torch.manual_seed(0)
    sizes = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config = AutoConfig.for_model(model_type, vocab_size=100, pad_token_id=0, **sizes, **TINY_MOE.get(model_type, {}))
    return AutoModelForCausalLM.from_config(config, **options).eval()


# tiny_llama's modules with one decoder block on disk, as `from_pretrained(..., device_map=..., offload_folder=...)`
# lays them out.
TINY_LLAMA_DISK_MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


def tiny_bert() -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
    )
    return BertModel(config).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()


def minilm_path() -> Path:
    try:
        return encoder_model_path()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))


def real_minilm() -> BertModel:
    """Real all-MiniLM-L6-v2 BERT encoder (6 layers, hidden size 384), in eval mode."""
    return AutoModel.from_pretrained(minilm_path()).eval()


def real_minilm_classifier(head_seed: int = 0):
    """Real all-MiniLM-L6-v2 encoder with a fresh 2-way classification head drawn with `head_seed`."""
    torch.manual_seed(head_seed)
    return AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2).eval()


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def hidden(model, tokens: torch.Tensor) -> torch.Tensor:
    """Last hidden state (or logits): what every architecture's forward returns first."""
    with torch.no_grad():
        return model(tokens)[0]


def named_neuroada_layers(model) -> dict[str, NeuroAdaLayer]:
    """Every NeuroAda layer of the model, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, NeuroAdaLayer)}


def neuroada_layers(model) -> list[NeuroAdaLayer]:
    return list(named_neuroada_layers(model).values())


def indices_by_layer(model) -> dict[str, torch.Tensor]:
    """Each NeuroAda layer's selected input indices of the default adapter, by module name."""
    return {name: layer.placement("default").cols.clone() for name, layer in named_neuroada_layers(model).items()}


# A tiny random model and a real pretrained one, for behaviour that must hold on both.
TINY_AND_REAL = pytest.mark.parametrize("make_model", [tiny_llama, real_minilm], ids=["tiny-llama", "real-minilm"])


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return default_model_path()


@pytest.fixture
def smollm2():
    """Real SmolLM2-135M-Instruct (Llama architecture), float32, in eval mode."""
    model, _ = load_default_model()
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture
def minilm_classifier():
    """Real all-MiniLM-L6-v2 BERT encoder with a fresh 2-way classification head."""
    return real_minilm_classifier()


@pytest.fixture(scope="session")
def minilm_tokenizer():
    return AutoTokenizer.from_pretrained(minilm_path())


@pytest.fixture
def token_batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 128, (2, 12))
