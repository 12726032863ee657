"""Biases train beside the deltas as with LoRA (`bias="all"` / `"neuroada_only"`): the base layers' own biases become
trainable, are saved with the adapter, load back, and need nothing to merge; only one adapter of a model may train
them (peft's rule)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, inject_adapter_in_model
from torch import nn

from peft_neuroada import Linear, NeuroAdaConfig
from tests.conftest import (
    named_neuroada_layers,
    neuroada_layers,
    real_minilm_classifier,
    tiny_bert,
    tiny_gpt2,
    train_on_batch,
)


def trainable(model) -> set[str]:
    return {name for name, parameter in model.named_parameters() if parameter.requires_grad}


def all_biases(model) -> set[str]:
    return {name for name, _ in model.named_parameters() if name.endswith(".bias")}


def adapted_layer_biases(model) -> set[str]:
    return {f"{name}.base_layer.bias" for name in named_neuroada_layers(model)}


def deltas(model) -> set[str]:
    return {name for name, _ in model.named_parameters() if "neuroada_delta" in name}


@pytest.mark.parametrize(("bias", "trained_biases"), [("all", all_biases), ("neuroada_only", adapted_layer_biases)])
def test_bias_option_trains_those_biases_beside_the_deltas(bias, trained_biases):
    model = get_peft_model(tiny_bert(), NeuroAdaConfig(k=2, bias=bias))
    assert trainable(model) == deltas(model) | trained_biases(model)
    assert set() < adapted_layer_biases(model) < all_biases(model)  # the two options train different biases


def test_bias_none_trains_only_the_deltas():
    model = get_peft_model(tiny_bert(), NeuroAdaConfig(k=2))
    assert trainable(model) == deltas(model)


@pytest.mark.parametrize("path", ["copy", "bypass"])
def test_a_trainable_bias_gets_its_dense_gradient_beside_the_deltas(path):
    """A trained bias keeps its layer on the merged-copy path, which returns its gradient (the output gradient summed
    over tokens) beside the deltas'; the bypass leaves it to the base layer's own call."""
    torch.manual_seed(0)
    base = nn.Linear(12, 10).requires_grad_(False)
    if path == "bypass":
        base.register_forward_hook(lambda module, args, out: out)
    layer = Linear(base, "default", NeuroAdaConfig(k=3, init_weights=False))
    base.bias.requires_grad_(True)
    x = torch.randn(2, 5, 12)
    layer(x).square().sum().backward()

    dense_delta = layer.get_delta_weight("default").requires_grad_(True)
    reference_bias = base.bias.detach().clone().requires_grad_(True)
    nn.functional.linear(x, base.weight + dense_delta, reference_bias).square().sum().backward()
    torch.testing.assert_close(base.bias.grad, reference_bias.grad)
    placed_grad = dense_delta.grad.gather(1, layer.placement("default").cols.long())
    torch.testing.assert_close(layer.neuroada_delta["default"].grad, placed_grad)


@pytest.mark.parametrize("make_model", [tiny_bert, tiny_gpt2], ids=["bert-linear", "gpt2-conv1d"])
def test_trained_biases_are_saved_with_the_adapter_and_load_back(make_model, tmp_path):
    tokens = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    config = NeuroAdaConfig(k=2, bias="neuroada_only", fan_in_fan_out=make_model is tiny_gpt2)
    model = get_peft_model(make_model(), config)
    biases_before = {name: model.get_parameter(name).detach().clone() for name in adapted_layer_biases(model)}
    with torch.no_grad():  # stands in for training
        for name in biases_before:
            model.get_parameter(name).add_(torch.randn_like(model.get_parameter(name)))
    saved = get_peft_model_state_dict(model)
    assert {key for key in saved if key.endswith(".bias")} == adapted_layer_biases(model)
    expected = model(tokens)[0].detach()
    model.save_pretrained(tmp_path)

    reloaded = PeftModel.from_pretrained(make_model(), tmp_path)
    for name, before in biases_before.items():
        assert not torch.equal(reloaded.get_parameter(name), before)
        assert torch.equal(reloaded.get_parameter(name), model.get_parameter(name))
    torch.testing.assert_close(reloaded(tokens)[0], expected)


class LinearWithOwnBias(nn.Module):
    """A model whose root holds a bias: its state-dict key is a bare `bias`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.bias


def test_bias_all_saves_a_top_level_bias_of_a_model_adapted_in_place():
    model = inject_adapter_in_model(NeuroAdaConfig(k=2, bias="all", target_modules=["lin"]), LinearWithOwnBias())
    saved = get_peft_model_state_dict(model)
    assert set(saved) == {"bias", "lin.base_layer.bias", "lin.neuroada_delta", "lin.neuroada_indices"}


def test_an_adapter_loaded_for_inference_keeps_its_biases_frozen(tmp_path):
    get_peft_model(tiny_bert(), NeuroAdaConfig(k=2, bias="all")).save_pretrained(tmp_path)
    for_inference = PeftModel.from_pretrained(tiny_bert(), tmp_path)
    assert trainable(for_inference) == set()
    for_training = PeftModel.from_pretrained(tiny_bert(), tmp_path, is_trainable=True)
    assert trainable(for_training) == deltas(for_training) | all_biases(for_training)


def test_minilm_classifier_trains_biases_and_head_then_merges_to_the_same_predictions(minilm_tokenizer, tmp_path):
    """The paper's GLUE set-up on a real encoder: deltas, the adapted layers' biases and the classification head
    train; the adapter reloads onto a base with a different fresh head and merges into plain linear layers."""
    batch = minilm_tokenizer(["a fine film", "a dull film"], return_tensors="pt", padding=True)
    labels = torch.tensor([1, 0])
    config = NeuroAdaConfig(k=1, bias="neuroada_only", modules_to_save=["classifier"])
    model = get_peft_model(real_minilm_classifier(), config)
    biases_before = {name: model.get_parameter(name).detach().clone() for name in adapted_layer_biases(model)}
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(3):
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    assert all(not torch.equal(model.get_parameter(name), before) for name, before in biases_before.items())
    with torch.no_grad():
        expected = model(**batch).logits
    model.save_pretrained(tmp_path)

    reloaded = PeftModel.from_pretrained(real_minilm_classifier(head_seed=1), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, expected)
        merged = reloaded.merge_and_unload()
        assert not neuroada_layers(merged)
        torch.testing.assert_close(merged(**batch).logits, expected, rtol=1e-5, atol=1e-5)


def test_training_with_biases_lowers_the_loss_and_merge_unmerge_restore_the_weights():
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    model = get_peft_model(tiny_gpt2(), NeuroAdaConfig(k=2, bias="all", fan_in_fan_out=True))
    weights = {name: layer.get_base_layer().weight.clone() for name, layer in named_neuroada_layers(model).items()}
    losses = train_on_batch(model, tokens, steps=10, lr=1e-2)
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        unmerged = model(tokens).logits
        model.merge_adapter()
        torch.testing.assert_close(model(tokens).logits, unmerged, rtol=1e-5, atol=1e-5)
        model.unmerge_adapter()
    for name, layer in named_neuroada_layers(model).items():
        assert torch.equal(layer.get_base_layer().weight, weights[name])


def test_a_second_adapter_training_biases_is_refused_by_peft_and_not_half_added():
    model = get_peft_model(tiny_bert(), NeuroAdaConfig(k=2, bias="all"))
    with pytest.raises(ValueError, match="NeuroAdaPluginModel supports only 1 adapter with bias"):
        model.add_adapter("other", NeuroAdaConfig(k=2, bias="neuroada_only"))
    assert "other" not in model.peft_config
    assert all("other" not in layer.neuroada_delta for layer in neuroada_layers(model))
    model.add_adapter("other", NeuroAdaConfig(k=2))  # a bias-free second adapter is fine
    assert all("other" in layer.neuroada_delta for layer in neuroada_layers(model))


def test_disabling_an_adapter_that_trains_biases_warns_that_they_stay():
    model = get_peft_model(tiny_bert(), NeuroAdaConfig(k=2, bias="all"))
    with pytest.warns(UserWarning, match="Careful, disabling adapter layers with bias configured to be 'all'"):
        with model.disable_adapter():
            pass
