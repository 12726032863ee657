"""The variants the training-cost benchmark compares, each preparing a freshly loaded model: the frozen floor,
NeuroAda, and every peer that spends the same sparse or low-rank parameter budget another way.

On a MoE model (`MOE_MODELS`: experts kept as 3-D parameters, as transformers 5 keeps Qwen3-MoE's) NeuroAda and LoRA
adapt the attention projections and, through `target_parameters`, the experts' gate_up_proj and down_proj, at budgets
that count every expert's neurons; the variants that can only reach `nn.Linear` layers (`DENSE_ONLY`) are refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, ShiraConfig, SupertuningConfig, get_peft_model
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.accel import sparse_products
from peft_neuroada.budget import density_for_k, lora_rank_for_k, targeted_shapes
from peft_neuroada.cache import cache_root, save_model_folder_once
from peft_neuroada.train.default_model import default_model_path
from peft_neuroada.train.models import load_default_model
from peft_neuroada.tuner import forward
from peft_neuroada.tuner.config import LLAMA_STYLE_TARGETS
from peft_neuroada.tuner.experts import expert_projections
from peft_neuroada.tuner.layer import NeuroAdaLayer
from peft_neuroada.tuner.selection import select_inputs

# The budget: NeuroAda with k=20 sets the parameter budget LoRA and SHiRA are matched to.
BUDGET_K = 20
TARGETS = list(LLAMA_STYLE_TARGETS)


def llama_config(vocab: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, positions: int, **more):
    """A Llama config of these sizes (the benchmark's random models differ in nothing else)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        **more,
    )


def qwen3_moe_config(
    vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, experts: int, active: int, expert_mlp: int, **more
):
    """A Qwen3-MoE config of these sizes: every layer sparse (no dense MLP, no shared expert), head_dim hidden / heads
    up to 64, the experts as transformers 5 keeps them (one (E, 2 * expert_mlp, hidden) gate_up_proj and one
    (E, hidden, expert_mlp) down_proj parameter per layer), run by its default experts implementation."""
    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=min(64, hidden // heads),
        num_experts=experts,
        num_experts_per_tok=active,
        moe_intermediate_size=expert_mlp,
        intermediate_size=expert_mlp,  # unused: no layer is a dense MLP
        **more,
    )


RANDOM_CONFIGS = {
    # SmolLM2-135M's architecture with seeded random weights: the real model's costs where its package is missing
    # (a GPU machine, say).
    "smollm2-random": llama_config(49152, 576, 1536, 30, 9, 3, 8192, tie_word_embeddings=True),
    # ~0.50B parameters: the weights (2.0 GB in float32) dominate the activations of a 1 x 256 batch.
    "large-random": llama_config(32000, 1536, 4096, 16, 12, 4, 1024),
    # Llama-3.2-1B's shape (1.24B parameters), for GPU figures.
    "llama-1b-random": llama_config(128256, 2048, 8192, 16, 32, 8, 2048, tie_word_embeddings=True),
    "tiny": llama_config(256, 64, 128, 2, 4, 2, 128),
    # A random Qwen3-MoE of 0.39B parameters (0.30B in the experts, 16 per layer, 2 active per token; 91M active per
    # token with the LM head): Qwen3-30B-A3B's layout scaled down to step in seconds on a 2-core CPU.
    "qwen3-moe": qwen3_moe_config(32000, 1024, 8, 16, 4, 16, 2, 768, max_position_embeddings=2048),
    "tiny-moe": qwen3_moe_config(256, 64, 2, 4, 2, 4, 2, 32, max_position_embeddings=128),
}
MODEL_CLASSES = {LlamaConfig: LlamaForCausalLM, Qwen3MoeConfig: Qwen3MoeForCausalLM}
# The models whose experts are 3-D parameters (reached through target_parameters, not as nn.Linear layers).
MOE_MODELS = {name for name, config in RANDOM_CONFIGS.items() if isinstance(config, Qwen3MoeConfig)}


# --------------------------------------------------------------------------------------------------- models


QUANTIZATIONS = {
    # QLoRA's base: 4-bit NormalFloat weights, double quantization, compute in the model's dtype.
    "nf4": lambda dtype: BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
    ),
}


def build_model(name: str, dtype: torch.dtype, quantize: str | None = None) -> PreTrainedModel:
    """The real SmolLM2-135M, or a seeded random Llama (weights need not be trained to cost the same); with
    `quantize`, loaded through bitsandbytes as a QLoRA user would."""
    if quantize is not None:
        path = default_model_path() if name == "smollm2" else saved_random_model(name)
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, quantization_config=QUANTIZATIONS[quantize](dtype)
        )
    if name == "smollm2":
        model, _ = load_default_model(dtype=dtype)
        return model
    torch.manual_seed(0)
    config = RANDOM_CONFIGS[name]
    return MODEL_CLASSES[type(config)](config).to(dtype)


def saved_random_model(name: str) -> Path:
    """The seeded random model saved once under the cache, so every process can load it quantized."""
    path = cache_root() / "benchmarks" / name
    if not (path / "config.json").exists():
        save_model_folder_once(path, build_model(name, torch.float32).save_pretrained)
    return path


def targeted_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The layers every variant adapts: the same q/k/v/o/gate/up/down projections NeuroAda targets by default."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            yield name, module


def expert_parameters(model: nn.Module) -> list[str]:
    """The experts' 3-D projections every variant adapts on a MoE model, as target_parameters names (e.g.
    'experts.gate_up_proj'); none on a dense model."""
    return sorted({short for short, _ in expert_projections(model)})


def module_targets(model: nn.Module) -> list[str]:
    """The target_modules of NeuroAda and LoRA: TARGETS, or on a MoE model those of them that are its nn.Linear layers
    (Qwen3-MoE: attention q/k/v/o). Named there, the experts' gate_proj/up_proj/down_proj would be read by peft's LoRA
    as transformers 4's expert layers and turned into target_parameters, the fused gate_up_proj at twice the rank."""
    if not expert_parameters(model):
        return TARGETS
    return sorted({name.rsplit(".", 1)[-1] for name, _ in targeted_linears(model)})


def budget_shapes(model: nn.Module, k: int = BUDGET_K) -> list[tuple[int, int]]:
    """(d_out, d_in) of every weight the variants adapt, each expert of an expert stack on its own."""
    config = NeuroAdaConfig(k=k, target_modules=module_targets(model), target_parameters=expert_parameters(model))
    return targeted_shapes(model, config)


def budget_rank(model: nn.Module, k: int = BUDGET_K) -> int:
    """LoRA/SHiRA rank whose parameter count on the adapted weights comes closest to NeuroAda's with this k."""
    return lora_rank_for_k(budget_shapes(model, k), k)


def refuse_experts(model: nn.Module, method: str) -> None:
    """Variants that replace or wrap nn.Linear layers cannot reach experts kept as 3-D parameters: on such a model
    they would tune attention alone and compare nothing."""
    if experts := expert_parameters(model):
        raise ValueError(
            f"{method} adapts nn.Linear layers only and cannot reach this MoE model's experts ({', '.join(experts)}: "
            "3-D parameters); run it on a dense model."
        )


def top_k_columns(weight: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the k largest-|w| input columns (as the paper code selects them), int64."""
    with torch.no_grad():
        return weight.abs().topk(k, dim=1).indices


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


# ------------------------------------------------------------------------------------------------- variants

# A variant prepares the model in place (or wraps it) and returns the model to run and the parameters to optimize.
Setup = tuple[nn.Module, list[nn.Parameter], str]


def frozen_floor(model: PreTrainedModel) -> Setup:
    """What any adapter must at least pay: forward plus backward of input gradients through a frozen model."""
    model.requires_grad_(False)
    model.enable_input_require_grads()
    return model, [], "floor (frozen, input grads)"


def peft_variant(model: PreTrainedModel, config, label: str) -> Setup:
    peft_model = get_peft_model(model, config)
    return peft_model, [p for p in peft_model.parameters() if p.requires_grad], label


def neuroada(k: int, delta_dtype: str | None = None) -> Callable[[PreTrainedModel], Setup]:
    """NeuroAda with k deltas per neuron, on its default forward path; deltas in `delta_dtype` (None: peft's choice,
    float32 on a half-precision base; the paper code keeps them in the model's bf16)."""

    def setup(model: PreTrainedModel) -> Setup:
        config = NeuroAdaConfig(
            k=k,
            target_modules=module_targets(model),
            target_parameters=expert_parameters(model) or None,
            delta_dtype=delta_dtype,
        )
        return peft_variant(model, config, f"neuroada k={k}")

    return setup


def neuroada_triton(model: PreTrainedModel) -> Setup:
    """NeuroAda k=20 with the opt-in Triton delta gradient (`peft_neuroada.accel.use_triton`; torch's off CUDA)."""
    from peft_neuroada.accel import use_triton

    peft_model, trainable, _ = neuroada(BUDGET_K)(model)
    use_triton(peft_model)
    return peft_model, trainable, f"neuroada k={BUDGET_K}, triton delta gradient"


def neuroada_delta_grad(product: str) -> Callable[[PreTrainedModel], Setup]:
    """NeuroAda k=20 with one delta-gradient candidate on every device: "gathered" (`forward.sampled_grad`, the
    tuner's: one GEMM, gathered) or "sparse" (`sparse_products.sampled_grad`, the plugin's on the CPU)."""
    function = {"gathered": forward.sampled_grad, "sparse": sparse_products.sampled_grad}[product]

    def setup(model: PreTrainedModel) -> Setup:
        peft_model, trainable, _ = neuroada(BUDGET_K)(model)
        for layer in peft_model.modules():
            if isinstance(layer, NeuroAdaLayer):
                layer.kernels = layer.kernels._replace(sampled_grad=function)
        return peft_model, trainable, f"neuroada k={BUDGET_K}, {product} delta gradient"

    return setup


def neuroada_frozen(model: PreTrainedModel) -> Setup:
    """NeuroAda k=20 with its deltas frozen: the adapted layers' own cost (forward and input gradient through
    W + P⊙Θ) without the delta gradient, so the step-time excess over the floor splits into its two parts."""
    peft_model, _, _ = neuroada(BUDGET_K)(model)
    return frozen_floor(peft_model)[0], [], f"neuroada k={BUDGET_K}, deltas frozen"


def lora(rank: int | None) -> Callable[[PreTrainedModel], Setup]:
    """LoRA at a fixed rank, or (rank None) at the rank matching NeuroAda k=20's parameter count."""

    def setup(model: PreTrainedModel) -> Setup:
        r = rank or budget_rank(model)
        experts = expert_parameters(model) or None  # LoRA adapts no expert unless named
        targets = module_targets(model)
        config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets, target_parameters=experts)
        return peft_variant(model, config, f"lora r={r}" + ("" if rank else " (budget)"))

    return setup


def shira(rank: int | None = None, seed: int = 0) -> Callable[[PreTrainedModel], Setup]:
    """SHiRA (r(m + n) random entries of an m x n weight) at a fixed rank, or (rank None) at the rank matching NeuroAda
    k=20's parameter count; `seed` draws its entries."""

    def setup(model: PreTrainedModel) -> Setup:
        refuse_experts(model, "SHiRA (peft's ShiraConfig has no target_parameters)")
        r = rank or budget_rank(model)
        config = ShiraConfig(r=r, random_seed=seed, target_modules=TARGETS)
        return peft_variant(model, config, f"shira r={r}" + ("" if rank else " (budget)"))

    return setup


def supertuning(k: int = BUDGET_K) -> Callable[[PreTrainedModel], Setup]:
    """peft's Super-Tuning (magnitude-selected sparse entries, the upstream counterpart of NeuroAda) at the density
    that gives it NeuroAda's parameter count with this k."""

    def setup(model: PreTrainedModel) -> Setup:
        refuse_experts(model, "Super-Tuning (peft's SupertuningConfig has no target_parameters)")
        density = density_for_k(targeted_shapes(model, NeuroAdaConfig(k=k, target_modules=TARGETS)), k)
        config = SupertuningConfig(sparsity=1.0 - density, target_modules=TARGETS)
        return peft_variant(
            model, config, f"supertuning {100 * density:.2f}%" + (" (budget)" if k == BUDGET_K else "")
        )

    return setup


class ScatterAddLinear(nn.Module):
    """The NeuroAda paper code's forward: rebuild W + scatter(delta) as a new dense tensor at every call."""

    def __init__(self, base: nn.Linear, k: int) -> None:
        super().__init__()
        self.base = base
        rows = torch.arange(base.out_features, device=base.weight.device).unsqueeze(1) * base.in_features
        self.register_buffer("positions", (rows + top_k_columns(base.weight, k)).flatten())
        self.delta = nn.Parameter(torch.zeros(base.out_features * k, device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.base.weight
        merged = weight.flatten().scatter_add(0, self.positions, self.delta.to(weight.dtype)).view_as(weight)
        return F.linear(x, merged, self.base.bias)


def paper_scatter_add(model: PreTrainedModel, k: int = BUDGET_K) -> Setup:
    refuse_experts(model, "The paper code's scatter_add forward")
    model.requires_grad_(False)
    for name, layer in list(targeted_linears(model)):
        replace_module(model, name, ScatterAddLinear(layer, k))
    return model, [p for p in model.parameters() if p.requires_grad], f"paper scatter_add k={k}"


def mask_based(model: PreTrainedModel, k: int = BUDGET_K) -> Setup:
    """Sparse tuning the usual way: dense trainable weights whose gradients are masked to the top-k entries, chosen
    by NeuroAda's own rule (`select_inputs`: equal magnitudes go to the lower column, where torch.topk's order is
    unspecified), so both train the same entries."""
    refuse_experts(model, "Mask-based sparse tuning")
    model.requires_grad_(False)
    params = []
    for _, layer in targeted_linears(model):
        weight = layer.weight
        mask = torch.zeros_like(weight, dtype=torch.bool).scatter_(1, select_inputs(weight, k).long(), True)
        weight.requires_grad_(True)
        weight.register_hook(lambda grad, mask=mask: grad * mask)
        params.append(weight)
    return model, params, f"mask-based k={k} (dense grads)"


def full_finetune(model: PreTrainedModel) -> Setup:
    model.requires_grad_(True)
    return model, list(model.parameters()), "full fine-tuning"


VARIANTS: dict[str, Callable[[PreTrainedModel], Setup]] = {
    "floor": frozen_floor,
    "neuroada-k1": neuroada(1),
    "neuroada-k20": neuroada(BUDGET_K),
    "neuroada-k20-frozen": neuroada_frozen,
    "neuroada-k20-triton": neuroada_triton,
    "neuroada-k20-dense-grad": neuroada_delta_grad("gathered"),
    "neuroada-k20-sparse-grad": neuroada_delta_grad("sparse"),
    "lora-budget": lora(None),
    "lora-r8": lora(8),
    "shira-budget": shira(),
    "supertuning-budget": supertuning(),
    "paper-scatter-k20": paper_scatter_add,
    "mask-k20": mask_based,
    "full": full_finetune,
}
# The variants refused on MOE_MODELS (`refuse_experts`).
DENSE_ONLY = {"shira-budget", "supertuning-budget", "paper-scatter-k20", "mask-k20"}
