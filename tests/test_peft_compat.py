"""Each workaround in peft_compat.py exists because of one generic peft behaviour. These specs run peft's own
behaviour (BaseTuner's method, or peft alone in a fresh process) and fail once peft changes it: the workaround can
then be dropped. What the workarounds themselves guarantee is specified where the behaviour is (save/load, merge,
bias, distributed and plugin-isolation specs)."""

from __future__ import annotations

import os
import subprocess
import sys

import peft.peft_model
import peft.utils.save_and_load
import pytest
import torch
from peft import get_peft_model
from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from peft_neuroada import NeuroAdaConfig, NeuroAdaModel
from peft_neuroada.peft_compat import route_safetensors_calls
from tests.conftest import named_neuroada_layers, neuroada_layers, tiny_bert, tiny_llama


def tuner(config: NeuroAdaConfig | None = None, base: nn.Module | None = None):
    return get_peft_model(base or tiny_llama(), config or NeuroAdaConfig(k=1, init_weights=False)).base_model


def test_peft_still_writes_and_reads_adapter_files_with_safetensors_own_functions():
    """`route_safetensors_calls` replaces exactly these two module attributes of peft."""
    probe = (
        "import peft.peft_model as m, peft.utils.save_and_load as s, safetensors.torch as st; "
        "print(m.safe_save_file is st.save_file, s.safe_load_file is st.load_file)"
    )
    env = {**os.environ, "PEFT_NEUROADA_NO_AUTOLOAD": "1"}
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert completed.stdout.split() == ["True", "True"], completed.stderr[-2000:]


def test_routing_changes_nothing_where_peft_internals_have_moved(monkeypatch):
    def moved_save(*args, **kwargs):
        raise AssertionError("never called")

    def moved_load(*args, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(peft.peft_model, "safe_save_file", moved_save)
    monkeypatch.setattr(peft.utils.save_and_load, "safe_load_file", moved_load)
    route_safetensors_calls()
    assert peft.peft_model.safe_save_file is moved_save
    assert peft.utils.save_and_load.safe_load_file is moved_load


def test_peft_runs_the_pre_injection_hook_only_before_the_first_adapter(monkeypatch):
    model = tuner()
    model.peft_config["two"] = NeuroAdaConfig(k=1)
    calls = []
    monkeypatch.setattr(NeuroAdaModel, "_pre_injection_hook", lambda *args: calls.append(args))
    BaseTuner.inject_adapter(model, model.model, "two")
    assert calls == []


def test_peft_trains_the_biases_of_an_adapter_loaded_for_inference():
    model = tuner(NeuroAdaConfig(k=1, bias="all", inference_mode=True), tiny_bert())
    BaseTuner._mark_only_adapters_as_trainable(model, model.model)
    biases = [p for name, p in model.model.named_parameters() if name.endswith(".bias")]
    assert biases and all(p.requires_grad for p in biases)


class FailingMerge(Exception):
    pass


def fail_at_second_layer(model, monkeypatch) -> list:
    layers = neuroada_layers(model)

    def refuse(*args, **kwargs):
        raise FailingMerge

    monkeypatch.setattr(layers[1], "merge", refuse)
    return layers


def test_peft_leaves_a_model_half_merged_when_a_layer_fails(monkeypatch):
    model = tuner()
    layers = fail_at_second_layer(model, monkeypatch)
    with pytest.raises(FailingMerge):
        BaseTuner.merge_adapter(model)
    assert layers[0].merged


def test_peft_merges_while_it_unloads_so_a_failing_layer_leaves_earlier_ones_merged_and_unloaded(monkeypatch):
    model = tuner()
    first_name = next(iter(named_neuroada_layers(model))).removeprefix("model.")
    layers = fail_at_second_layer(model, monkeypatch)
    weight = layers[0].get_base_layer().weight
    before = weight.detach().clone()
    with pytest.raises(FailingMerge):
        BaseTuner._unload_and_optionally_merge(model, merge=True)
    assert model.model.get_submodule(first_name) is layers[0].get_base_layer()
    assert not torch.equal(weight, before)


def test_peft_unloading_an_experts_module_from_its_parameter_wrapper_gives_it_the_wrapper_s_weight():
    experts = nn.Module()  # like transformers 5's MoE experts: 3-D parameters, no `weight`
    experts.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 3))
    wrapper = nn.Module()
    wrapper.base_layer, wrapper.weight = experts, nn.Parameter(torch.zeros(1))
    with pytest.raises(AttributeError, match="weight"):
        BaseTuner._replace_module(tuner(), nn.Module(), "experts", experts, wrapper)


def test_peft_checks_adapter_tensors_only_on_its_own_load_path(monkeypatch):
    """A resume calls `load_state_dict` directly: peft's adapter check (`_remap_adapter_state_dict_for_load`) does
    not run there, so the tuner model's load pre-hook is the only place such a load can be checked."""
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=1))
    remapped = []
    original = NeuroAdaModel._remap_adapter_state_dict_for_load.__func__
    monkeypatch.setattr(
        NeuroAdaModel, "_remap_adapter_state_dict_for_load", classmethod(lambda *a: remapped.append(1) or original(*a))
    )
    model.load_state_dict(model.state_dict())
    assert remapped == []
