"""The in-place fast path writes only into plain, frozen, dense weights that its layer alone holds. Every other weight
takes the non-mutating path, which computes the same result and never writes into the weight; weights NeuroAda cannot
even read (offloaded, meta) are refused with a clear error before the model changes."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.layers import Linear
from tests.conftest import TINY_LLAMA_DISK_MAP, logits, neuroada_layers, tiny_llama


class Tagged(torch.Tensor):
    """A trivial tensor subclass, standing in for quantized and distributed tensor types."""


def plain(base: nn.Linear) -> nn.Linear:
    return base


def subclass_weight(base: nn.Linear) -> nn.Linear:
    base.weight = nn.Parameter(base.weight.detach().as_subclass(Tagged), requires_grad=False)
    return base


def view_into_a_larger_buffer(base: nn.Linear) -> nn.Linear:
    buffer = torch.cat([base.weight.detach(), torch.zeros_like(base.weight)])
    base.weight = nn.Parameter(buffer[: base.out_features], requires_grad=False)
    return base


def trainable_weight(base: nn.Linear) -> nn.Linear:
    return base.requires_grad_(True)


def trainable_bias(base: nn.Linear) -> nn.Linear:
    base.bias.requires_grad_(True)
    return base


def hooked(base: nn.Linear) -> nn.Linear:
    base.register_forward_hook(lambda module, args, out: out)
    return base


def backward_hooked(base: nn.Linear) -> nn.Linear:
    base.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    return base


def in_shared_memory(base: nn.Linear) -> nn.Linear:
    return base.share_memory()  # other processes may read it: no lock of this process covers them


# Each situation, what `FrozenLinear.refusal` must say about it (None: the in-place path runs), and the path taken.
SITUATIONS = {
    "plain": (plain, None, "in place"),
    "tensor-subclass": (subclass_weight, "the weight is a Tagged", "general"),
    "view-into-larger-buffer": (view_into_a_larger_buffer, "a view into a larger buffer", "direct"),
    "trainable-weight": (trainable_weight, "the base layer's weight trains", "general"),
    "trainable-bias": (trainable_bias, None, "in place"),
    "forward-hook": (hooked, "forward hooks", "general"),
    "backward-hook": (backward_hooked, "backward hooks", "general"),
    "shared-memory": (in_shared_memory, "shared memory", "direct"),
}


def make_layer(situation) -> Linear:
    torch.manual_seed(0)
    base = situation(nn.Linear(12, 10).requires_grad_(False))
    return Linear(base, "default", NeuroAdaConfig(k=3, init_weights=False))


def dense_reference(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    weight = layer.weight_out_in().detach().as_subclass(torch.Tensor) + layer.get_delta_weight("default")
    return nn.functional.linear(x, weight, layer.get_base_layer().bias)


def path_taken(layer: Linear) -> str:
    return layer.frozen().path().name


@pytest.mark.parametrize(("situation", "refusal", "path"), SITUATIONS.values(), ids=SITUATIONS.keys())
def test_the_fast_path_runs_only_where_nothing_refuses_it(situation, refusal, path):
    layer = make_layer(situation)
    reason = layer.frozen().path().reason
    assert reason == refusal if refusal is None else refusal in reason
    assert path_taken(layer) == path


@pytest.mark.parametrize(("situation", "refusal", "path"), SITUATIONS.values(), ids=SITUATIONS.keys())
def test_every_path_computes_the_adapted_layer_and_leaves_the_weight_as_it_was(situation, refusal, path):
    layer = make_layer(situation)
    weight = layer.get_base_layer().weight
    before, version = weight.detach().clone(), weight._version
    x = torch.randn(2, 5, 12, requires_grad=True)
    out = layer(x)
    torch.testing.assert_close(out, dense_reference(layer, x), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    assert torch.equal(weight.detach(), before)
    if refusal is not None:
        assert weight._version == version  # never written, not even restored


HOOKS = {
    "forward-pre": lambda count: nn.modules.module.register_module_forward_pre_hook(lambda m, args: count(m)),
    "forward": lambda count: nn.modules.module.register_module_forward_hook(lambda m, args, out: count(m)),
    "full-backward": lambda count: nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: count(m)),
}


@pytest.mark.parametrize("register", HOOKS.values(), ids=HOOKS.keys())
def test_hooks_registered_for_every_module_see_the_base_layer_called_as_under_lora(register):
    layer = make_layer(plain)
    base, calls = layer.get_base_layer(), []
    handle = register(lambda module: calls.append(module is base))
    try:
        x = torch.randn(2, 5, 12, requires_grad=True)
        out = layer(x)
        out.sum().backward()
    finally:
        handle.remove()
    assert calls.count(True) == 1
    torch.testing.assert_close(out, dense_reference(layer, x), rtol=1e-5, atol=1e-5)


def test_a_trainable_base_weight_gets_its_dense_gradient():
    layer = make_layer(trainable_weight)
    x = torch.randn(4, 12)
    layer(x).square().sum().backward()
    reference = layer.weight_out_in().detach().clone().requires_grad_(True)
    delta = layer.get_delta_weight("default")
    nn.functional.linear(x, reference + delta, layer.get_base_layer().bias).square().sum().backward()
    torch.testing.assert_close(layer.get_base_layer().weight.grad, reference.grad)


def test_a_model_built_in_inference_mode_generates_merges_and_unmerges():
    """Inference tensors refuse in-place writes outside inference mode: generation takes the non-mutating path, and
    merging writes inside inference mode."""
    with torch.inference_mode():
        frozen_base = tiny_llama()
    model = get_peft_model(frozen_base, NeuroAdaConfig(k=2, init_weights=False))
    reference = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    reference.load_state_dict(model.state_dict())
    assert all("inference tensor" in layer.frozen().path().reason for layer in neuroada_layers(model))
    tokens = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        generated = model.generate(input_ids=tokens, max_new_tokens=5, do_sample=False, pad_token_id=0)
        expected = reference.generate(input_ids=tokens, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, expected)
    layers = neuroada_layers(model)
    weights = [layer.get_base_layer().weight.clone() for layer in layers]
    model.merge_adapter()
    torch.testing.assert_close(logits(model, tokens), logits(reference, tokens), rtol=1e-5, atol=1e-5)
    model.unmerge_adapter()
    assert all(torch.equal(layer.get_base_layer().weight, w) for layer, w in zip(layers, weights, strict=True))


@pytest.fixture
def offloaded_llama(tmp_path):
    """Tiny Llama loaded with accelerate offloading one decoder layer to disk and one kept in CPU RAM."""
    tiny_llama().save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", device_map=TINY_LLAMA_DISK_MAP, offload_folder=tmp_path / "offload"
    )
    return model, tmp_path


def test_an_offloaded_model_is_refused_before_any_layer_changes(offloaded_llama):
    model, _ = offloaded_llama
    modules = dict(model.named_modules())
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.q_proj', .*: it is offloaded by accelerate"):
        get_peft_model(model, NeuroAdaConfig(k=1))
    assert dict(model.named_modules()) == modules


def test_loading_an_adapter_onto_an_offloaded_model_is_refused_clearly(offloaded_llama):
    model, tmp_path = offloaded_llama
    get_peft_model(tiny_llama(), NeuroAdaConfig(k=1)).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="load the model without CPU/disk offloading"):
        PeftModel.from_pretrained(model, tmp_path / "adapter")


def test_a_model_on_the_meta_device_is_refused_naming_its_layers():
    with torch.device("meta"):
        model = tiny_llama()
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj', .*: it is on the meta device"):
        get_peft_model(model, NeuroAdaConfig(k=1))
