"""A batch without tokens (an empty micro-batch, an MoE expert that receives none) gets what LoRA gives on the same
layer, on both paths (merged copy, bypass): an empty output of LoRA's shape and dtype, and zero gradients shaped like
the deltas and the input."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from peft_neuroada import Linear, NeuroAdaConfig
from peft_neuroada.merged_copy import copy_refusal
from tests.conftest import neuroada_layers


class Tagged(torch.Tensor):
    """A trivial tensor subclass, standing in for quantized and distributed weights."""


class Pair(nn.Module):
    """`lin`, the adapted layer, and `other`, which some situations give the same weight."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.other = nn.Linear(64, 48), nn.Linear(64, 48)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def tie(model: Pair) -> None:
    model.other.weight = model.lin.weight


def hook(model: Pair) -> None:
    model.lin.register_forward_hook(lambda module, args, out: out)


def subclass(model: Pair) -> None:
    model.lin.weight = nn.Parameter(model.lin.weight.detach().as_subclass(Tagged), requires_grad=False)


def nothing(model: nn.Module) -> None:
    pass


def autocast_bf16() -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16)


class Situation:
    """How the model is built and run, and the path the adapted layer must take."""

    def __init__(
        self,
        path: str,
        base: Callable[[Pair], None] = nothing,
        peft_model: Callable[[nn.Module], None] = nothing,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        inference_tensors: bool = False,
    ) -> None:
        self.path, self.base, self.peft_model, self.context = path, base, peft_model, context
        self.inference_tensors = inference_tensors

    def build(self, config, dtype: torch.dtype) -> nn.Module:
        with torch.inference_mode(self.inference_tensors):
            model = Pair(dtype)
        self.base(model)
        model = get_peft_model(model, config)
        self.peft_model(model)
        return model


SITUATIONS = {
    "plain": Situation("copy"),
    "autocast-bf16": Situation("bypass", context=autocast_bf16),
    "tied-weight": Situation("copy", base=tie),
    "shared-memory": Situation("copy", peft_model=lambda model: model.share_memory()),
    "inference-tensor": Situation("copy", inference_tensors=True),
    "hooked-base": Situation("bypass", base=hook),
    "tensor-subclass": Situation("bypass", base=subclass),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# autocast to bf16 narrows only a float32 matmul; in the other dtypes the copy path runs under it.
CASES = [(s, d) for s in SITUATIONS for d in DTYPES if s != "autocast-bf16" or d == "float32"]
SHAPES = {"no-tokens": (0, 64), "no-positions": (2, 0, 64)}


def cpu_matmul_supports(dtype: torch.dtype) -> bool:
    try:
        torch.ones(2, 2, dtype=dtype) @ torch.ones(2, 2, dtype=dtype)
    except RuntimeError:
        return False
    return True


def adapted(model: nn.Module) -> Linear:
    (layer,) = neuroada_layers(model)
    return layer


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "backward"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize(("situation", "dtype"), CASES, ids=[f"{s}-{d}" for s, d in CASES])
def test_no_tokens_give_loras_empty_output_and_zero_gradients_on_every_path(situation, dtype, shape, grad):
    situation, dtype = SITUATIONS[situation], DTYPES[dtype]
    if not cpu_matmul_supports(dtype):
        pytest.skip(f"this CPU has no {dtype} matmul")
    config = NeuroAdaConfig(k=3, target_modules=["lin"], init_weights=False)
    model = situation.build(config, dtype).train(grad)
    lora = situation.build(LoraConfig(r=2, target_modules=["lin"], init_lora_weights=False), dtype).train(grad)
    x = torch.randn(shape, dtype=dtype, requires_grad=grad)
    with situation.context(), torch.set_grad_enabled(grad):
        layer = adapted(model)
        path = "bypass" if copy_refusal(layer.get_base_layer(), layer.weight_out_in(), x.new_empty(64, 64)) else "copy"
        assert path == situation.path
        out = model(x)
        with torch.no_grad():  # (LoRA cannot save an inference tensor for backward)
            expected = lora(x)
    assert (out.shape, out.dtype) == (expected.shape, expected.dtype)
    if grad:
        out.sum().backward()
        delta = adapted(model).neuroada_delta["default"]
        assert torch.equal(delta.grad, torch.zeros_like(delta))
        assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "backward"])
def test_an_empty_mixed_batch_gets_the_base_layers_empty_output_as_under_lora(grad):
    model = get_peft_model(Pair(torch.float32), NeuroAdaConfig(k=3, target_modules=["lin"], init_weights=False))
    lora = get_peft_model(Pair(torch.float32), LoraConfig(r=2, target_modules=["lin"], init_lora_weights=False))
    x = torch.randn(0, 64, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        out = model.base_model.model.lin(x, adapter_names=[])
        expected = lora.base_model.model.lin(x, adapter_names=[])
    assert (out.shape, out.dtype, out.requires_grad) == (expected.shape, expected.dtype, expected.requires_grad)


def test_the_real_smollm2_mlps_take_no_tokens_as_an_moe_expert_that_receives_none(smollm2):
    """Each decoder block's MLP (gate, up, down) on zero tokens, with backward: empty, and every delta's gradient
    zero."""
    model = get_peft_model(smollm2, NeuroAdaConfig(k=1, target_modules=["gate_proj", "up_proj", "down_proj"]))
    model.train()
    hidden = smollm2.config.hidden_size
    for block in model.base_model.model.model.layers:
        x = torch.randn(0, hidden, requires_grad=True)
        out = block.mlp(x)
        assert out.shape == (0, hidden)
        out.sum().backward()
    deltas = [delta for layer in neuroada_layers(model) for delta in layer.neuroada_delta.values()]
    assert len(deltas) == 3 * smollm2.config.num_hidden_layers
    assert all(torch.equal(delta.grad, torch.zeros_like(delta)) for delta in deltas)
