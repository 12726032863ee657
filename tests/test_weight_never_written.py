"""Training and inference never write the base weight, on either path: the merged copy runs wherever
`F.linear(x, W + P ⊙ Θ, b)` can stand in for the base layer's call, the bypass everywhere else, with the same result;
a base whose weights cannot be written at all trains, evaluates and generates as an ordinary one. Weights NeuroAda
cannot even read (offloaded, meta) are refused with a clear error before the model changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from peft_neuroada import Linear, NeuroAdaConfig
from peft_neuroada.merged_copy import BYPASS_MAX_TOKENS, FEW_TOKENS, copy_refusal
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


# Each situation, what `copy_refusal` says about it (None: the merged-copy path runs), and the path taken.
SITUATIONS = {
    "plain": (plain, None, "copy"),
    "tensor-subclass": (subclass_weight, "not a dense tensor", "bypass"),
    "view-into-larger-buffer": (view_into_a_larger_buffer, None, "copy"),
    "trainable-weight": (trainable_weight, "not a frozen floating-point tensor", "bypass"),
    "trainable-bias": (trainable_bias, None, "copy"),
    "forward-hook": (hooked, "hooks", "bypass"),
    "backward-hook": (backward_hooked, "hooks", "bypass"),
    "shared-memory": (in_shared_memory, None, "copy"),
}


def make_layer(situation) -> Linear:
    torch.manual_seed(0)
    base = situation(nn.Linear(12, 10).requires_grad_(False))
    return Linear(base, "default", NeuroAdaConfig(k=3, init_weights=False))


def dense_reference(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    weight = layer.weight_out_in().detach().as_subclass(torch.Tensor) + layer.get_delta_weight("default")
    return nn.functional.linear(x, weight, layer.get_base_layer().bias)


def refusal_of(layer: Linear, tokens: int = 64) -> str | None:
    return copy_refusal(layer.get_base_layer(), layer.weight_out_in(), torch.zeros(tokens, layer.in_features))


@pytest.mark.parametrize(("situation", "refusal", "path"), SITUATIONS.values(), ids=SITUATIONS.keys())
def test_the_copy_path_runs_only_where_nothing_refuses_it(situation, refusal, path):
    reason = refusal_of(make_layer(situation))
    assert reason == refusal if refusal is None else refusal in reason


def test_few_tokens_without_gradients_take_the_bypass_and_a_batch_the_copy():
    layer = make_layer(plain)
    with torch.no_grad():
        assert refusal_of(layer, tokens=BYPASS_MAX_TOKENS) == FEW_TOKENS
        assert refusal_of(layer, tokens=BYPASS_MAX_TOKENS + 1) is None
    assert refusal_of(layer, tokens=1) is None  # with gradients: the copy, as in training


@pytest.mark.parametrize(("situation", "refusal", "path"), SITUATIONS.values(), ids=SITUATIONS.keys())
def test_every_path_computes_the_adapted_layer_and_never_writes_the_weight(situation, refusal, path):
    layer = make_layer(situation)
    weight = layer.get_base_layer().weight
    before, version = weight.detach().clone(), weight._version
    x = torch.randn(2, 5, 12, requires_grad=True)
    out = layer(x)
    torch.testing.assert_close(out, dense_reference(layer, x), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    assert torch.equal(weight.detach(), before) and weight._version == version


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
    """Inference tensors refuse in-place writes outside inference mode: generation only reads them, and merging writes
    inside inference mode."""
    with torch.inference_mode():
        frozen_base = tiny_llama()
    model = get_peft_model(frozen_base, NeuroAdaConfig(k=2, init_weights=False))
    reference = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    reference.load_state_dict(model.state_dict())
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
    with pytest.raises(ValueError, match="load the model without offloading"):
        PeftModel.from_pretrained(model, tmp_path / "adapter")


def test_a_model_on_the_meta_device_is_refused_naming_its_layers():
    with torch.device("meta"):
        model = tiny_llama()
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj', .*: it is on the meta device"):
        get_peft_model(model, NeuroAdaConfig(k=1))


REPO_ROOT = Path(__file__).resolve().parents[1]
READ_ONLY_RUN = """
import numpy, torch, peft_neuroada
from peft import get_peft_model
from peft_neuroada import NeuroAdaConfig
from tests.conftest import tiny_llama

def run(read_only):
    base = tiny_llama()
    if read_only:  # every targeted weight mapped from a file in mode "r": a write would end the process
        for i, (name, module) in enumerate(base.named_modules()):
            if name.endswith("_proj"):
                numpy.save(f"{folder}/{i}.npy", module.weight.detach().numpy())
                array = numpy.load(f"{folder}/{i}.npy", mmap_mode="r")
                module.weight = torch.nn.Parameter(torch.from_numpy(array), requires_grad=False)
    model = get_peft_model(base, NeuroAdaConfig(k=2, init_weights=False))
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    with torch.no_grad():
        evaluated = model(tokens).logits
        generated = model.generate(input_ids=tokens[:1, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
    return evaluated, generated

(ordinary, ordinary_text), (read_only, read_only_text) = run(False), run(True)
assert torch.equal(ordinary, read_only) and torch.equal(ordinary_text, read_only_text)
print("same")
"""


def test_a_base_whose_weights_cannot_be_written_trains_evaluates_and_generates_as_an_ordinary_one(tmp_path):
    script = f"folder = {str(tmp_path)!r}\n{READ_ONLY_RUN}"
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "same", run.stderr[-2000:]
