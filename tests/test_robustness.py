"""Bad input gets a clear, specific error and never corrupts or loses a model or an adapter on disk."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import safetensors.torch
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from peft_neuroada import NeuroAdaConfig, safe_io
from tests.conftest import logits, neuroada_layers, real_minilm, tiny_bert, tiny_llama


@pytest.fixture
def saved_adapter(tmp_path):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    model.save_pretrained(tmp_path)
    return model, tmp_path


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "corrupt-header"])
def test_damaged_weights_file_is_named_in_a_clear_error(saved_adapter, damage):
    _, adapter_dir = saved_adapter
    weights = adapter_dir / "adapter_model.safetensors"
    data = weights.read_bytes()
    damaged = {"truncated": data[: len(data) // 2], "zeroed": bytes(len(data)), "corrupt-header": data[:8] + b"{x"}
    weights.write_bytes(damaged[damage])
    with pytest.raises(ValueError, match=r"adapter weights file '.*adapter_model\.safetensors' is damaged"):
        PeftModel.from_pretrained(tiny_llama(), adapter_dir)


def test_unknown_config_fields_are_ignored_with_a_warning(saved_adapter, token_batch):
    model, adapter_dir = saved_adapter
    config_path = adapter_dir / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "from_the_future": 1}))
    with pytest.warns(UserWarning, match=r"Unexpected keyword arguments \['from_the_future'\]"):
        loaded = PeftModel.from_pretrained(tiny_llama(), adapter_dir)
    assert torch.equal(logits(loaded, token_batch), logits(model, token_batch))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("k", 0, "k must be a positive integer"), ("selection", "best", "selection must be one of")],
)
def test_invalid_config_fields_are_refused_by_name(saved_adapter, field, value, message):
    _, adapter_dir = saved_adapter
    config_path = adapter_dir / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), field: value}))
    with pytest.raises(ValueError, match=message):
        PeftModel.from_pretrained(tiny_llama(), adapter_dir)


@pytest.mark.parametrize("saved_dtype", [torch.int16, torch.int32, torch.int64])
def test_n_by_k_indices_in_any_integer_dtype_load_like_int32_ones(saved_adapter, token_batch, saved_dtype):
    """(n, k) int16 columns are the layout of adapters saved before 2026-11-25."""
    model, adapter_dir = saved_adapter
    weights = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(weights)
    layers = [key.removesuffix(".neuroada_delta") for key in tensors if key.endswith(".neuroada_delta")]
    for layer in layers:
        tensors[f"{layer}.neuroada_indices"] = tensors[f"{layer}.neuroada_indices"].to(saved_dtype)
    save_file(tensors, weights)
    for low_cpu_mem_usage in (False, True):
        loaded = PeftModel.from_pretrained(tiny_llama(), adapter_dir, low_cpu_mem_usage=low_cpu_mem_usage)
        layers = neuroada_layers(loaded)
        assert all(layer.placement("default").cols.dtype == torch.int32 for layer in layers)
        assert torch.equal(logits(loaded, token_batch), logits(model, token_batch))


def test_a_thousand_merge_unmerge_cycles_leave_weights_bit_identical():
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, init_weights=False))
    model.add_adapter("second", NeuroAdaConfig(k=2, init_weights=False, neuron_fraction=0.5))
    model.base_model.set_adapter(["default", "second"])
    original = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    for _ in range(1000):
        model.merge_adapter()
        model.unmerge_adapter()
    assert all(torch.equal(p, original[n]) for n, p in model.named_parameters() if "base_layer" in n)


def test_interrupted_save_into_an_existing_directory_keeps_the_previous_adapter(saved_adapter, token_batch):
    model, adapter_dir = saved_adapter
    expected = logits(model, token_batch)
    other = get_peft_model(tiny_llama(), NeuroAdaConfig(k=5, init_weights=False))

    def interrupted_write(tensors, filename, metadata=None):
        with open(filename, "wb") as partial:
            partial.write(b"half an adapter")
        raise KeyboardInterrupt

    with mock.patch.object(safetensors.torch, "save_file", interrupted_write), pytest.raises(KeyboardInterrupt):
        other.save_pretrained(adapter_dir)
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert torch.equal(logits(PeftModel.from_pretrained(tiny_llama(), adapter_dir), token_batch), expected)


def test_saving_twice_replaces_the_adapter_completely(saved_adapter, token_batch):
    _, adapter_dir = saved_adapter
    newer = get_peft_model(tiny_llama(), NeuroAdaConfig(k=5, init_weights=False))
    newer.save_pretrained(adapter_dir)
    reloaded = PeftModel.from_pretrained(tiny_llama(), adapter_dir)
    assert reloaded.peft_config["default"].k == 5
    assert torch.equal(logits(reloaded, token_batch), logits(newer, token_batch))


def test_two_saves_of_one_adapter_file_at_once_leave_one_of_them_whole(tmp_path):
    """Threads or processes saving the same adapter file at the same time each write a temporary file of their own."""
    filename = tmp_path / "adapter_model.safetensors"
    versions = [{"layer.neuroada_delta.default": torch.full((4, 2), float(i))} for i in range(2)]
    both_writing = threading.Barrier(2, timeout=30)
    real_save = safetensors.torch.save_file

    def save_side_by_side(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        both_writing.wait()

    with mock.patch.object(safetensors.torch, "save_file", save_side_by_side), ThreadPoolExecutor(2) as pool:
        for saving in [pool.submit(safe_io.save_file, tensors, filename) for tensors in versions]:
            saving.result()
    saved = load_file(filename)["layer.neuroada_delta.default"]
    assert any(torch.equal(saved, version["layer.neuroada_delta.default"]) for version in versions)
    assert [p.name for p in tmp_path.iterdir()] == [filename.name]


@pytest.fixture
def saved_minilm_adapter(tmp_path):
    """An adapter of the real MiniLM encoder, saved to disk."""
    get_peft_model(real_minilm(), NeuroAdaConfig(k=2, init_weights=False)).save_pretrained(tmp_path)
    return tmp_path


def test_truncated_real_minilm_adapter_file_is_named_in_a_clear_error(saved_minilm_adapter):
    weights = saved_minilm_adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"adapter weights file '.*adapter_model\.safetensors' is damaged"):
        PeftModel.from_pretrained(real_minilm(), saved_minilm_adapter)


def test_real_minilm_adapter_on_a_narrower_bert_names_the_first_layer_that_does_not_fit(saved_minilm_adapter):
    """Same architecture and module names, other widths: refused by layer name instead of a bare shape error."""
    with pytest.raises(
        ValueError, match=r"does not fit the base model at layer '.*encoder\.layer\.0\.attention\.self\.query'"
    ):
        PeftModel.from_pretrained(tiny_bert(), saved_minilm_adapter)
