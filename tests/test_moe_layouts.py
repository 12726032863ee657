"""Every MoE layout in the installed transformers: NeuroAda tunes k inputs per *output neuron* of each expert,
whichever axis a model keeps its neurons on ((E, d_out, d_in) read as F.linear, or (E, d_in, d_out) read as x @ W,
as GPT-OSS and Llama-4 keep theirs). Checked against a reference that knows no layout table: an expert projection
that reads the hidden state has d_in = hidden_size, one that writes it has d_out = hidden_size (the tiny configs keep
every other size apart from it). A layout nothing tells apart is refused, not guessed."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.budget import neuroada_parameter_count, targeted_shapes
from peft_neuroada.tuner.experts import ParamWrapper, expert_projections
from tests.conftest import tiny_gpt2

K = 3
HIDDEN = 32  # every expert size below differs from it: 24, 48, 96, 16
TOKENS = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
# The specs compare logits, so no call builds a cache: since transformers 5.25 NemotronH's forward reads the sequence
# length from a cache whose first layer is an MoE block, which has none, and fails in the reference model as well.
NO_CACHE = dict(use_cache=False)
SMALL = dict(vocab_size=100, pad_token_id=0, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4)
ROUTED = dict(num_key_value_heads=2, head_dim=8, num_experts_per_tok=2, intermediate_size=48)
LATENT = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4)
DEEPSEEK = dict(moe_intermediate_size=24, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=0)
# model type -> (config options, target_parameters; None: the default, the experts' gate_up/up/down projections)
MODELS: dict[str, tuple[dict, list[str] | None]] = {
    "mixtral": ({**ROUTED, "num_local_experts": 4}, None),
    "qwen2_moe": ({**ROUTED, "num_experts": 4, "moe_intermediate_size": 24}, None),
    "qwen3_moe": ({**ROUTED, "num_experts": 4, "moe_intermediate_size": 24}, None),
    "gpt_oss": ({**ROUTED, "num_local_experts": 4}, None),  # (E, d_in, d_out), flagged `is_transposed`
    "llama4_text": ({**ROUTED, "num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 64}, None),
    "olmoe": ({**ROUTED, "num_experts": 4}, None),
    "deepseek_v2": ({**ROUTED, **DEEPSEEK, **LATENT}, None),
    "deepseek_v3": ({**ROUTED, **DEEPSEEK, **LATENT}, None),
    "granitemoe": ({**ROUTED, "num_local_experts": 4}, None),
    "phimoe": ({**ROUTED, "num_local_experts": 4}, None),
    "minimax": ({**ROUTED, "num_local_experts": 4}, None),
    "hunyuan_v1_moe": ({**ROUTED, "num_experts": 4}, None),
    "ernie4_5_moe": ({**ROUTED, "moe_num_experts": 4, "moe_intermediate_size": 24}, None),
    "flex_olmo": ({**ROUTED, "num_experts": 4}, None),
    "nemotron_h": (  # no gate: up_proj and down_proj
        {
            **ROUTED,
            **DEEPSEEK,
            "layers_block_type": ["moe", "full_attention"],
            "moe_shared_expert_intermediate_size": 24,
        },
        None,
    ),
    "longcat_flash": (  # a zero expert: gate_up_proj holds one more expert than down_proj
        {**LATENT, "ffn_hidden_size": 48, "expert_ffn_hidden_size": 24, "n_routed_experts": 4, "moe_topk": 2},
        None,
    ),
    "jetmoe": (  # experts in the MLP and in the attention (MoA), each a `weight` of JetMoeParallelExperts
        {"num_key_value_heads": 2, "kv_channels": 8, "intermediate_size": 48, "num_local_experts": 4},
        ["input_linear.weight", "output_linear.weight"],
    ),
}
READS_THE_HIDDEN_STATE = ("gate", "up", "input_linear")  # else it writes it (down_proj, output_linear)


def tiny(model_type: str) -> nn.Module:
    options, _ = MODELS[model_type]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL, **options)).eval()


def config(model_type: str, **options) -> NeuroAdaConfig:
    """The experts only: the model type's own targets, or the default ones (`expert_projections`)."""
    targets = MODELS[model_type][1] or sorted({short for short, _ in expert_projections(tiny(model_type))})
    return NeuroAdaConfig(k=K, target_modules=[], target_parameters=targets, **options)


def adapted(model_type: str, **options) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(tiny(model_type), config(model_type, **options))


def wrappers(model: nn.Module) -> dict[str, ParamWrapper]:
    return {f"{name}.{m.parameter_name}": m for name, m in model.named_modules() if isinstance(m, ParamWrapper)}


def as_used(name: str, param: torch.Tensor) -> torch.Tensor:
    """The parameter as ((E,) d_out, d_in), told by where the hidden state goes in or comes out, not by any table."""
    reads = any(part in ".".join(name.split(".")[-2:]) for part in READS_THE_HIDDEN_STATE)
    hidden_axis = -1 if reads else -2
    assert HIDDEN in param.shape[-2:] and param.shape[-1] != param.shape[-2], (name, param.shape)
    return param if param.shape[hidden_axis] == HIDDEN else param.transpose(-2, -1)


@pytest.mark.parametrize("model_type", MODELS)
def test_each_expert_neuron_gets_the_top_k_inputs_of_its_own_row_as_the_forward_uses_the_weight(model_type):
    layers = wrappers(adapted(model_type))
    assert layers
    for name, layer in layers.items():
        weight = as_used(name, layer.get_param().detach())
        expected = weight.abs().topk(K, dim=-1).indices.sort(dim=-1).values.reshape(-1, K)
        assert torch.equal(layer.placement("default").cols.long(), expected), name


@pytest.mark.parametrize("model_type", MODELS)
def test_the_unmerged_adapter_computes_its_deltas_placed_by_the_reference_and_merging_keeps_it(model_type):
    model = adapted(model_type, init_weights=False)
    reference = tiny(model_type)
    with torch.no_grad():
        for name, layer in wrappers(model).items():
            target = reference.get_parameter(name.removeprefix("base_model.model.").replace(".base_layer", ""))
            dense = torch.zeros(as_used(name, target).shape)
            cols = layer.placement("default").cols.long()
            dense.view(-1, dense.shape[-1]).scatter_(1, cols, layer.neuroada_delta["default"].detach())
            as_used(name, target).add_(dense)
        unmerged = model(input_ids=TOKENS, **NO_CACHE).logits
        torch.testing.assert_close(unmerged, reference(input_ids=TOKENS, **NO_CACHE).logits, rtol=1e-5, atol=1e-5)
        model.merge_adapter()
        torch.testing.assert_close(model(input_ids=TOKENS, **NO_CACHE).logits, unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", MODELS)
def test_adapters_and_budgets_count_k_per_output_neuron_of_each_expert(model_type):
    model = adapted(model_type)
    neurons = sum(as_used(name, layer.get_param()).shape[:-1].numel() for name, layer in wrappers(model).items())
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == neurons * K
    assert neuroada_parameter_count(targeted_shapes(tiny(model_type), config(model_type)), K) == neurons * K


@pytest.mark.parametrize("target", ["mlp.w1", "mlp.w2"])
def test_dbrx_experts_whose_weights_their_parent_reads_are_refused_before_the_model_changes(target):
    """DbrxExperts reads w1, v1 and w2 of its DbrxExpertGLU and passes them in: deltas added for that module's call
    would never be read (and w2 holds each expert's (d_in, d_out) weight on rows)."""
    torch.manual_seed(0)
    ffn = {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}
    attention = {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 1e4}
    options = dict(d_model=HIDDEN, n_heads=4, n_layers=2, attn_config=attention, ffn_config=ffn, vocab_size=100)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("dbrx", **options))
    config = NeuroAdaConfig(k=K, target_modules=[], target_parameters=[target])
    name = target.rpartition(".")[2]
    with pytest.raises(
        ValueError, match=rf"'{name}' \(192, 32\) of DbrxExpertGLU .*WEIGHT_LAYOUTS\['DbrxExpertGLU'\]"
    ):
        get_peft_model(model, config)
    assert not any(isinstance(m, ParamWrapper) for m in model.modules())


class SquareExperts(nn.Module):
    """Experts of a class no table names, whose stack reads the same in either layout: (E, 16, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(4, 16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.proj)  # x: (E, tokens, d_in)


def test_a_stack_of_a_module_nothing_describes_is_refused_naming_it_and_what_to_do():
    model = nn.Sequential(SquareExperts())
    with pytest.raises(ValueError, match=r"'proj' \(4, 16, 16\) of SquareExperts.*no `is_transposed`.*WEIGHT_LAYOUTS"):
        get_peft_model(model, NeuroAdaConfig(k=K, target_modules=[], target_parameters=["0.proj"]))
    assert not any(isinstance(m, ParamWrapper) for m in model.modules())


def test_a_module_s_own_is_transposed_flag_tells_its_layout():
    experts = SquareExperts()
    experts.is_transposed = True  # bmm(x, W): W[e] is (d_in, d_out)
    layer = wrappers(
        get_peft_model(nn.Sequential(experts), NeuroAdaConfig(k=K, target_modules=[], target_parameters=["0.proj"]))
    )
    (wrapper,) = layer.values()
    expected = experts.proj.detach().transpose(1, 2).abs().topk(K, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(wrapper.placement("default").cols.long(), expected.reshape(-1, K))


def test_a_gpt2_conv1d_weight_named_as_a_parameter_is_tuned_per_output_neuron():
    config = NeuroAdaConfig(k=K, init_weights=False, target_modules=[], target_parameters=["mlp.c_fc.weight"])
    model = get_peft_model(tiny_gpt2(), config)
    for layer in wrappers(model).values():
        weight = layer.get_param().detach()  # Conv1D: (d_in, d_out)
        assert (layer.in_features, layer.out_features) == tuple(weight.shape)
        expected = weight.T.abs().topk(K, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.placement("default").cols.long(), expected)
