"""Unloading keeps what peft keeps for LoRA on the same call: the selected adapter's trained `modules_to_save` copy
(a classification head, an `lm_head`), peft's refusals of an ambiguous selection, and its fix-ups, on whichever peft
is installed. LoRA, built on the same base with the same trained head, is the control of every case."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from transformers import LlamaConfig, LlamaForSequenceClassification

from peft_neuroada import NeuroAdaLayer
from tests.conftest import tiny_llama
from tests.test_lora_control import lora, neuroada, outputs


def classifier() -> LlamaForSequenceClassification:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)  # fmt: skip
    return LlamaForSequenceClassification(config).eval()


def trained(build, config, head: str, adapters: tuple[str, ...] = ("one",), **options) -> torch.nn.Module:
    """A PeftModel of `config` per adapter name, each adapter's `head` copy moved by its own seed (training)."""
    model = get_peft_model(build(), config(modules_to_save=[head], **options), adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, config(modules_to_save=[head], **options))
    wrapper = model.get_submodule(f"base_model.model.{head}")
    for seed, name in enumerate(adapters, start=1):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in wrapper.modules_to_save[name].parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator))
    return model


CASES = {
    "seq-cls head": (classifier, "score", {"task_type": "SEQ_CLS"}),
    "lm_head": (tiny_llama, "lm_head", {}),
}


@pytest.mark.parametrize("case", CASES)
def test_merge_and_unload_keeps_the_trained_head_and_merges_the_deltas(case):
    build, head, options = CASES[case]
    expected = {}
    for config in (neuroada, lora):
        model = trained(build, config, head, **options)
        expected[config] = outputs(model)
        merged = model.merge_and_unload()
        torch.testing.assert_close(outputs(merged), expected[config], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected[neuroada], outputs(build()))  # the head and the deltas changed the outputs


@pytest.mark.parametrize("case", CASES)
def test_unload_returns_the_head_lora_s_unload_returns(case):
    """peft 0.22 gives back the original module where 0.21 gave the active copy: the same as LoRA either way."""
    build, head, options = CASES[case]
    heads = {}
    for config in (neuroada, lora):
        unloaded = trained(build, config, head, **options).unload()
        heads[config] = unloaded.get_submodule(head).weight
    torch.testing.assert_close(heads[neuroada], heads[lora], rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_merging_one_of_two_adapters_keeps_that_adapter_s_head(case):
    build, head, options = CASES[case]
    model = trained(build, neuroada, head, adapters=("one", "two"), **options)
    model.set_adapter("two")
    expected = outputs(model)
    model.set_adapter("one")
    merged = model.merge_and_unload(adapter_names=["two"])
    torch.testing.assert_close(outputs(merged), expected, rtol=1e-5, atol=1e-5)
    control = trained(build, lora, head, adapters=("one", "two"), **options)
    control.set_adapter("one")
    control_head = control.merge_and_unload(adapter_names=["two"]).get_submodule(head)
    torch.testing.assert_close(merged.get_submodule(head).weight, control_head.weight, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_merging_two_adapters_that_both_save_the_head_is_refused_before_anything_changes(case):
    build, head, options = CASES[case]
    model = trained(build, neuroada, head, adapters=("one", "two"), **options)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="Only one adapter can be set at a time"):
        model.merge_and_unload(adapter_names=["one", "two"])
    control = trained(build, lora, head, adapters=("one", "two"), **options)
    with pytest.raises(ValueError, match="Only one adapter can be set at a time"):
        control.merge_and_unload(adapter_names=["one", "two"])
    assert not any(layer.merged for layer in model.modules() if isinstance(layer, NeuroAdaLayer))
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
