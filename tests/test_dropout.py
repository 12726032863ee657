"""`neuroada_dropout`, as LoRA's `lora_dropout`: in training, the deltas read a dropped-out copy of the input while the
frozen layer reads it whole, `y = W x + b + (P ⊙ Θ) dropout(x)`; out of training, or at 0, nothing is dropped. Exact
against a dense reference drawing the same mask, with the gradients of the input and the deltas, on the tuner's layer
and the plugin's, on a linear layer and a Conv1D, on all neurons or a share; on a narrow base the plugin's layer adds
the deltas as a merge rounds them, with dropout as without."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from peft_neuroada import Linear, NeuroAdaConfig
from peft_neuroada.tuner import layer as tuner_layer
from tests.conftest import tiny_causal_lm, tiny_llama
from tests.test_math import dense_delta

P = 0.4
LAYERS = {"plugin": Linear, "tuner": tuner_layer.Linear}


def make_layer(kind: str, conv1d: bool = False, neuron_fraction: float = 1.0, p: float = P) -> nn.Module:
    torch.manual_seed(0)
    base = Conv1D(16, 24) if conv1d else nn.Linear(24, 16)
    nn.init.normal_(base.weight)
    base.requires_grad_(False)
    config = NeuroAdaConfig(k=3, init_weights=False, neuron_fraction=neuron_fraction, neuroada_dropout=p)
    return LAYERS[kind](base, "default", config, fan_in_fan_out=conv1d)


def reference(layer: nn.Module, x: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """The frozen layer on `x`, plus the dense delta on `dropped`."""
    base = layer.get_base_layer()
    weight = layer.weight_out_in().detach()
    delta = dense_delta(layer).requires_grad_(True)
    return nn.functional.linear(x, weight, base.bias) + nn.functional.linear(dropped, delta), delta


@pytest.mark.parametrize("neuron_fraction", [1.0, 0.5], ids=["all-neurons", "half-neurons"])
@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("kind", LAYERS)
def test_in_training_the_deltas_read_the_dropped_input_and_the_frozen_layer_the_whole(kind, conv1d, neuron_fraction):
    layer = make_layer(kind, conv1d, neuron_fraction).train()
    x = torch.randn(2, 5, 24, requires_grad=True)
    torch.manual_seed(7)
    out = layer(x)
    torch.manual_seed(7)  # the same mask: the frozen layer draws nothing before the dropout
    expected, delta = reference(layer, x, nn.functional.dropout(x, P, training=True))
    torch.testing.assert_close(out, expected)
    grad_out = torch.randn_like(out)
    grad_x, grad_delta = torch.autograd.grad(out, (x, layer.neuroada_delta["default"]), grad_out)
    expected_x, expected_dense = torch.autograd.grad(expected, (x, delta), grad_out)
    torch.testing.assert_close(grad_x, expected_x)
    rows = layer.neuroada_rows["default"].long()[:, None] if neuron_fraction < 1 else torch.arange(16)[:, None]
    torch.testing.assert_close(grad_delta, expected_dense[rows, layer.placement("default").cols.long()])


@pytest.mark.parametrize("kind", LAYERS)
def test_out_of_training_nothing_is_dropped_and_the_merged_layer_computes_the_same(kind):
    layer = make_layer(kind).eval()
    x = torch.randn(3, 24)
    unmerged = layer(x)
    torch.testing.assert_close(unmerged, reference(layer, x, x)[0])
    layer.merge()
    torch.testing.assert_close(layer(x), unmerged)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_on_a_narrow_base_the_plugin_adds_the_deltas_a_merge_would_hold_with_dropout_too(dtype):
    """As without dropout (tests/test_math.py): deltas of 0.45 of a step, which a merge rounds away, change nothing in
    training either, so the model trains on what the merged model holds; their gradient passes the rounding."""
    base = nn.Linear(8, 8, bias=False).to(dtype).requires_grad_(False)
    nn.init.constant_(base.weight, 1.0)
    layer = Linear(base, "default", NeuroAdaConfig(k=8, delta_dtype="float32", neuroada_dropout=P)).train()
    nn.init.constant_(layer.neuroada_delta["default"], 0.45 * torch.finfo(dtype).eps)
    x = torch.ones(64, 8, dtype=dtype)  # tokens enough for the merged copy, which dropout turns down
    out = layer(x)
    assert torch.equal(out, base(x))
    out.float().sum().backward()
    assert layer.neuroada_delta["default"].grad.abs().sum() > 0


def test_at_zero_the_layer_holds_no_dropout_and_training_is_deterministic():
    layer = make_layer("plugin", p=0.0).train()
    assert isinstance(layer.neuroada_dropout["default"], nn.Identity)
    x = torch.randn(4, 24)
    assert torch.equal(layer(x), layer(x))


@pytest.mark.parametrize("value", [-0.1, 1.0, "0.1", True])
def test_a_dropout_outside_zero_to_one_is_refused_by_name(value):
    with pytest.raises(ValueError, match="NeuroAdaConfig.neuroada_dropout must be a number in"):
        NeuroAdaConfig(neuroada_dropout=value)


def test_a_saved_adapter_keeps_its_dropout_and_one_saved_before_it_existed_loads_without(tmp_path):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, neuroada_dropout=0.1))
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    assert reloaded.peft_config["default"].neuroada_dropout == 0.1
    config_file = tmp_path / "adapter_config.json"
    config_file.write_text(config_file.read_text().replace('"neuroada_dropout": 0.1,', ""))
    older = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    assert older.peft_config["default"].neuroada_dropout == 0.0


def test_expert_parameters_refuse_a_dropout_as_lora_s_parameter_wrapper_does():
    config = NeuroAdaConfig(target_modules=[], target_parameters=["gate_up_proj"], neuroada_dropout=0.1)
    with pytest.raises(ValueError, match="target_parameters do not take neuroada_dropout"):
        get_peft_model(tiny_causal_lm("mixtral"), config)
