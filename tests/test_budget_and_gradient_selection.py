"""k from a parameter budget, and gradient-based selection from calibration batches."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from torch.nn.utils import parametrize

from peft_neuroada import NeuroAdaConfig, k_for_budget, select_by_gradient
from peft_neuroada.budget import (
    density_for_k,
    lora_parameter_count,
    lora_rank_for_k,
    neuroada_parameter_count,
    targeted_shapes,
)
from tests.conftest import indices_by_layer, logits, named_neuroada_layers, tiny_causal_lm, tiny_llama


def test_k_for_a_lora_budget_matches_lora_trainable_parameters_on_smollm2(smollm2):
    config = NeuroAdaConfig()
    k = k_for_budget(smollm2, config, lora_rank=8)
    shapes = targeted_shapes(smollm2, config)
    lora_trainable, _ = get_peft_model(
        smollm2, LoraConfig(r=8, target_modules=list(config_targets()))
    ).get_nb_trainable_parameters()
    assert lora_parameter_count(shapes, 8) == lora_trainable
    best = abs(neuroada_parameter_count(shapes, k) - lora_trainable)
    assert best <= min(abs(neuroada_parameter_count(shapes, other) - lora_trainable) for other in (k - 1, k + 1))


def config_targets() -> set[str]:
    return {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_k_for_a_percentage_budget():
    model = tiny_llama()
    shapes = targeted_shapes(model, NeuroAdaConfig())
    total = sum(p.numel() for p in model.parameters())
    k = k_for_budget(model, NeuroAdaConfig(), percent=100 * neuroada_parameter_count(shapes, 3) / total)
    assert k == 3


def test_the_lora_rank_for_a_k_is_the_one_with_the_closest_parameter_count(smollm2):
    shapes = targeted_shapes(smollm2, NeuroAdaConfig())
    for k in (1, 16, 20):
        rank = lora_rank_for_k(shapes, k)
        gaps = {r: abs(lora_parameter_count(shapes, r) - neuroada_parameter_count(shapes, k)) for r in range(1, 64)}
        assert gaps[rank] == min(gaps.values())
    assert lora_rank_for_k(shapes, 16) == 8  # SmolLM2-135M: LoRA r=8 and k=16 spend the same budget


def test_the_density_for_a_k_is_its_share_of_the_weight_entries():
    shapes = [(8, 16), (32, 4)]
    assert density_for_k(shapes, 2) == pytest.approx((8 * 2 + 32 * 2) / (8 * 16 + 32 * 4))


@pytest.mark.parametrize("fraction", [1.0, 0.7, 0.1234])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_the_counted_parameters_are_the_ones_the_model_trains(fraction, k):
    config = NeuroAdaConfig(k=k, neuron_fraction=fraction)
    model = tiny_llama()
    shapes = targeted_shapes(model, config)
    trainable, _ = get_peft_model(model, config).get_nb_trainable_parameters()
    assert neuroada_parameter_count(shapes, k, fraction) == trainable


class UsersOwnScaling(nn.Module):
    """A parametrization a user put on a weight (peft adapts such a module's parameters only when named in full)."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def trained_and_counted_past_a_parametrization(model: nn.Module, owner: nn.Module, name: str, config) -> tuple:
    parametrize.register_parametrization(owner, name, UsersOwnScaling())
    counted = neuroada_parameter_count(targeted_shapes(model, config), config.k)
    trained, _ = get_peft_model(model, config).get_nb_trainable_parameters()
    return counted, trained


@pytest.mark.filterwarnings("ignore:NeuroAda leaves these projections")
@pytest.mark.parametrize(
    "targets",
    [["experts.gate_up_proj", "experts.down_proj"], ["model.layers.0.mlp.experts.gate_up_proj", "experts.down_proj"]],
    ids=["by-suffix: the layer is skipped", "by-full-name: it trains"],
)
def test_an_expert_stack_the_user_parametrized_counts_only_where_peft_adapts_it(targets):
    model = tiny_causal_lm("mixtral")
    config = NeuroAdaConfig(k=2, target_modules=[], target_parameters=targets)
    counted, trained = trained_and_counted_past_a_parametrization(
        model, model.model.layers[0].mlp.experts, "gate_up_proj", config
    )
    assert counted == trained


@pytest.mark.filterwarnings("ignore:NeuroAda leaves these projections")
def test_k_for_budget_leaves_out_the_expert_stacks_peft_skips_for_a_users_parametrization():
    """4 experts a layer, two layers: the user's parametrization on layer 0 leaves layer 1's 512 entries per k."""
    model = tiny_causal_lm("mixtral")
    parametrize.register_parametrization(model.model.layers[0].mlp.experts, "gate_up_proj", UsersOwnScaling())
    config = NeuroAdaConfig(target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    total = sum(p.numel() for p in model.parameters())
    assert k_for_budget(model, config, percent=100 * 3 * 4 * (96 + 32) / total) == 3


def test_on_smollm2_a_weight_the_user_parametrized_is_not_counted(smollm2):
    config = NeuroAdaConfig(k=2, target_modules=[], target_parameters=["self_attn.q_proj.weight"])
    owner = smollm2.model.layers[0].self_attn.q_proj
    counted, trained = trained_and_counted_past_a_parametrization(smollm2, owner, "weight", config)
    assert counted == trained == 29 * 576 * 2


@pytest.mark.parametrize("budgets", [{}, {"lora_rank": 2, "percent": 1.0}], ids=["none", "both"])
def test_k_for_budget_needs_exactly_one_budget(budgets):
    with pytest.raises(ValueError, match="exactly one budget"):
        k_for_budget(tiny_llama(), NeuroAdaConfig(), **budgets)


def dense_gradients(batches: list[dict]) -> dict[str, torch.Tensor]:
    """Reference: the summed dense gradient of every targeted weight, from an ordinary trainable copy."""
    model = tiny_llama()
    model.requires_grad_(False)
    targets = {n: m.weight for n, m in model.named_modules() if n.split(".")[-1] in config_targets()}
    for weight in targets.values():
        weight.requires_grad_(True)
    for batch in batches:
        model(**batch).loss.backward()
    return {name: weight.grad for name, weight in targets.items()}


@pytest.mark.filterwarnings("ignore:Adapter 'default' uses selection='gradient'")
@pytest.mark.parametrize("budget", [1 << 27, 2000], ids=["one-pass", "layer-by-layer"])
def test_gradient_selection_picks_the_largest_accumulated_gradients(budget):
    batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (3, 2, 10))]
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, selection="gradient"))
    select_by_gradient(model, batches, max_accumulated_elements=budget)
    reference = dense_gradients(batches)
    assert model.peft_config["default"].selection == "gradient"
    for name, layer in named_neuroada_layers(model).items():
        gradient = reference[name.removeprefix("base_model.model.")]
        expected = gradient.abs().topk(3, dim=1).indices.sort(dim=1).values
        assert torch.equal(layer.placement("default").cols.long(), expected), name
        assert torch.count_nonzero(layer.neuroada_delta["default"]) == 0


@pytest.mark.filterwarnings("ignore:Adapter 'default' uses selection='gradient'")
def test_gradient_selection_under_reentrant_checkpointing_picks_what_it_picks_without():
    """Reentrant checkpointing first runs each block without gradients: only its recomputation is watched."""
    batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (2, 2, 10))]
    plain = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, selection="gradient"))
    select_by_gradient(plain, batches)
    checkpointed = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, selection="gradient"))
    checkpointed.train()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    checkpointed.enable_input_require_grads()
    select_by_gradient(checkpointed, batches)
    expected = indices_by_layer(plain)
    assert all(torch.equal(indices, expected[name]) for name, indices in indices_by_layer(checkpointed).items())


@pytest.mark.filterwarnings("ignore:Adapter 'default' uses selection='gradient'")
@pytest.mark.parametrize(
    ("prepare", "message"),
    [
        (lambda model: model.merge_adapter(), "is merged; unmerge it"),
        (lambda model: model.requires_grad_(False), r"does not train .* is_trainable=True"),
    ],
    ids=["merged", "not trainable"],
)
def test_gradient_selection_refuses_an_adapter_it_cannot_select_for_before_anything_changes(prepare, message):
    batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (1, 2, 10))]
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, selection="gradient"))
    prepare(model)
    before = indices_by_layer(model)
    with pytest.raises(ValueError, match=message):
        select_by_gradient(model, batches)
    assert all(torch.equal(indices, before[name]) for name, indices in indices_by_layer(model).items())


@pytest.mark.filterwarnings("ignore:Adapter 'default' uses selection='gradient'")
def test_gradient_selection_refuses_to_select_from_layers_no_gradient_reached():
    def first_block_only(model, batch):
        return model(**batch, output_hidden_states=True).hidden_states[1].sum()

    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, selection="gradient"))
    batch = {"input_ids": torch.randint(0, 128, (2, 10))}
    with pytest.raises(ValueError, match=r"No gradient reached the NeuroAda layer '.*layers\.1\..*'"):
        select_by_gradient(model, [batch], loss_of=first_block_only)


def test_gradient_selection_on_smollm2_moves_indices_and_restarts_deltas_at_zero(smollm2, smollm2_tokenizer):
    batch = smollm2_tokenizer(["Question: what is two plus two? Answer: four."], return_tensors="pt")
    with pytest.warns(UserWarning, match=r"until you call peft_neuroada\.[\w.]*select_by_gradient"):
        model = get_peft_model(smollm2, NeuroAdaConfig(k=1, selection="gradient"))
    layer = model.base_model.model.model.layers[3].mlp.down_proj
    by_magnitude = layer.placement("default").cols.clone()
    with torch.no_grad():  # deltas some training moved: they belong to the old inputs
        for name, delta in model.named_parameters():
            if "neuroada_delta" in name:
                delta.fill_(0.01)
    select_by_gradient(model, [{**batch, "labels": batch["input_ids"]}])
    assert not torch.equal(layer.placement("default").cols, by_magnitude)
    deltas = [delta for name, delta in model.named_parameters() if "neuroada_delta" in name]
    assert all(torch.count_nonzero(delta) == 0 for delta in deltas)


@pytest.mark.filterwarnings("ignore:Adapter 'default' uses selection='gradient'")
def test_reloading_a_gradient_selected_adapter_reproduces_its_indices_and_outputs(tmp_path, token_batch):
    """Gradient selection cannot be redone at load time (no batches): the saved indices must be used as they are."""
    batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (2, 2, 10))]
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, selection="gradient"))
    by_magnitude = indices_by_layer(model)
    select_by_gradient(model, batches)
    with torch.no_grad():  # stands in for training the re-placed deltas
        for name, parameter in model.named_parameters():
            if "neuroada_delta" in name:
                parameter.normal_(std=0.05)
    by_gradient = indices_by_layer(model)
    assert any(not torch.equal(by_gradient[name], indices) for name, indices in by_magnitude.items())
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    assert reloaded.peft_config["default"].selection == "gradient"
    reloaded_indices = indices_by_layer(reloaded)
    assert reloaded_indices.keys() == by_gradient.keys()
    assert all(torch.equal(reloaded_indices[name], indices) for name, indices in by_gradient.items())
    assert torch.equal(logits(reloaded, token_batch), logits(model, token_batch))
