"""Quantized bases (QLoRA-style), on CPU: bitsandbytes 4-bit (nf4/fp4, with and without double quantization) and
8-bit, torchao int8 and int4 weight-only.

Selection reads the dequantized values a block of rows at a time; training never writes quantized storage; a saved
adapter reproduces its outputs on a freshly loaded quantized base and loads its indices as saved onto a full-precision
one; merging requantizes with a warning and unmerging restores the storage bit for bit; quantized layer types NeuroAda
cannot read are refused by name before anything changes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from conftest import logits, named_neuroada_layers, tiny_llama, train_on_batch
from peft import PeftModel, get_peft_model
from peft.utils.integrations import dequantize_module_weight
from torch import nn
from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
from torchao.quantization.granularity import PerGroup
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM, TorchAoConfig

import peft_neuroada.tuner.selection
from peft_neuroada import NeuroAdaConfig, k_for_budget
from peft_neuroada.budget import targeted_shapes
from peft_neuroada.quantized import Bnb8bit, QuantizedLinear, quantized_linear
from peft_neuroada.tuner.selection import select_inputs

QUANTIZATIONS: dict[str, Callable[[], object]] = {
    "bnb-nf4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "bnb-nf4-double": lambda: BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    ),
    "bnb-fp4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "bnb-fp4-double": lambda: BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True
    ),
    "bnb-int8": lambda: BitsAndBytesConfig(load_in_8bit=True),
    "torchao-int8": lambda: TorchAoConfig(quant_type=Int8WeightOnlyConfig()),
    "torchao-int4": lambda: TorchAoConfig(
        quant_type=IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    ),
}
EACH_QUANTIZATION = pytest.mark.parametrize("quantization", QUANTIZATIONS)
# The CPU here; on a machine with a CUDA GPU also the GPU, where QLoRA users train (bitsandbytes' CUDA kernels).
EACH_DEVICE = pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))


def save_llama(path: Path, hidden_size: int, intermediate_size: int) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose layers have 64 or 128 inputs: whole 4-bit scale blocks per row, as in real models."""
    return save_llama(tmp_path_factory.mktemp("tiny-llama"), hidden_size=64, intermediate_size=128)


def load(path: Path, quantization: str, device: str = "cpu") -> nn.Module:
    """The model quantized at load; on the GPU, bitsandbytes' (torchao's weight-only kinds are checked on CPU)."""
    if device != "cpu" and quantization.startswith("torchao"):
        pytest.skip("torchao's weight-only kinds are checked on the CPU")
    placement = {} if device == "cpu" else {"device_map": {"": device}}
    config = QUANTIZATIONS[quantization]()
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, **placement).eval()


def dequantized_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adaptable layer's weight dequantized by peft's own helper (independent of NeuroAda), by layer name."""
    return {
        name: dequantize_module_weight(module).float().clone()
        for name, module in model.named_modules()
        if name.endswith("_proj")
    }


def quantized_storage(module: nn.Module) -> list[torch.Tensor]:
    """Copies of every tensor that stores a quantized layer's weight: codes, scales, and their metadata."""
    weight = module.weight
    if isinstance(weight, bnb.nn.Params4bit):
        state = weight.quant_state.as_dict(packed=True).values()
        return [weight.data.clone(), *(t.clone() for t in state if isinstance(t, torch.Tensor))]
    if isinstance(weight, bnb.nn.Int8Params):
        scales = weight.SCB if weight.SCB is not None else module.state.SCB
        return [weight.data.clone(), scales.clone()]
    names, _ = weight.__tensor_flatten__()
    return [getattr(weight, name).clone() for name in names]


def storage_of(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    return {name: quantized_storage(layer.get_base_layer()) for name, layer in named_neuroada_layers(model).items()}


def assert_same_storage(before: dict[str, list[torch.Tensor]], after: dict[str, list[torch.Tensor]]) -> None:
    assert before.keys() == after.keys()
    for name in before:
        assert len(before[name]) == len(after[name]) and all(
            a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before[name], after[name], strict=True)
        ), f"quantized storage of {name} changed"


def trained(model: nn.Module, tokens: torch.Tensor, k: int = 2) -> nn.Module:
    peft_model = get_peft_model(model, NeuroAdaConfig(k=k))
    train_on_batch(peft_model, tokens, steps=3, lr=1e-2)
    return peft_model.eval()


@EACH_QUANTIZATION
def test_selection_reads_the_dequantized_weights_a_block_of_rows_at_a_time(
    tiny_dir, quantization, monkeypatch
) -> None:
    model = load(tiny_dir, quantization)
    expected = {name: select_inputs(weight, 2) for name, weight in dequantized_weights(model).items()}
    rows_read = []
    read_rows = QuantizedLinear.rows

    def recorded_rows(self: QuantizedLinear, start: int, stop: int) -> torch.Tensor:
        rows_read.append(stop - start)
        return read_rows(self, start, stop)

    monkeypatch.setattr(QuantizedLinear, "rows", recorded_rows)
    monkeypatch.setattr(QuantizedLinear, "dense", lambda self: pytest.fail("selection dequantized a whole layer"))
    monkeypatch.setattr(peft_neuroada.tuner.selection, "_MAX_BLOCK_ELEMENTS", 5 * 128)

    peft_model = get_peft_model(model, NeuroAdaConfig(k=2))

    for name, layer in named_neuroada_layers(peft_model).items():
        assert torch.equal(layer.placement("default").cols, expected[name.removeprefix("base_model.model.")]), name
    assert rows_read and max(rows_read) <= 10


def test_4bit_layers_whose_scale_blocks_span_rows_are_dequantized_one_whole_layer_at_a_time(tmp_path) -> None:
    model = load(save_llama(tmp_path, hidden_size=32, intermediate_size=48), "bnb-nf4-double")
    expected = {name: select_inputs(weight, 2) for name, weight in dequantized_weights(model).items()}

    peft_model = get_peft_model(model, NeuroAdaConfig(k=2))

    for name, layer in named_neuroada_layers(peft_model).items():
        assert torch.equal(layer.placement("default").cols, expected[name.removeprefix("base_model.model.")]), name


@EACH_QUANTIZATION
def test_any_rows_dequantize_to_the_same_values_as_the_whole_layer(tiny_dir, quantization) -> None:
    model = load(tiny_dir, quantization)
    layer = model.model.layers[0].mlp.down_proj
    whole = dequantize_module_weight(layer).float()
    quantized = quantized_linear(layer)

    assert quantized.shape == whole.shape and quantized.reads_rows()
    assert torch.equal(quantized[3:8], whole[3:8])
    assert torch.equal(quantized[torch.tensor([1, 4, 63])], whole[[1, 4, 63]])
    assert torch.equal(quantized.dense(), whole)


def test_selection_of_a_share_of_neurons_reads_their_dequantized_rows(tiny_dir) -> None:
    model = load(tiny_dir, "bnb-nf4-double")
    weights = dequantized_weights(model)

    peft_model = get_peft_model(model, NeuroAdaConfig(k=3, neuron_fraction=0.5))

    for name, layer in named_neuroada_layers(peft_model).items():
        rows = layer.neuroada_rows["default"].long()
        expected = select_inputs(weights[name.removeprefix("base_model.model.")][rows], 3)
        assert torch.equal(layer.placement("default").cols, expected), name


@EACH_QUANTIZATION
def test_peft_s_layer_status_and_the_repr_name_each_adapted_layers_quantization_backend(tiny_dir, quantization):
    """The layers hold peft's backend as `quantization_backend`, as LoRA's and SHiRA's do, and read and write the
    quantized weight through it."""
    peft_model = get_peft_model(load(tiny_dir, quantization), NeuroAdaConfig(k=2))
    layers = named_neuroada_layers(peft_model)
    names = {layer.quantization_backend.backend_name for layer in layers.values()}
    assert len(names) == 1 and None not in names
    (name,) = names
    statuses = peft_model.get_layer_status()
    assert {status.quantization_backend for status in statuses} == {name} and len(statuses) == len(layers)
    assert peft_model.get_model_status().quantization_backend == name
    assert f"quantization_backend='{name}'" in repr(next(iter(layers.values())))


@EACH_DEVICE
@EACH_QUANTIZATION
def test_training_changes_outputs_and_never_writes_quantized_storage(tiny_dir, quantization, token_batch, device):
    peft_model = get_peft_model(load(tiny_dir, quantization, device), NeuroAdaConfig(k=2))
    tokens = token_batch.to(device)
    before = storage_of(peft_model)
    base_output = logits(peft_model, tokens)

    losses = train_on_batch(peft_model, tokens, steps=3, lr=1e-2)
    adapted_output = logits(peft_model.eval(), tokens)

    assert losses[-1] < losses[0]
    assert (adapted_output - base_output).abs().max() > 1e-2
    assert_same_storage(before, storage_of(peft_model))


@EACH_DEVICE
@EACH_QUANTIZATION
def test_saved_adapter_reproduces_outputs_on_a_freshly_loaded_quantized_base(
    tiny_dir, quantization, token_batch, tmp_path, device
) -> None:
    tokens = token_batch.to(device)
    peft_model = trained(load(tiny_dir, quantization, device), tokens)
    expected = logits(peft_model, tokens)
    peft_model.save_pretrained(tmp_path)

    reloaded = PeftModel.from_pretrained(load(tiny_dir, quantization, device), tmp_path).eval()

    assert torch.equal(logits(reloaded, tokens), expected)


@EACH_DEVICE
@EACH_QUANTIZATION
def test_merge_requantizes_with_a_warning_and_unmerge_restores_the_storage_bit_for_bit(
    tiny_dir, quantization, token_batch, device
) -> None:
    tokens = token_batch.to(device)
    peft_model = trained(load(tiny_dir, quantization, device), tokens)
    adapted = logits(peft_model, tokens)
    with peft_model.disable_adapter():
        base = logits(peft_model, tokens)
    before = storage_of(peft_model)

    with pytest.warns(UserWarning, match="rounding errors: the merged weight is quantized again"):
        peft_model.merge_adapter()
    merged = logits(peft_model, tokens)
    merged_storage = storage_of(peft_model)

    assert all(
        any(not torch.equal(a, b) for a, b in zip(before[name], merged_storage[name], strict=False)) for name in before
    ), "merge must change every layer's quantized weight"
    assert (merged - adapted).abs().max() < (base - adapted).abs().max() / 3, "merged output must be ~ the adapter's"

    peft_model.unmerge_adapter()
    assert_same_storage(before, storage_of(peft_model))
    assert torch.equal(logits(peft_model, tokens), adapted)
    peft_model.add_adapter("after", NeuroAdaConfig(k=1))  # the weights put back read as quantized, as before
    assert torch.equal(logits(peft_model, tokens), adapted)

    with pytest.warns(UserWarning, match="rounding errors"):
        unloaded = peft_model.merge_and_unload()
    assert type(unloaded.model.layers[0].self_attn.q_proj) is type(
        load(tiny_dir, quantization, device).model.layers[0].self_attn.q_proj
    )
    assert torch.equal(logits(unloaded, tokens), merged)


def test_several_adapters_merge_in_turn_and_unmerge_to_the_original_storage(tiny_dir, token_batch) -> None:
    peft_model = trained(load(tiny_dir, "bnb-nf4-double"), token_batch)
    peft_model.add_adapter("other", NeuroAdaConfig(k=1, init_weights=False))
    peft_model.base_model.set_adapter(["default", "other"])
    both = logits(peft_model, token_batch)
    before = storage_of(peft_model)

    with pytest.warns(UserWarning, match="rounding errors"):
        peft_model.merge_adapter(["default", "other"])
    merged = logits(peft_model, token_batch)
    peft_model.unmerge_adapter()

    with peft_model.disable_adapter():
        base = logits(peft_model, token_batch)
    assert (merged - both).abs().max() < (base - both).abs().max() / 3
    assert_same_storage(before, storage_of(peft_model))
    assert torch.equal(logits(peft_model, token_batch), both)


def test_adding_an_adapter_while_one_is_merged_into_quantized_weights_is_refused_before_anything_changes(
    tiny_dir, token_batch
) -> None:
    peft_model = trained(load(tiny_dir, "bnb-nf4"), token_batch)
    with pytest.warns(UserWarning, match="rounding errors"):
        peft_model.merge_adapter()
    before, merged = storage_of(peft_model), logits(peft_model, token_batch)
    with pytest.raises(ValueError, match=r"Cannot add a NeuroAda adapter to '.*' while adapters are merged"):
        peft_model.add_adapter("other", NeuroAdaConfig(k=1))
    assert "other" not in peft_model.peft_config
    assert_same_storage(before, storage_of(peft_model))
    assert torch.equal(logits(peft_model, token_batch), merged)


def test_a_merge_that_fails_midway_leaves_every_quantized_layer_as_it_was(tiny_dir, token_batch, monkeypatch) -> None:
    peft_model = trained(load(tiny_dir, "bnb-int8"), token_batch)
    before = storage_of(peft_model)
    expected = logits(peft_model, token_batch)
    replace, calls = Bnb8bit.replace, []

    def failing_on_the_fifth_layer(self: Bnb8bit, weight: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected failure")
        replace(self, weight)

    monkeypatch.setattr(Bnb8bit, "replace", failing_on_the_fifth_layer)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="injected failure"):
        warnings.simplefilter("ignore")
        peft_model.merge_adapter()

    assert not any(layer.merged for layer in named_neuroada_layers(peft_model).values())
    assert_same_storage(before, storage_of(peft_model))
    assert torch.equal(logits(peft_model, token_batch), expected)


def test_adapter_from_a_quantized_base_loads_its_saved_indices_onto_the_full_precision_base(
    tiny_dir, token_batch, tmp_path
) -> None:
    peft_model = trained(load(tiny_dir, "bnb-nf4"), token_batch, k=1)
    saved_indices = {
        name: layer.placement("default").cols for name, layer in named_neuroada_layers(peft_model).items()
    }
    peft_model.save_pretrained(tmp_path)
    full_precision = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    float_selection = {name: select_inputs(weight, 1) for name, weight in dequantized_weights(full_precision).items()}

    reloaded = PeftModel.from_pretrained(full_precision, tmp_path).eval()
    layers = named_neuroada_layers(reloaded)
    adapted = logits(reloaded, token_batch)

    assert all(torch.equal(layers[name].placement("default").cols, saved_indices[name]) for name in saved_indices)
    assert any(
        not torch.equal(saved_indices[name], float_selection[name.removeprefix("base_model.model.")])
        for name in saved_indices
    ), "the float weights select differently somewhere, so the indices above were loaded, not selected again"
    torch.testing.assert_close(logits(reloaded.merge_and_unload(), token_batch), adapted)


def _packed_by_bitsandbytes_for_cpu_inference(model: nn.Module, tokens: torch.Tensor) -> bool:
    logits(model, tokens)  # bitsandbytes packs 4-bit weights on an eval forward without gradients (AVX512-BF16 CPUs)
    state = model.model.layers[0].self_attn.q_proj.weight.quant_state
    return bool(getattr(state, "packing_format_for_cpu", False))


def test_4bit_weights_packed_for_cpu_inference_before_the_adapter_is_added_are_refused(tiny_dir, token_batch) -> None:
    model = load(tiny_dir, "bnb-nf4")
    if not _packed_by_bitsandbytes_for_cpu_inference(model, token_batch):
        pytest.skip("bitsandbytes packs 4-bit weights for inference only on CPUs with AVX512-BF16")
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj'.*packed its 4-bit weight") as refusal:
        get_peft_model(model, NeuroAdaConfig(k=1))
    assert str(refusal.value).count("packed its 4-bit weight") == 1, "the reason is stated once for all its layers"
    assert isinstance(model.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)


def test_adapted_4bit_layers_stay_in_the_standard_layout_through_inference_and_saving(
    tiny_dir, token_batch, tmp_path
) -> None:
    peft_model = trained(load(tiny_dir, "bnb-nf4"), token_batch)
    before = storage_of(peft_model)
    expected = logits(peft_model, token_batch)

    peft_model.save_pretrained(tmp_path)

    assert_same_storage(before, storage_of(peft_model))
    assert torch.equal(logits(peft_model, token_batch), expected)


def test_bitsandbytes_layer_not_quantized_yet_is_refused_until_moved_to_its_device() -> None:
    model = tiny_llama()
    float_layer = model.model.layers[0].self_attn.q_proj
    layer = bnb.nn.Linear4bit(float_layer.in_features, float_layer.out_features, bias=False, quant_type="nf4")
    layer.load_state_dict(float_layer.state_dict())
    model.model.layers[0].self_attn.q_proj = layer
    config = NeuroAdaConfig(k=1, target_modules=["q_proj"])

    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj'.*not quantized yet"):
        get_peft_model(model, config)

    model.to("cpu")
    expected = select_inputs(dequantize_module_weight(model.model.layers[0].self_attn.q_proj).float(), 1)
    peft_model = get_peft_model(model, config)
    assert torch.equal(
        peft_model.base_model.model.model.layers[0].self_attn.q_proj.placement("default").cols, expected
    )


def test_torchao_merge_without_the_quantization_config_is_refused_before_anything_changes(token_batch) -> None:
    model = tiny_llama()
    quantize_(model.model, Int8WeightOnlyConfig())  # quantized directly: no transformers config to requantize with
    peft_model = get_peft_model(model, NeuroAdaConfig(k=1, init_weights=False))
    before = storage_of(peft_model)

    with pytest.raises(ValueError, match="torchao config .* is unknown"):
        peft_model.merge_adapter()

    assert not any(layer.merged for layer in named_neuroada_layers(peft_model).values())
    assert_same_storage(before, storage_of(peft_model))


def test_torchao_int4_weight_only_does_not_quantize_on_cpu() -> None:
    """Documents torchao's limit: Int4WeightOnlyConfig needs the mslk kernels (CUDA); IntxWeightOnlyConfig with
    weight_dtype=torch.int4 is the int4 weight-only form that runs on CPU (tested above as torchao-int4)."""
    with pytest.raises(ImportError, match="mslk"):
        quantize_(nn.Sequential(nn.Linear(128, 64)), Int4WeightOnlyConfig())


def _foreign_layer(module: str, name: str, **tensors: torch.Tensor) -> nn.Module:
    """An instance of a class named like another library's quantized layer, defined in that library's module."""
    cls = type(name, (nn.Module,), {"__module__": module, "forward": lambda self, x: x})
    layer = cls()
    layer.in_features = layer.out_features = 32
    for attribute, tensor in tensors.items():
        layer.register_buffer(attribute, tensor)
    return layer


PACKED = {"qweight": torch.zeros(4, 32, dtype=torch.int32)}
UNSUPPORTED_LAYERS = {
    "GPTQ (AutoGPTQ)": lambda: _foreign_layer(
        "auto_gptq.nn_modules.qlinear.qlinear_cuda_old", "QuantLinear", **PACKED
    ),
    "GPTQ/AWQ (GPT-QModel)": lambda: _foreign_layer(
        "gptqmodel.nn_modules.qlinear.torch", "TorchQuantLinear", **PACKED
    ),
    "AWQ (AutoAWQ)": lambda: _foreign_layer("awq.modules.linear.gemm", "WQLinear_GEMM", **PACKED),
    "HQQ": lambda: _foreign_layer("hqq.core.quantize", "HQQLinear", W_q=torch.zeros(16, 32, dtype=torch.uint8)),
    "EETQ": lambda: _foreign_layer("eetq.modules.qlinear", "EetqLinear", weight=torch.zeros(32, 32, dtype=torch.int8)),
    "transformers' EETQ": lambda: __import__("transformers.integrations.eetq", fromlist=["EetqLinear"]).EetqLinear(
        32, 32
    ),
    "AQLM": lambda: _foreign_layer("aqlm.inference", "QuantizedLinear", codes=torch.zeros(32, 4, dtype=torch.int16)),
    "an unknown integer weight": lambda: _foreign_layer(
        "my_lib.layers", "MyLinear", weight=torch.zeros(32, 32, dtype=torch.int8)
    ),
}


@pytest.mark.parametrize("kind", UNSUPPORTED_LAYERS)
def test_quantized_layer_types_neuroada_cannot_read_are_refused_by_name_before_anything_changes(kind) -> None:
    model = tiny_llama()
    layer = UNSUPPORTED_LAYERS[kind]()
    model.model.layers[1].self_attn.v_proj = layer

    with pytest.raises(TypeError, match=r"'model.layers.1.self_attn.v_proj'.*" + type(layer).__name__):
        get_peft_model(model, NeuroAdaConfig(k=1))

    assert model.model.layers[1].self_attn.v_proj is layer
    assert not named_neuroada_layers(model)


def test_smollm2_in_4bit_trains_saves_and_reloads(smollm2_path, smollm2_tokenizer, tmp_path) -> None:
    def load_4bit() -> nn.Module:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
        return AutoModelForCausalLM.from_pretrained(smollm2_path, quantization_config=config).eval()

    model = load_4bit()
    checked = {"model.layers.0.self_attn.q_proj": None, "model.layers.29.mlp.down_proj": None}
    for name in checked:
        checked[name] = select_inputs(dequantize_module_weight(model.get_submodule(name)).float(), 1)
    tokens = smollm2_tokenizer("The capital of France is Paris.", return_tensors="pt").input_ids
    peft_model = get_peft_model(model, NeuroAdaConfig(k=1, target_modules=["q_proj", "down_proj"]))
    layers = named_neuroada_layers(peft_model)
    before = storage_of(peft_model)
    base_output = logits(peft_model, tokens)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notices during training
        train_on_batch(peft_model, tokens, steps=1, lr=1e-2)
    adapted = logits(peft_model.eval(), tokens)
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(load_4bit(), tmp_path).eval()

    for name, expected in checked.items():
        assert torch.equal(layers[f"base_model.model.{name}"].placement("default").cols, expected), name
    assert (adapted - base_output).abs().max() > 1e-3
    assert_same_storage(before, storage_of(peft_model))
    assert torch.equal(logits(reloaded, tokens), adapted)


@EACH_QUANTIZATION
def test_budgets_count_a_quantized_layer_by_its_features_not_its_packed_storage(tiny_dir, quantization) -> None:
    float_model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    quantized = load(tiny_dir, quantization)
    config = NeuroAdaConfig()
    assert targeted_shapes(quantized, config) == targeted_shapes(float_model, config)
    assert k_for_budget(quantized, config, lora_rank=4) == k_for_budget(float_model, config, lora_rank=4)
