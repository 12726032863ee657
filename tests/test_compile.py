"""`torch.compile` of a NeuroAda model trains exactly like eager mode on CPU.

The compiled graph traces the tuner's own forward (the merged copy, or the sparse bypass), which never writes into
the frozen weights. The Llama test uses backend="aot_eager" (dynamo + AOTAutograd, no code
generation; ~15 s here): inductor needs over a minute to compile even the tiny Llama on two shared cores. The real
MiniLM test compiles each encoder layer on its own (~10 s; the whole model takes over a minute). Inductor itself is
checked on a single residual block, in a child process, because the failure it guards against crashes the
interpreter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.tuner import config as tuner_config
from peft_neuroada.tuner import experts as tuner_experts
from peft_neuroada.tuner import model as tuner_model
from tests.conftest import tiny_causal_lm, tiny_llama

REPO = Path(__file__).resolve().parents[1]
INDUCTOR_TIMEOUT_S = 180


def loss_and_delta_grads(model, forward, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = forward(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "k",
    [
        2,
        20,
    ],
)
def test_compiled_training_step_matches_eager_without_graph_breaks(k, token_batch):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=k, init_weights=False))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    eager_loss, eager_grads = loss_and_delta_grads(model, model, token_batch)

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break is an error
    compiled_loss, compiled_grads = loss_and_delta_grads(model, compiled, token_batch)

    torch.testing.assert_close(compiled_loss, eager_loss)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, msg=name)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_a_compiled_model_serves_each_rows_adapter_and_forgets_the_names_after_the_call():
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    model.add_adapter("other", NeuroAdaConfig(k=1, init_weights=False))
    model.eval()
    tokens = torch.randint(0, 128, (3, 8))
    with torch.no_grad():
        alone = {name: model(tokens).logits for name in ["default"]}
        model.set_adapter("other")
        alone["other"] = model(tokens).logits
        model.set_adapter("default")
        with model.disable_adapter():
            alone["__base__"] = model(tokens).logits
        compiled = torch.compile(model, backend="aot_eager")
        for names in (["other", "__base__", "default"], None, ["__base__", "other", "other"], None):
            out = compiled(tokens, adapter_names=names).logits if names else compiled(tokens).logits
            expected = torch.stack([alone[name][row] for row, name in enumerate(names or ["default"] * 3)])
            torch.testing.assert_close(out, expected, msg=str(names))


def test_compiled_real_minilm_layers_match_eager_forward_and_backward(minilm_classifier):
    """Pretrained BERT, each encoder layer compiled with aot_eager (regional compilation: one graph, reused by all
    six layers; enable_input_require_grads keeps the first layer from recompiling for an input without grad)."""
    model = get_peft_model(minilm_classifier, NeuroAdaConfig(k=2, init_weights=False))
    model.enable_input_require_grads()
    tokens = torch.randint(0, 30000, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1])

    def logits_and_delta_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        output = model(input_ids=tokens, labels=labels)
        output.loss.backward()
        return output.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    eager_logits, eager_grads = logits_and_delta_grads()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for layer in model.base_model.model.bert.encoder.layer:
        layer.compile(backend="aot_eager", fullgraph=True)  # fullgraph: a graph break is an error
    compiled_logits, compiled_grads = logits_and_delta_grads()

    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before
    torch.testing.assert_close(compiled_logits, eager_logits)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, msg=name)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])  # (E, d_out, d_in) and (E, d_in, d_out) stacks
def test_compiled_moe_blocks_with_expert_adapters_train_like_eager(model_type, token_batch):
    """Each MoE block compiled (regional compilation; the whole tiny model takes ~45 s to compile here). An expert
    wrapper is a graph break (it registers its parametrization for the call); the experts' forward compiles."""
    torch._dynamo.reset()  # a fresh cache: frames that hit the recompile limit would run eager, unnoticed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(tiny_causal_lm(model_type), NeuroAdaConfig(k=2, init_weights=False))
    tokens = token_batch.remainder(100)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    eager_loss, eager_grads = loss_and_delta_grads(model, model, tokens)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for layer in model.base_model.model.model.layers:
        layer.mlp.compile(backend="aot_eager")
    compiled_loss, compiled_grads = loss_and_delta_grads(model, model, tokens)

    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before
    torch.testing.assert_close(compiled_loss, eager_loss)
    assert compiled_grads.keys() == eager_grads.keys()
    assert any(".experts." in name for name in eager_grads)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, msg=name)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_the_tuners_expert_wrappers_compile_and_match_eager():
    """The tuner alone (as peft would hold it), both expert stacks of a layer adapted (nested wrappers): the output
    and the input's and deltas' gradients as in eager mode."""
    torch._dynamo.reset()
    config = tuner_config.NeuroAdaConfig(
        k=2, init_weights=False, target_modules=[], target_parameters=["gate_up_proj", "down_proj"]
    )
    base = tiny_causal_lm("mixtral")
    tuner_model.NeuroAdaModel(base, config, "default")
    experts = base.model.layers[0].mlp.experts
    assert isinstance(experts, tuner_experts.ParamWrapper)
    assert isinstance(experts.base_layer, tuner_experts.ParamWrapper)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 32, generator=generator, requires_grad=True)
    routed = torch.randint(0, 4, (7, 2), generator=generator), torch.rand(7, 2, generator=generator)
    deltas = [p for p in experts.parameters() if p.requires_grad]

    def output_and_grads(forward) -> list[torch.Tensor]:
        hidden.grad = None
        for delta in deltas:
            delta.grad = None
        output = forward(hidden, *routed)
        output.square().sum().backward()
        return [output.detach(), hidden.grad, *(delta.grad for delta in deltas)]

    eager = output_and_grads(experts)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = output_and_grads(torch.compile(experts, backend="aot_eager"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before
    assert len(deltas) == 2
    for got, expected in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, expected)


class ResidualNormBlock(nn.Module):
    """`norm(x + o_proj(x))`: the backward fuses RMSNorm's row reduction with the bypass's input-gradient scatter."""

    def __init__(self) -> None:
        super().__init__()
        self.o_proj = nn.Linear(32, 32, bias=False)
        self.norm = LlamaRMSNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.o_proj(x))


def inductor_gradient_errors() -> tuple[float, float]:
    """Max |compiled - eager| of the input and delta gradients, inductor backend (run in a child process)."""
    torch.manual_seed(0)
    model = get_peft_model(ResidualNormBlock(), NeuroAdaConfig(k=2, init_weights=False, target_modules=["o_proj"]))
    delta = model.base_model.model.o_proj.neuroada_delta["default"]
    x = torch.randn(2, 12, 32, requires_grad=True)

    def grads(forward) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = delta.grad = None
        forward(x).square().sum().backward()
        return x.grad.clone(), delta.grad.clone()

    eager = grads(model)
    compiled = grads(torch.compile(model, backend="inductor", fullgraph=True))
    return tuple((c - e).abs().max().item() for c, e in zip(compiled, eager, strict=True))


def test_inductor_compiled_backward_matches_eager():
    script = "from tests.test_compile import inductor_gradient_errors; print(*inductor_gradient_errors())"
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=INDUCTOR_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"inductor compilation did not finish within {INDUCTOR_TIMEOUT_S} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    input_error, delta_error = map(float, output.split()[-2:])
    assert input_error < 1e-4 and delta_error < 1e-4


def test_torch_func_vmap_of_a_layer_gives_its_batched_output_with_and_without_grad():
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False)).eval()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 4, layer.in_features)
    torch.testing.assert_close(torch.func.vmap(layer)(x), layer(x))
    with torch.no_grad():
        torch.testing.assert_close(torch.func.vmap(layer)(x), layer(x))
