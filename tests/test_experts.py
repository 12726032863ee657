"""Today's models: MoE experts kept as 3-D parameters (transformers 5) are adapted through `target_parameters` as
peft's LoRA adapts them, top-k per neuron of each expert, and train, save, load, merge and unmerge as exactly as
linear layers; the default targets adapt every projection of the paper's set a model has, fused ones included, and a
target set that leaves projections out says which."""

from __future__ import annotations

import copy
import warnings
from concurrent.futures import ThreadPoolExecutor

import accelerate
import pytest
import torch
from conftest import TINY_MOE, logits, tiny_causal_lm, train_on_batch
from peft import LoraConfig, PeftModel, get_peft_model
from torch.nn.utils import parametrize

from peft_neuroada import NeuroAdaConfig, NeuroAdaLayer, select_by_gradient
from peft_neuroada.budget import neuroada_parameter_count, targeted_shapes
from peft_neuroada.tuner.experts import ParamWrapper
from peft_neuroada.tuner.forward import placed_entries

MOE = sorted(TINY_MOE)
TOKENS = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
INTERMEDIATE, HIDDEN = 48, 32  # tiny_causal_lm's mixtral


def tiny(model_type: str, experts_implementation: str | None = None):
    options = {"experts_implementation": experts_implementation} if experts_implementation else {}
    return tiny_causal_lm(model_type, **options)


def expert_wrappers(model) -> dict[str, ParamWrapper]:
    return {f"{name}.{m.parameter_name}": m for name, m in model.named_modules() if isinstance(m, ParamWrapper)}


def expert_weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.dim() == 3}


def quiet_peft_model(model, config, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, config, **options)


def with_deltas_written_in(peft_model):
    """An independent reference: the plain model (unloaded, not merged) with each layer's dense delta added into the
    weight it adapts."""
    model = copy.deepcopy(peft_model)
    writes = [
        (layer.get_param() if isinstance(layer, ParamWrapper) else layer.get_base_layer().weight, layer)
        for layer in model.modules()
        if isinstance(layer, NeuroAdaLayer)
    ]
    writes = [(weight, layer.get_delta_weight("default")) for weight, layer in writes]
    plain = model.unload()
    with torch.no_grad():
        for weight, delta in writes:
            weight.add_(delta.to(weight.dtype))
    return plain


@pytest.mark.parametrize("model_type", MOE)
def test_default_targets_adapt_the_experts_projections_top_k_per_neuron_of_each_expert(model_type):
    model = quiet_peft_model(tiny(model_type), NeuroAdaConfig(k=3))
    wrappers = expert_wrappers(model)
    assert sorted(model.peft_config["default"].target_parameters) == ["experts.down_proj", "experts.gate_up_proj"]
    assert len(wrappers) == 4  # two layers, two expert projections each
    for layer in wrappers.values():
        stack = layer.weight_out_in()  # (E, d_out, d_in) whatever the module's layout
        cols = layer.placement("default").cols.long().view(stack.shape[0], stack.shape[1], 3)
        expected = stack.abs().topk(3, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(cols, expected)
        assert layer.neuroada_delta["default"].shape == (stack.shape[0] * stack.shape[1], 3)


@pytest.mark.parametrize("model_type", MOE)
def test_an_unmerged_expert_adapter_computes_the_model_with_its_deltas_written_into_the_weights(model_type):
    model = quiet_peft_model(tiny(model_type), NeuroAdaConfig(k=2, init_weights=False))
    reference = with_deltas_written_in(model)
    torch.testing.assert_close(logits(model, TOKENS), logits(reference, TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_the_experts_own_forward_is_kept_whichever_implementation_runs_it(implementation):
    try:
        base = tiny("mixtral", experts_implementation=implementation)
    except (ValueError, ImportError) as error:
        pytest.skip(f"transformers has no '{implementation}' experts here: {error}")
    model = quiet_peft_model(base, NeuroAdaConfig(k=2, init_weights=False))
    torch.testing.assert_close(
        logits(model, TOKENS), logits(with_deltas_written_in(model), TOKENS), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("model_type", MOE)
def test_expert_delta_gradients_are_the_dense_weight_gradient_sampled_at_the_placements(model_type):
    model = quiet_peft_model(tiny(model_type), NeuroAdaConfig(k=2, init_weights=False))
    model.train()
    model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    reference = with_deltas_written_in(model).train()
    for param in reference.parameters():
        param.requires_grad_(param.dim() == 3)
    reference(input_ids=TOKENS, labels=TOKENS).loss.backward()
    reference_params = dict(reference.named_parameters())
    for name, layer in expert_wrappers(model).items():
        dense = reference_params[name.removeprefix("base_model.model.").replace(".base_layer", "")].grad
        expected = placed_entries(layer._oriented(dense), layer.placement("default"))
        torch.testing.assert_close(layer.neuroada_delta["default"].grad, expected, rtol=1e-5, atol=1e-6)
        assert layer.get_param().grad is None  # the experts stay frozen


@pytest.mark.parametrize("model_type", MOE)
def test_merging_expert_deltas_serves_the_unmerged_outputs_bit_for_bit_and_unmerging_restores_the_weights(model_type):
    model = quiet_peft_model(tiny(model_type), NeuroAdaConfig(k=2, init_weights=False))
    before = expert_weights(model)
    with torch.no_grad():
        unmerged = logits(model, TOKENS)
        model.merge_adapter()
        # (few tokens without gradients: the attention layers add their bypass after the matmul)
        torch.testing.assert_close(logits(model, TOKENS), unmerged)
        model.unmerge_adapter()
    after = expert_weights(model)
    assert all(torch.equal(after[name], weight) for name, weight in before.items())


@pytest.mark.parametrize("model_type", MOE)
def test_a_trained_expert_adapter_saves_loads_and_merges_into_a_plain_model(model_type, tmp_path):
    model = quiet_peft_model(tiny(model_type), NeuroAdaConfig(k=2))
    frozen = expert_weights(model)
    losses = train_on_batch(model, TOKENS, steps=6, lr=3e-2)
    assert losses[-1] < losses[0]
    assert all(torch.equal(weight, frozen[name]) for name, weight in expert_weights(model).items())
    assert all(layer.neuroada_delta["default"].abs().sum() > 0 for layer in expert_wrappers(model).values())
    model.eval()
    trained = logits(model, TOKENS)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny(model_type), tmp_path)
    assert torch.equal(logits(loaded, TOKENS), trained)
    merged = loaded.merge_and_unload()
    assert not expert_wrappers(merged)
    torch.testing.assert_close(logits(merged, TOKENS), trained, rtol=1e-5, atol=1e-5)


def test_a_second_expert_adapter_joins_the_same_wrappers_and_deleting_it_leaves_the_first_unchanged():
    model = quiet_peft_model(tiny("mixtral"), NeuroAdaConfig(k=2, init_weights=False))
    first = logits(model, TOKENS)
    model.add_adapter("other", NeuroAdaConfig(k=1, init_weights=False))
    assert len(expert_wrappers(model)) == 4
    model.set_adapter("other")
    assert not torch.equal(logits(model, TOKENS), first)
    model.set_adapter("default")
    model.delete_adapter("other")
    assert all("other" not in layer.neuroada_delta for layer in expert_wrappers(model).values())
    assert torch.equal(logits(model, TOKENS), first)


def test_adapters_with_other_target_parameters_are_refused_before_the_model_changes():
    model = quiet_peft_model(tiny("mixtral"), NeuroAdaConfig(k=1))
    before = {name: layer.neuroada_delta.keys() for name, layer in expert_wrappers(model).items()}
    with pytest.raises(ValueError, match="must all target the same parameters"):
        model.add_adapter("other", NeuroAdaConfig(k=1, target_parameters=["experts.down_proj"]))
    assert {name: layer.neuroada_delta.keys() for name, layer in expert_wrappers(model).items()} == before


def test_expert_adapters_refuse_mixed_batches_as_lora_does():
    model = quiet_peft_model(tiny("mixtral"), NeuroAdaConfig(k=1)).eval()
    with pytest.raises(ValueError, match="mixed batches"):
        model(input_ids=TOKENS, adapter_names=["default", "__base__"])


def test_phi3_defaults_adapt_its_fused_qkv_and_gate_up_projections_without_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(tiny("phi3"), NeuroAdaConfig(k=1))
    adapted = {name.rpartition(".")[2] for name, m in model.named_modules() if hasattr(m, "neuroada_delta")}
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert not [w for w in caught if "unadapted" in str(w.message)]


@pytest.mark.parametrize(
    ("model_type", "config", "left_out"),
    [
        ("mixtral", NeuroAdaConfig(target_modules=["q_proj", "v_proj"]), "experts.gate_up_proj"),
        ("phi3", NeuroAdaConfig(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), "self_attn.qkv_proj"),
        ("mixtral", NeuroAdaConfig(target_parameters=["experts.down_proj"]), "experts.gate_up_proj"),
    ],
)
def test_targets_that_leave_projections_out_warn_once_naming_them(model_type, config, left_out):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(tiny(model_type), config)
    warned = [str(w.message) for w in caught if "unadapted" in str(w.message)]
    assert len(warned) == 1 and f"model.layers.0.{'mlp' if 'experts' in left_out else ''}" in warned[0]
    assert left_out in warned[0]


def test_naming_no_expert_weights_on_purpose_adapts_none_and_says_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(tiny("mixtral"), NeuroAdaConfig(target_modules=["q_proj"], target_parameters=[]))
    assert not expert_wrappers(model) and not [w for w in caught if "unadapted" in str(w.message)]


def test_expert_weights_on_the_meta_device_are_refused_before_any_layer_changes():
    with torch.device("meta"):
        base = tiny("mixtral")
    with pytest.raises(ValueError, match="experts.down_proj.*meta device"):
        get_peft_model(base, NeuroAdaConfig(k=1, target_modules=[], target_parameters=["experts.down_proj"]))
    assert not any(isinstance(m, ParamWrapper) or hasattr(m, "neuroada_delta") for m in base.modules())


def test_expert_adapters_cost_about_what_lora_target_parameters_cost_in_trainable_parameters():
    # At k=r the two methods train the same count per expert neuron pair: NeuroAda k per output neuron, LoRA r per
    # input and output feature; the count differs, the mechanism (target_parameters) is the same.
    neuroada = quiet_peft_model(tiny("mixtral"), NeuroAdaConfig(target_modules=[], target_parameters=["gate_up_proj"]))
    lora = quiet_peft_model(tiny("mixtral"), LoraConfig(r=1, target_modules=[], target_parameters=["gate_up_proj"]))
    n_trainable = sum(p.numel() for p in neuroada.parameters() if p.requires_grad)
    lora_trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    experts, d_out, d_in = 4, 2 * INTERMEDIATE, HIDDEN
    assert n_trainable == 2 * experts * d_out  # k=1: one delta per neuron of every expert, two layers
    assert lora_trainable == 2 * experts * (d_out + d_in)


def test_on_the_real_smollm2_a_weight_targeted_as_a_parameter_trains_as_its_layer_targeted_as_a_module(smollm2):
    # No pretrained MoE model ships offline; a 2-D weight through target_parameters runs the same wrapper.
    tokens = torch.tensor([[1, 504, 3458, 314, 260, 3799, 282, 4704]])
    as_module = quiet_peft_model(copy.deepcopy(smollm2), NeuroAdaConfig(k=4, target_modules=["down_proj"]))
    as_parameter = quiet_peft_model(
        smollm2, NeuroAdaConfig(k=4, target_modules=[], target_parameters=["mlp.down_proj.weight"])
    )
    for model in (as_module, as_parameter):
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "neuroada_delta" in name:
                torch.nn.init.normal_(param, std=0.01)
    torch.testing.assert_close(logits(as_parameter, tokens), logits(as_module, tokens), rtol=1e-4, atol=1e-4)
    for model in (as_module, as_parameter):
        model.train()
        model(input_ids=tokens, labels=tokens).loss.backward()
    grads = [
        [p.grad for n, p in model.named_parameters() if "neuroada_delta" in n] for model in (as_module, as_parameter)
    ]
    assert len(grads[0]) == len(grads[1]) == 30
    for by_module, by_parameter in zip(*grads, strict=True):
        torch.testing.assert_close(by_parameter, by_module, rtol=1e-3, atol=1e-6)


def test_an_exception_inside_the_experts_forward_leaves_their_weights_plain_and_unchanged(monkeypatch):
    model = quiet_peft_model(tiny("mixtral"), NeuroAdaConfig(k=2, init_weights=False))
    before = expert_weights(model)
    experts = next(iter(expert_wrappers(model).values())).get_base_layer()

    def failing_forward(*args, **kwargs):
        assert parametrize.is_parametrized(experts)  # reading W + P ⊙ Θ, not W
        raise KeyboardInterrupt

    monkeypatch.setattr(experts, "forward", failing_forward)
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=TOKENS)
    assert not parametrize.is_parametrized(experts)
    assert all(torch.equal(weight, before[name]) for name, weight in expert_weights(model).items())


def test_gradient_selection_of_expert_weights_is_refused_before_any_input_is_selected_again():
    model = quiet_peft_model(tiny("mixtral"), NeuroAdaConfig(k=1, selection="gradient"))
    indices = {name: layer.placement("default").cols.clone() for name, layer in expert_wrappers(model).items()}
    with pytest.raises(ValueError, match="Gradient selection does not reach NeuroAda expert weights"):
        select_by_gradient(model, [{"input_ids": TOKENS, "labels": TOKENS}])
    assert all(
        torch.equal(layer.placement("default").cols, indices[name]) for name, layer in expert_wrappers(model).items()
    )


def test_threads_calling_one_unmerged_expert_adapter_get_the_single_threaded_result_bit_for_bit():
    model = quiet_peft_model(tiny("mixtral"), NeuroAdaConfig(k=2, init_weights=False))
    batches = [torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(seed)) for seed in range(8)]
    expected = [logits(model, batch) for batch in batches]
    before = expert_weights(model)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda batch: logits(model, batch), batches * 3))
    assert all(torch.equal(got, expected[i % 8]) for i, got in enumerate(results))
    assert all(torch.equal(weight, before[name]) for name, weight in expert_weights(model).items())


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
def test_offloading_an_unmerged_expert_adapter_is_refused_naming_offloading_and_merged_it_serves(offload, tmp_path):
    model = quiet_peft_model(tiny("mixtral"), NeuroAdaConfig(k=2, init_weights=False))
    expected = logits(model, TOKENS)
    offloaded = copy.deepcopy(model)

    def options(folder: str) -> dict:
        return {"offload_dir": str(tmp_path / folder)} if offload == "disk_offload" else {}

    getattr(accelerate, offload)(offloaded, execution_device="cpu", **options("adapted"))
    with pytest.raises(ValueError, match="cannot run offloaded by accelerate"):
        offloaded(input_ids=TOKENS)
    merged = model.merge_and_unload()
    getattr(accelerate, offload)(merged, execution_device="cpu", **options("merged"))
    torch.testing.assert_close(logits(merged, TOKENS), expected, rtol=1e-5, atol=1e-5)


def test_a_layer_merge_into_offloaded_expert_weights_is_refused_naming_the_model_s_merge():
    model = quiet_peft_model(tiny("mixtral"), NeuroAdaConfig(k=2, init_weights=False))
    accelerate.cpu_offload(model, execution_device="cpu")
    wrapper = next(iter(expert_wrappers(model).values()))
    with pytest.raises(ValueError, match=r"meta device.*merge_adapter\(\)"):
        wrapper.merge()
    assert wrapper.merged_adapters == [] and not wrapper._merge_originals


@pytest.mark.parametrize("model_type", MOE)
def test_budgets_count_every_neuron_of_every_expert_as_the_adapter_creates_them(model_type):
    shapes = targeted_shapes(tiny(model_type), NeuroAdaConfig(k=3))
    model = quiet_peft_model(tiny(model_type), NeuroAdaConfig(k=3))
    assert neuroada_parameter_count(shapes, 3) == sum(p.numel() for p in model.parameters() if p.requires_grad)
