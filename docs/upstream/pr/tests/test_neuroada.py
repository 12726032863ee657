"""NeuroAda's own behaviour, beyond peft's generic tuner tests: which inputs each neuron tunes, merges that unmerge
bit for bit, how the indices are stored and reloaded, the deltas' gradient, `neuroada_dropout`, MoE experts reached
through `target_parameters`, mixed batches, offloading and quantized merges. Every model is built here from a config,
so nothing needs the Hub."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from peft import NeuroAdaConfig, PeftModel, get_peft_model
from peft.import_utils import is_transformers_ge_v5
from peft.tuners.neuroada.experts import ParamWrapper
from peft.utils import infer_device


torch_device = infer_device()


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 24, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.lin0 = nn.Linear(d_in, hidden, dtype=dtype)
        self.lin1 = nn.Linear(hidden, 4, dtype=dtype)

    def forward(self, x):
        return self.lin1(torch.relu(self.lin0(x)))


def tuned_entries(model, name: str = "lin0", adapter_name: str = "default") -> torch.Tensor:
    """Where a layer's adapter has its deltas: the non-zero entries of its dense delta (random: init_weights=False)."""
    return (model.base_model.model.get_submodule(name).get_delta_weight(adapter_name) != 0).cpu()


def neuroada_mlp(base: nn.Module | None = None, **config_kwargs):
    torch.manual_seed(0)
    kwargs = {"target_modules": ["lin0"], "init_weights": False, **config_kwargs}
    return get_peft_model((base if base is not None else MLP()).to(torch_device), NeuroAdaConfig(**kwargs))


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's own parameters (no adapter's) as they are now, on the CPU, named as before any adapter was added."""
    own = {}
    for name, param in model.named_parameters():
        if "neuroada_" not in name:
            key = name.replace(".base_layer", "").replace(".parametrizations.", ".").removesuffix(".original")
            own[key] = param.detach().cpu().clone()
    return own


def bit_equal(tensors: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> bool:
    return tensors.keys() == other.keys() and all(torch.equal(tensors[name], other[name]) for name in tensors)


def top_k_mask(weight: torch.Tensor, k: int, largest: bool = True) -> torch.Tensor:
    indices = weight.abs().topk(k, dim=-1, largest=largest).indices
    return torch.zeros_like(weight, dtype=torch.bool).scatter_(-1, indices, True)


class TestNeuroAdaSelection:
    def test_every_neuron_tunes_its_k_largest_inputs(self):
        model = neuroada_mlp(k=3)
        weight = model.base_model.model.lin0.get_base_layer().weight
        assert torch.equal(tuned_entries(model), top_k_mask(weight, 3))

    def test_inputs_of_equal_magnitude_go_to_the_lower_column(self):
        base = MLP()
        with torch.no_grad():
            base.lin0.weight.fill_(0.5)
            base.lin0.weight[:, ::2] *= -1  # equal magnitudes, both signs
        entries = tuned_entries(neuroada_mlp(base, k=2))
        assert entries[:, :2].all()
        assert entries.sum() == 2 * entries.shape[0]

    def test_reverse_selection_tunes_the_smallest_inputs(self):
        model = neuroada_mlp(k=3, selection="reverse")
        weight = model.base_model.model.lin0.get_base_layer().weight
        assert torch.equal(tuned_entries(model), top_k_mask(weight, 3, largest=False))

    def test_random_selection_follows_its_seed(self):
        first, again = neuroada_mlp(k=3, selection="random"), neuroada_mlp(k=3, selection="random")
        other = neuroada_mlp(k=3, selection="random", selection_seed=1)
        assert torch.equal(tuned_entries(first), tuned_entries(again))
        assert not torch.equal(tuned_entries(first), tuned_entries(other))
        assert (tuned_entries(first).sum(dim=1) == 3).all()

    def test_neuron_fraction_tunes_that_share_of_the_neurons(self):
        entries = tuned_entries(neuroada_mlp(k=2, neuron_fraction=0.5))
        tuned_rows = entries.any(dim=1)
        assert tuned_rows.sum() == 12
        assert (entries[tuned_rows].sum(dim=1) == 2).all()

    def test_k_above_a_layer_s_inputs_tunes_all_of_them_with_a_warning(self):
        with pytest.warns(UserWarning, match="exceeds"):
            model = neuroada_mlp(k=40)
        assert tuned_entries(model).all()


class TestNeuroAdaMerge:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_unmerge_restores_the_base_weights_bit_for_bit(self, dtype):
        base = MLP(dtype=dtype)
        original = weights(base)
        model = neuroada_mlp(base, k=4, target_modules=["lin0", "lin1"])
        model.add_adapter("other", NeuroAdaConfig(k=2, target_modules=["lin0"], init_weights=False))
        model.base_model.set_adapter(["default", "other"])  # both merge, overlapping on lin0
        model.merge_adapter()
        assert not bit_equal(weights(base), original)
        model.unmerge_adapter()
        assert bit_equal(weights(base), original)

    def test_the_merged_model_computes_what_the_adapter_computes(self):
        model = neuroada_mlp(k=3, target_modules=["lin0", "lin1"])
        x = torch.randn(5, 16, device=torch_device)
        adapted = model(x)
        merged = model.merge_and_unload()
        assert torch.allclose(merged(x), adapted, atol=1e-6)


class TestNeuroAdaIndexStorage:
    def test_saved_indices_are_one_int32_column_per_delta(self, tmp_path):
        neuroada_mlp(k=3, target_modules=["lin0", "lin1"]).save_pretrained(tmp_path)
        tensors = load_file(tmp_path / "adapter_model.safetensors")
        deltas = {key: value for key, value in tensors.items() if "neuroada_delta" in key}
        assert len(deltas) == 2
        for key, delta in deltas.items():
            indices = tensors[key.replace("neuroada_delta", "neuroada_indices")]
            assert indices.dtype == torch.int32 and indices.shape == delta.shape  # (n, k) columns, the row implicit

    @pytest.mark.parametrize("d_in", [16, 40_000])  # a narrow layer, and one wider than int16's columns
    def test_a_reloaded_adapter_keeps_its_entries_on_other_base_weights(self, tmp_path, d_in):
        model = neuroada_mlp(MLP(d_in=d_in, hidden=6), k=3)
        model.save_pretrained(tmp_path)
        other_base = MLP(d_in=d_in, hidden=6)  # other weights: selecting again would pick other inputs
        loaded = PeftModel.from_pretrained(other_base, tmp_path)
        assert torch.equal(tuned_entries(loaded), tuned_entries(model))
        delta, reloaded = (m.base_model.model.lin0.get_delta_weight("default") for m in (model, loaded))
        assert torch.equal(delta.cpu(), reloaded.cpu())


class TestNeuroAdaGradients:
    def test_the_deltas_get_the_dense_weight_gradient_at_their_entries(self):
        model = neuroada_mlp(k=3)
        layer = model.base_model.model.lin0
        x = torch.randn(8, 16, device=torch_device)
        model(x).square().sum().backward()
        weight = (layer.get_base_layer().weight.detach() + layer.get_delta_weight("default")).requires_grad_()
        hidden = torch.relu(torch.nn.functional.linear(x, weight, layer.get_base_layer().bias))
        out = model.base_model.model.lin1(hidden)
        out.square().sum().backward()
        entries = tuned_entries(model).to(weight.device)
        expected = weight.grad[entries].view(-1, 3)
        assert torch.allclose(layer.neuroada_delta["default"].grad, expected, atol=1e-5)


class TestNeuroAdaDropout:
    def test_in_training_only_the_deltas_read_the_dropped_input(self):
        model = neuroada_mlp(k=3, neuroada_dropout=0.5)
        layer = model.base_model.model.lin0
        x = torch.randn(8, 16, device=torch_device)
        torch.manual_seed(0)
        out = layer(x)
        torch.manual_seed(0)
        dropped = nn.functional.dropout(x, 0.5, training=True)
        base = layer.get_base_layer()
        expected = base(x) + nn.functional.linear(dropped, layer.get_delta_weight("default"))
        assert torch.allclose(out, expected, atol=1e-5)

    def test_out_of_training_nothing_is_dropped(self):
        model = neuroada_mlp(k=3, neuroada_dropout=0.5).eval()
        x = torch.randn(8, 16, device=torch_device)
        unmerged = model(x)
        model.merge_adapter()
        assert torch.allclose(model(x), unmerged, atol=1e-5)


def tiny_moe() -> Qwen3MoeForCausalLM:
    """A Qwen3-MoE whose experts are 3-D parameters (transformers 5): 4 experts, 2 active per token."""
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        intermediate_size=8,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).to(torch_device)


@pytest.mark.skipif(not is_transformers_ge_v5, reason="experts are 3-D parameters from transformers 5 on")
class TestNeuroAdaExperts:
    def test_every_expert_neuron_tunes_its_k_largest_inputs(self):
        model = get_peft_model(tiny_moe(), NeuroAdaConfig(k=2, init_weights=False))  # default targets
        wrappers = [module for module in model.modules() if isinstance(module, ParamWrapper)]
        assert {wrapper.parameter_name for wrapper in wrappers} == {"gate_up_proj", "down_proj"}
        for wrapper in wrappers:
            weight = wrapper.get_param()  # (experts, outputs, inputs)
            assert torch.equal(wrapper.get_delta_weight("default") != 0, top_k_mask(weight, 2))

    def test_merged_experts_compute_what_the_adapter_computes_and_unmerge_exactly(self):
        base = tiny_moe()
        original = weights(base)
        model = get_peft_model(base, NeuroAdaConfig(k=2, init_weights=False))
        input_ids = torch.arange(12, device=torch_device).view(2, 6)
        adapted = model(input_ids=input_ids).logits
        model.merge_adapter()
        assert torch.allclose(model(input_ids=input_ids).logits, adapted, atol=1e-5)
        model.unmerge_adapter()
        assert bit_equal(weights(base), original)


class TestNeuroAdaMixedBatches:
    def test_each_row_gets_the_output_of_its_own_adapter(self):
        model = neuroada_mlp(k=2)
        model.add_adapter("other", NeuroAdaConfig(target_modules=["lin0"], k=3, init_weights=False))
        model.eval()
        x = torch.randn(3, 16, device=torch_device)
        with torch.no_grad():
            mixed = model(x, adapter_names=["default", "other", "__base__"])
            expected = []
            for row, name in enumerate(["default", "other"]):
                model.set_adapter(name)
                expected.append(model(x[row : row + 1]))
            with model.disable_adapter():
                expected.append(model(x[2:]))
        assert torch.allclose(mixed, torch.cat(expected), atol=1e-6)


class TestNeuroAdaOffload:
    def test_an_adapter_offloaded_by_accelerate_computes_as_before(self):
        from accelerate import cpu_offload

        model = neuroada_mlp(k=2)
        x = torch.randn(4, 16, device=torch_device)
        with torch.no_grad():
            expected = model(x)
            cpu_offload(model, execution_device=torch_device, offload_buffers=True)
            assert torch.allclose(model(x), expected, atol=1e-6)

    def test_a_merge_into_4bit_weights_warns_and_unmerges_bit_for_bit(self, tmp_path):
        pytest.importorskip("bitsandbytes")
        from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
        LlamaForCausalLM(config).save_pretrained(tmp_path)
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
        base = LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=quantization, device_map=torch_device)
        model = get_peft_model(base, NeuroAdaConfig(k=2, init_weights=False))
        # bitsandbytes packs 4-bit weights for inference on some CPUs, which the merge then refuses
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        stored = layer.get_base_layer().weight.detach().clone()
        input_ids = torch.arange(8, device=torch_device).view(1, 8)
        adapted = model(input_ids=input_ids).logits.detach()
        with pytest.warns(UserWarning, match="rounding"):
            model.merge_adapter()
        assert torch.allclose(model(input_ids=input_ids).logits, adapted, atol=0.1)
        model.unmerge_adapter()
        assert torch.equal(layer.get_base_layer().weight.detach(), stored)
