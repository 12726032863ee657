"""A base model loaded in bfloat16 trains with NeuroAda: float32 deltas, finite decreasing loss, frozen weights intact.

Both forward paths matter here: the merged copy adds the float32 deltas into a bf16 copy of the weight (rounded to
bf16, as a merge and the official code round them); the bypass adds the sparse products, accumulated in float32, into
the bf16 base output.
"""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_neuroada import Linear, NeuroAdaConfig
from peft_neuroada.train.models import load_default_model
from tests.conftest import tiny_llama, train_on_batch


def deltas(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "neuroada_delta" in n]


def test_bf16_tiny_llama_trains_float32_deltas(token_batch):
    model = get_peft_model(tiny_llama().to(torch.bfloat16), NeuroAdaConfig(k=2))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    losses = train_on_batch(model, token_batch, steps=5, lr=1e-2)

    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 and p.abs().sum() > 0 for p in deltas(model))
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(p.dtype == torch.bfloat16 for p in frozen.values())


def test_bf16_smollm2_trains_on_a_short_sequence(smollm2_tokenizer):
    base, _ = load_default_model(dtype=torch.bfloat16)
    model = get_peft_model(base, NeuroAdaConfig(k=1))
    watched = [
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
        "base_model.model.model.layers.29.mlp.down_proj.base_layer.weight",
    ]
    before = {name: model.get_parameter(name).detach().clone() for name in watched}
    tokens = smollm2_tokenizer("The capital of France is Paris. The capital of Italy is Rome.", return_tensors="pt")

    # Two updates: the first alone moves the loss by no more than how the CPU's bf16 matmul rounds does (1.700 ->
    # 1.687 on an AVX2 EPYC; 1.711 -> 1.719 with every matmul output rounded exactly from its true sum), the second
    # takes it 0.15 lower on either (1.552, 1.541). `losses` holds the loss before each step: the last follows two.
    losses = train_on_batch(model, tokens.input_ids, steps=3, lr=1e-3)

    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in deltas(model))
    assert all(torch.equal(model.get_parameter(name), before[name]) for name in watched)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, id="float32"),
        pytest.param(torch.bfloat16, id="bfloat16"),
        pytest.param(torch.float16, id="float16"),
    ],
)
def test_the_copy_path_allocates_at_most_one_copy_of_the_frozen_weight_at_a_time(dtype):
    """The merged copy is transient: made in forward, freed after its matmul, made again in backward."""
    base = nn.Linear(576, 1536, bias=False).to(dtype).requires_grad_(False)
    layer = Linear(base, "default", NeuroAdaConfig(k=1, init_weights=False))
    x = torch.randn(1, 7, 576, dtype=dtype, requires_grad=True)
    with torch.profiler.profile(profile_memory=True) as profile:
        layer(x).float().sum().backward()
    largest_allocation = max(event.self_cpu_memory_usage for event in profile.events())
    assert largest_allocation <= base.weight.numel() * base.weight.element_size()
