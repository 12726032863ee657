"""accelerate's offloading of a model that holds an adapter serves and merges it as LoRA's: the deltas and indices
come into memory with their layer for each visit and go back after it. A base offloaded before an adapter is added is
refused, since selection reads its weights, with a message that gives the way round: add, then offload."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from accelerate import cpu_offload, disk_offload, dispatch_model, infer_auto_device_map
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers import AutoModelForCausalLM

from peft_neuroada import NeuroAdaConfig
from tests.conftest import TINY_LLAMA_DISK_MAP, tiny_llama

# Offloaded base layers are hooked, so NeuroAda layers take the bypass on them; the reference takes it too and the two
# agree bit for bit (the merged copy rounds W + Δ before the matmul: within 2e-7 on these models).
CONFIGS = {
    "neuroada": lambda: NeuroAdaConfig(k=2, init_weights=False),
    "lora": lambda: LoraConfig(r=2, init_lora_weights=False),
}
# The tiny Llama's modules with one decoder block on disk, and the same modules under a PeftModel.
DEVICE_MAP = TINY_LLAMA_DISK_MAP
PEFT_DEVICE_MAP = {f"base_model.model.{name}": device for name, device in DEVICE_MAP.items()}


def with_device_map(model: nn.Module, folder: Path) -> None:
    dispatch_model(model, device_map=PEFT_DEVICE_MAP, main_device="cpu", offload_dir=folder)


def with_inferred_device_map(model: nn.Module, folder: Path) -> None:
    """Whatever does not fit in 60 kB of CPU memory on disk: this splits a decoder block, and adapted layers."""
    device_map = infer_auto_device_map(model, max_memory={"cpu": 60_000})
    assert "disk" in device_map.values()
    dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=folder)


OFFLOADS: dict[str, Callable[[nn.Module, Path], None]] = {
    "cpu_offload": lambda model, folder: cpu_offload(model, execution_device="cpu"),
    "cpu_offload-with-buffers": lambda model, folder: cpu_offload(model, execution_device="cpu", offload_buffers=True),
    "disk_offload": lambda model, folder: disk_offload(model, folder, execution_device="cpu"),
    "device_map": with_device_map,
    "inferred-device_map": with_inferred_device_map,
}


def adapted_llama(method: str, entry: str, folder: Path) -> nn.Module:
    model = get_peft_model(tiny_llama(), CONFIGS[method]())
    if entry == "from_pretrained":
        model.save_pretrained(folder / "adapter")
        model = PeftModel.from_pretrained(tiny_llama(), folder / "adapter")
    return model.eval()


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("method", CONFIGS)
@pytest.mark.parametrize("entry", ["get_peft_model", "from_pretrained"])
@pytest.mark.parametrize("offload", OFFLOADS)
def test_offloading_after_the_adapter_is_added_serves_and_merges_it_as_lora(method, entry, offload, tmp_path):
    model = adapted_llama(method, entry, tmp_path)
    reference = copy.deepcopy(model)
    OFFLOADS[offload](model, tmp_path / "offload")
    tokens = torch.randint(0, 128, (2, 6))
    assert torch.equal(logits(model, tokens), logits(reference, tokens))
    prefix = model.base_model.prefix  # of the adapter's parameters: offloaded between calls
    assert any(p.is_meta for name, p in model.named_parameters() if prefix in name)
    assert torch.equal(logits(model, tokens), logits(reference, tokens))  # brought in again for the next call
    merged, merged_reference = model.merge_and_unload(), reference.merge_and_unload()
    assert torch.equal(logits(merged, tokens), logits(merged_reference, tokens))


@pytest.mark.parametrize("method", CONFIGS)
def test_an_adapter_loaded_onto_an_offloaded_base_works_as_lora_or_is_refused_with_the_way_round(
    method, tmp_path, monkeypatch
):
    """LoRA loads onto a base its device map offloads (peft takes the hooks off the base and dispatches the PeftModel
    again); NeuroAda refuses, before any layer is replaced, and says to add the adapter first and offload after, which
    then serves it as without offloading. (peft has taken the base's hooks off by then: load the base again.)"""
    # peft 0.21's `_update_offload` rebuilds the offloaded base file's path with os.path.join(*path.split(os.sep)),
    # which drops the leading "/", and writes a copy of it under the working directory: keep it in tmp_path.
    monkeypatch.chdir(tmp_path)
    tiny_llama().save_pretrained(tmp_path / "base")
    get_peft_model(tiny_llama(), CONFIGS[method]()).save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", device_map=DEVICE_MAP, offload_folder=tmp_path / "offload"
    )
    offloading = {"device_map": PEFT_DEVICE_MAP, "offload_folder": tmp_path / "adapter-offload"}
    reference = PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter").eval()
    tokens = torch.randint(0, 128, (2, 6))
    if method == "lora":
        model = PeftModel.from_pretrained(base, tmp_path / "adapter", **offloading).eval()
    else:
        refusal = r"'model\.layers\.1\.self_attn\.q_proj'.*offloaded.* add the adapter, and then offload the PeftModel"
        with pytest.raises(ValueError, match=refusal):
            PeftModel.from_pretrained(base, tmp_path / "adapter", **offloading)
        assert not any(isinstance(module, BaseTunerLayer) for module in base.modules())
        in_memory = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        model = PeftModel.from_pretrained(in_memory, tmp_path / "adapter").eval()
        with_device_map(model, tmp_path / "offload-after")
    assert torch.equal(logits(model, tokens), logits(reference, tokens))
