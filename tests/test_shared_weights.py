"""Layers whose weight another module also holds (tied weights) train exactly on the non-mutating path, and merging
into such a weight is refused up front, naming the layers, with the weight left untouched."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from torch import nn

from peft_neuroada import NeuroAdaConfig
from tests.conftest import named_neuroada_layers, tiny_llama


class TwoLayersOneWeight(nn.Module):
    """`first` and `second` share one weight Parameter (as tied layers do)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 16)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def dense_forward(model, x: torch.Tensor) -> torch.Tensor:
    """The reference: each layer as an ordinary linear layer with weight W + its own scattered deltas."""
    layers = named_neuroada_layers(model)

    def apply(name: str, h: torch.Tensor) -> torch.Tensor:
        layer = layers[name]
        weight = layer.weight_out_in().detach() + layer.get_delta_weight("default")
        return nn.functional.linear(h, weight, layer.get_base_layer().bias)

    return apply("base_model.model.second", torch.tanh(apply("base_model.model.first", x)))


@pytest.fixture
def shared():
    model = get_peft_model(TwoLayersOneWeight(), NeuroAdaConfig(k=2, target_modules=["first", "second"]))
    with torch.no_grad():
        for layer in named_neuroada_layers(model).values():
            layer.neuroada_delta["default"].normal_(std=0.1)
    return model


def test_layers_sharing_a_weight_know_it(shared):
    layers = named_neuroada_layers(shared)
    assert layers["base_model.model.first"].weight_shared_with == ("second.base_layer",)
    assert layers["base_model.model.second"].weight_shared_with == ("first.base_layer",)


def test_layers_sharing_a_weight_compute_their_own_deltas_exactly_and_train(shared):
    x = torch.randn(3, 16)
    weight = shared.base_model.model.first.base_layer.weight
    before, version = weight.detach().clone(), weight._version
    torch.testing.assert_close(shared(x), dense_forward(shared, x), rtol=1e-6, atol=1e-6)
    optimizer = torch.optim.SGD([p for p in shared.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        shared(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(shared(x), dense_forward(shared, x), rtol=1e-6, atol=1e-6)
    assert weight._version == version and torch.equal(weight, before)


@pytest.mark.parametrize("merge", ["merge_adapter", "merge_and_unload"])
def test_merging_into_a_shared_weight_is_refused_naming_the_layers(shared, merge):
    x = torch.randn(3, 16)
    weight = shared.base_model.model.first.base_layer.weight
    before, output = weight.detach().clone(), shared(x).detach()
    with pytest.raises(
        ValueError, match=r"weight of 'first': it is shared with second\.base_layer.*requires_grad=False"
    ):
        getattr(shared, merge)()
    assert torch.equal(weight, before)
    assert not any(layer.merged for layer in named_neuroada_layers(shared).values())
    assert torch.equal(shared(x), output)


def test_after_untying_as_the_error_suggests_merge_and_unmerge_are_exact(shared):
    for layer in named_neuroada_layers(shared).values():
        layer.base_layer.weight = nn.Parameter(layer.base_layer.weight.detach().clone(), requires_grad=False)
    layers = named_neuroada_layers(shared)
    originals = {name: layer.base_layer.weight.clone() for name, layer in layers.items()}
    x = torch.randn(3, 16)
    expected = shared(x).detach()
    shared.merge_adapter()
    torch.testing.assert_close(shared(x), expected, rtol=1e-6, atol=1e-6)
    shared.unmerge_adapter()
    assert all(torch.equal(layer.base_layer.weight, originals[name]) for name, layer in layers.items())


def test_an_output_head_tied_to_the_embeddings_is_adapted_without_ever_being_written():
    base = tiny_llama(num_hidden_layers=1, tie_word_embeddings=True)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    model = get_peft_model(base, NeuroAdaConfig(k=1, target_modules=["lm_head"], init_weights=False))
    head = model.base_model.model.lm_head
    assert head.weight_shared_with == ("model.embed_tokens",)
    embedding = base.model.embed_tokens.weight
    before, version = embedding.detach().clone(), embedding._version
    tokens = torch.randint(0, 128, (2, 8))
    model(input_ids=tokens, labels=tokens).loss.backward()
    assert embedding._version == version and torch.equal(embedding, before)
    with pytest.raises(ValueError, match=r"weight of 'lm_head': it is shared with model\.embed_tokens"):
        model.merge_and_unload()
    assert torch.equal(embedding, before)
