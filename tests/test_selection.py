"""Per neuron, k inputs are selected by a named strategy, deterministically, reproducibly and compactly."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_neuroada import NeuroAdaConfig, NeuroAdaLayer
from peft_neuroada.tuner.selection import layer_generator, select_inputs, select_neurons
from tests.conftest import hidden, indices_by_layer, named_neuroada_layers, real_minilm, tiny_llama


def test_magnitude_selects_the_k_largest_magnitudes_of_each_row_in_ascending_column_order():
    weight = torch.tensor([[0.1, -5.0, 3.0, 0.2], [4.0, 0.0, -0.5, -4.5]])
    assert select_inputs(weight, 2).tolist() == [[1, 2], [0, 3]]


def test_reverse_selects_the_k_smallest_magnitudes():
    weight = torch.tensor([[0.1, -5.0, 3.0, 0.2], [4.0, 0.0, -0.5, -4.5]])
    assert select_inputs(weight, 2, "reverse").tolist() == [[0, 3], [1, 2]]


def test_ties_are_broken_towards_the_lower_column_index():
    weight = torch.tensor([[1.0, -2.0, 2.0, 2.0, -2.0, 0.5]])
    assert select_inputs(weight, 2).tolist() == [[1, 2]]
    assert select_inputs(weight.to(torch.bfloat16), 3).tolist() == [[1, 2, 3]]
    assert select_inputs(-weight.abs() + 3.0, 2, "reverse").tolist() == [[1, 2]]


def test_magnitude_selection_matches_a_full_stable_sort_on_a_real_sized_matrix():
    torch.manual_seed(0)
    weight = torch.randn(1536, 576).to(torch.bfloat16)
    full_sort = weight.abs().sort(dim=1, descending=True, stable=True).indices[:, :20].sort(dim=1).values
    assert torch.equal(select_inputs(weight, 20).long(), full_sort)


def test_random_selection_is_reproducible_per_seed_and_layer_and_distinct_per_row():
    weight = torch.randn(64, 100)
    first = select_inputs(weight, 5, "random", layer_generator(7, "layers.0.q_proj"))
    again = select_inputs(weight, 5, "random", layer_generator(7, "layers.0.q_proj"))
    other_layer = select_inputs(weight, 5, "random", layer_generator(7, "layers.1.q_proj"))
    assert torch.equal(first, again) and not torch.equal(first, other_layer)
    assert all(len(set(row.tolist())) == 5 for row in first)
    assert not torch.equal(first, select_inputs(weight, 5))


def test_an_adapter_added_to_a_layer_without_its_name_draws_as_that_layer_does():
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, selection="random", neuron_fraction=0.5))
    first, second = list(named_neuroada_layers(model).values())[:2]
    for layer in (first, second):
        layer.update_layer("again", NeuroAdaConfig(k=3, selection="random", neuron_fraction=0.5))
        assert torch.equal(layer.placement("again").cols, layer.placement("default").cols)
        assert torch.equal(layer.placement("again").rows, layer.placement("default").rows)


def test_neuron_fraction_picks_a_seeded_sorted_subset_of_rows():
    rows = select_neurons(100, 0.25, layer_generator(0, "x"))
    assert rows.numel() == 25 and torch.equal(rows, rows.sort().values)
    assert torch.equal(rows, select_neurons(100, 0.25, layer_generator(0, "x")))
    assert select_neurons(100, 1.0, layer_generator(0, "x")) is None


@pytest.mark.parametrize("selection", ["magnitude", "reverse", "random"])
def test_strategy_and_seed_are_saved_and_loading_reproduces_the_indices(selection, tmp_path):
    settings = {"k": 3, "selection": selection, "selection_seed": 11, "neuron_fraction": 0.5}
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(**settings, init_weights=False))
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    saved_config = reloaded.peft_config["default"]
    assert (saved_config.selection, saved_config.selection_seed, saved_config.neuron_fraction) == (selection, 11, 0.5)
    reinjected = get_peft_model(
        tiny_llama(), NeuroAdaConfig(k=3, selection=selection, selection_seed=11, neuron_fraction=0.5)
    )
    for name, indices in indices_by_layer(model).items():
        assert torch.equal(indices_by_layer(reloaded)[name], indices)
        assert torch.equal(indices_by_layer(reinjected)[name], indices)


def test_neuron_fraction_tunes_only_that_share_of_each_layer(token_batch):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, neuron_fraction=0.5, init_weights=False))
    layer = model.base_model.model.model.layers[0].mlp.gate_proj
    rows = layer.neuroada_rows["default"].long()
    assert rows.numel() == 24 and layer.neuroada_delta["default"].shape == (24, 2)
    delta_weight = layer.get_delta_weight("default")
    untouched = torch.ones(48, dtype=torch.bool).index_fill_(0, rows, False)
    assert delta_weight[untouched].abs().sum() == 0 and (delta_weight[rows] != 0).sum() == 48
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable == 2 * 2 * (16 + 8 + 8 + 16 + 24 + 24 + 16)


def check_reverse(layer: NeuroAdaLayer, indices: torch.Tensor) -> None:
    """Every selected |w| is at most every unselected |w| of the same row, so the choice differs from magnitude."""
    magnitudes = layer.weight_out_in().abs()
    largest_selected = magnitudes.gather(1, indices).amax(dim=1)
    smallest_unselected = magnitudes.scatter(1, indices, float("inf")).amin(dim=1)
    assert (largest_selected <= smallest_unselected).all()
    assert not torch.equal(indices, select_inputs(layer.weight_out_in(), indices.shape[1]).long())


def check_random(layer: NeuroAdaLayer, indices: torch.Tensor) -> None:
    """k distinct inputs per row, not the magnitude choice."""
    assert all(len(set(row.tolist())) == indices.shape[1] for row in indices)
    assert not torch.equal(indices, select_inputs(layer.weight_out_in(), indices.shape[1]).long())


def check_neuron_fraction(layer: NeuroAdaLayer, indices: torch.Tensor) -> None:
    """A quarter of the rows are tuned, each on its magnitude choice."""
    rows = layer.neuroada_rows["default"].long()
    assert rows.numel() == round(0.25 * layer.out_features) == indices.shape[0]
    assert torch.equal(indices, select_inputs(layer.weight_out_in()[rows], indices.shape[1]).long())


@pytest.mark.parametrize(
    ("settings", "check"),
    [
        ({"selection": "reverse"}, check_reverse),
        ({"selection": "random"}, check_random),
        ({"neuron_fraction": 0.25}, check_neuron_fraction),
    ],
    ids=["reverse", "random", "neuron_fraction"],
)
def test_selection_strategies_on_real_minilm_follow_their_rule_and_reproduce_on_reload(settings, check, tmp_path):
    """On pretrained weights each strategy applies its own rule, and re-injection and reloading agree exactly."""
    base = real_minilm()
    config = {"k": 4, "selection_seed": 3, **settings}
    model = get_peft_model(copy.deepcopy(base), NeuroAdaConfig(**config, init_weights=False))
    selected = indices_by_layer(model)
    for name, layer in named_neuroada_layers(model).items():
        check(layer, selected[name].long())
    reinjected = indices_by_layer(get_peft_model(copy.deepcopy(base), NeuroAdaConfig(**config)))
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    reloaded_indices = indices_by_layer(reloaded)
    for name, indices in selected.items():
        assert torch.equal(reinjected[name], indices) and torch.equal(reloaded_indices[name], indices), name
    tokens = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hidden(reloaded, tokens), hidden(model, tokens))


@pytest.mark.parametrize(("d_out", "fraction"), [(1000, 0.1234), (4096, 0.1), (576, 0.3), (10, 0.01)])
def test_neuron_fraction_tunes_as_many_neurons_as_the_official_ablation(d_out, fraction):
    """The official `certainCell` ablation freezes int((1 - fraction) * rows) neurons and tunes the others."""
    rows = select_neurons(d_out, fraction, torch.Generator().manual_seed(0))
    assert rows.numel() == d_out - int((1 - fraction) * d_out)
    assert rows.unique().numel() == rows.numel() and 0 <= rows.min() and rows.max() < d_out


@pytest.mark.parametrize("k", [1, 20])
def test_magnitude_selection_takes_torch_topk_magnitudes_and_breaks_ties_toward_lower_columns(k):
    """The official code's `torch.topk` on bf16 weights orders equal |w| as its kernel happens to; this selection
    takes the same magnitudes and, among equal ones at the k-th place, the lower columns."""
    weight = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    magnitudes = weight.abs().float()
    ours = select_inputs(weight, k, "magnitude").long()
    reference = weight.abs().topk(k, dim=1).indices
    assert torch.equal(magnitudes.gather(1, ours).sort(1).values, magnitudes.gather(1, reference).sort(1).values)
    kth = magnitudes.gather(1, ours).min(dim=1, keepdim=True).values
    for row in range(weight.shape[0]):
        tied = (magnitudes[row] == kth[row]).nonzero().flatten()
        needed = k - int((magnitudes[row] > kth[row]).sum())
        assert set(tied[:needed].tolist()) <= set(ours[row].tolist()), row
