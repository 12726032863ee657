"""Registration with peft, configuration defaults and validation, and which modules get adapted."""

from __future__ import annotations

import importlib
import json
import warnings

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, PeftType, get_peft_model
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from torch import nn
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    RobertaConfig,
    RobertaModel,
)
from transformers.pytorch_utils import Conv1D

import peft_neuroada
from peft_neuroada import NeuroAdaConfig, NeuroAdaLayer, NeuroAdaModel
from tests.conftest import named_neuroada_layers, tiny_bert, tiny_gpt2, tiny_llama


def adapted_names(model) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name in named_neuroada_layers(model)}


TINY_SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}


def tiny_mistral() -> MistralForCausalLM:
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**TINY_SIZES, num_attention_heads=4, num_key_value_heads=2)).eval()


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**TINY_SIZES, num_attention_heads=4, num_key_value_heads=2)).eval()


def tiny_roberta() -> RobertaModel:
    torch.manual_seed(0)
    return RobertaModel(RobertaConfig(**TINY_SIZES, num_attention_heads=4)).eval()


def test_import_registers_neuroada_peft_type():
    assert PeftType.NEUROADA.value == "NEUROADA"
    assert PeftType("NEUROADA") is PeftType.NEUROADA
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.NEUROADA] is NeuroAdaConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING[PeftType.NEUROADA] is NeuroAdaModel


def test_registering_again_is_harmless():
    members_before = list(PeftType)
    assert peft_neuroada.register() is PeftType.NEUROADA
    importlib.reload(importlib.import_module("peft_neuroada.registration")).register()
    assert list(PeftType) == members_before
    assert sum(member is PeftType.NEUROADA for member in PeftType) == 1


def test_config_roundtrips_through_json(tmp_path):
    config = NeuroAdaConfig(k=20, target_modules=["q_proj"], delta_dtype="bfloat16")
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "NEUROADA" and saved["k"] == 20
    loaded = PeftConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, NeuroAdaConfig)
    assert (loaded.k, loaded.target_modules, loaded.delta_dtype) == (20, {"q_proj"}, "bfloat16")


INVALID_FIELDS = [
    ({"k": 0}, "k must be a positive integer"),
    ({"k": 2.5}, "k must be a positive integer"),
    ({"k": True}, "k must be a positive integer"),
    ({"k": "20"}, "k must be a positive integer"),
    ({"bias": "lora_only"}, "bias must be one of"),
    ({"delta_dtype": "int8"}, "delta_dtype must be one of"),
    ({"delta_dtype": ["float32"]}, "delta_dtype must be one of"),
    ({"selection": 3}, "selection must be one of"),
    ({"layers_pattern": "layers"}, "layers_pattern only has an effect together with layers_to_transform"),
    ({"neuron_fraction": 0}, r"neuron_fraction must be in \(0, 1\]"),
    ({"neuron_fraction": 1.5}, r"neuron_fraction must be in \(0, 1\]"),
    ({"neuron_fraction": float("nan")}, r"neuron_fraction must be in \(0, 1\]"),
    ({"neuron_fraction": "0.5"}, r"neuron_fraction must be in \(0, 1\]: a number"),
    ({"neuron_fraction": True}, r"neuron_fraction must be in \(0, 1\]: a number"),
    ({"selection_seed": 2**64}, r"selection_seed must be an integer from -2\*\*63 to 2\*\*64 - 1"),
    ({"selection_seed": -(2**63) - 1}, "selection_seed must be an integer from"),
    ({"selection_seed": 1.5}, "selection_seed must be an integer from"),
    ({"selection_seed": False}, "selection_seed must be an integer from"),
    ({"fan_in_fan_out": "no"}, "fan_in_fan_out must be True or False"),
    ({"init_weights": 0}, "init_weights must be True or False"),
    ({"target_modules": 5}, "target_modules must be None, a string .* or a list or set of module names"),
    ({"target_modules": ["q_proj", 5]}, "target_modules must be None"),
    ({"target_modules": ("q_proj",)}, "target_modules must be None"),
    ({"exclude_modules": [None]}, "exclude_modules must be None, a regex or a list or set of module names"),
    ({"layers_to_transform": -1}, "layers_to_transform must be None, a layer index"),
    ({"layers_to_transform": [0, -1]}, "layers_to_transform must be None, a layer index"),
    ({"layers_to_transform": "0"}, "layers_to_transform must be None, a layer index"),
    ({"layers_to_transform": [True]}, "layers_to_transform must be None, a layer index"),
    ({"layers_to_transform": [0], "layers_pattern": 3}, "layers_pattern must be None, the name of the model's"),
    ({"modules_to_save": "classifier"}, "modules_to_save must be None or a list of module names"),
    ({"modules_to_save": [1]}, "modules_to_save must be None or a list of module names"),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID_FIELDS)
def test_invalid_config_is_refused_with_a_specific_message(kwargs, message):
    """Every field is checked for its type and range, and the message names the field and what it accepts."""
    with pytest.raises(ValueError, match=rf"NeuroAdaConfig\.{message}"):
        NeuroAdaConfig(**kwargs)


@pytest.mark.parametrize(
    ("option", "hint"),
    [("r", "k_for_budget"), ("lora_alpha", "unscaled"), ("lora_dropout", "use neuroada_dropout"), ("rank", "")],
)
def test_a_field_it_lacks_is_refused_under_the_imported_name_with_neuroada_s_way_for_lora_s(option, hint):
    with pytest.raises(TypeError, match=rf"^NeuroAdaConfig got an unexpected keyword argument '{option}'.*{hint}"):
        NeuroAdaConfig(**{option: 8})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [case for case in INVALID_FIELDS if not isinstance(case[0].get("target_modules"), tuple)],  # JSON has no tuples
)
def test_invalid_fields_of_a_saved_config_are_refused_by_name_on_load(tmp_path, kwargs, message):
    """peft builds a loaded config from the JSON file's keys, so a hand-edited file meets the same checks."""
    NeuroAdaConfig(k=2).save_pretrained(tmp_path)
    config_path = tmp_path / "adapter_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | kwargs))
    with pytest.raises(ValueError, match=rf"NeuroAdaConfig\.{message}"):
        PeftConfig.from_pretrained(tmp_path)


def test_every_value_a_field_accepts_works(tmp_path, token_batch):
    """The edges of each accepted range build an adapter: the seed bounds seed every layer's generator, any real
    fraction is kept as a float (so it saves as a JSON number), and sets, single names and single layer indices are
    taken where lists are."""
    for seed in (-(2**63), 0, 2**64 - 1):
        config = NeuroAdaConfig(k=2, selection="random", selection_seed=seed, neuron_fraction=0.5)
        assert torch.isfinite(get_peft_model(tiny_llama(), config)(token_batch).logits).all()
    config = NeuroAdaConfig(
        k=10**9,
        neuron_fraction=np.float32(1.0),
        target_modules={"q_proj", "v_proj"},
        exclude_modules="nothing",
        layers_to_transform=0,
        layers_pattern=["layers"],
        modules_to_save=["lm_head"],
    )
    assert type(config.neuron_fraction) is float and config.neuron_fraction == 1.0
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["neuron_fraction"] == 1.0
    with pytest.warns(UserWarning, match="exceeds the 32 inputs"):
        model = get_peft_model(tiny_llama(), config)
    assert {name.removeprefix("base_model.model.model.") for name in named_neuroada_layers(model)} == {
        "layers.0.self_attn.q_proj",
        "layers.0.self_attn.v_proj",
    }


@pytest.mark.parametrize(
    ("make_model", "expected"),
    [
        (tiny_llama, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
        (tiny_gpt2, {"c_attn", "c_proj", "c_fc"}),
        (tiny_bert, {"query", "key", "value", "dense"}),
        (tiny_mistral, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
        (tiny_qwen2, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
        (tiny_roberta, {"query", "key", "value", "dense"}),
    ],
    ids=["llama", "gpt2", "bert", "mistral", "qwen2", "roberta"],
)
def test_architecture_default_targets(make_model, expected):
    """Every linear layer with a default name is adapted, and nothing else."""
    base = make_model()
    linear_types = (nn.Linear, Conv1D)
    wanted = {n for n, m in base.named_modules() if isinstance(m, linear_types) and n.rsplit(".", 1)[-1] in expected}
    model = get_peft_model(base, NeuroAdaConfig())
    assert adapted_names(model) == expected
    adapted = {name.removeprefix("base_model.model.") for name in named_neuroada_layers(model)}
    assert adapted == wanted


@pytest.mark.parametrize(
    "make_base", [lambda: nn.Sequential(nn.Linear(4, 4)), tiny_llama], ids=["no-config", "unknown"]
)
def test_a_model_without_default_targets_is_refused_as_lora_refuses_it(make_base):
    """No silent guess at an architecture's projections: LoRA's message, before any layer is replaced."""
    base = make_base()
    if hasattr(base, "config"):
        base.config.model_type = "an_architecture_neuroada_does_not_know"
    with pytest.raises(ValueError, match=r"Please specify `target_modules` or `target_parameters` in `peft_config`"):
        get_peft_model(base, NeuroAdaConfig())
    assert not any(name for name, _ in named_neuroada_layers(base).items())


def test_gpt2_conv1d_layers_use_fan_in_fan_out_automatically():
    with pytest.warns(UserWarning, match="fan_in_fan_out=False does not match Conv1D layers"):
        model = get_peft_model(tiny_gpt2(), NeuroAdaConfig())
    c_attn = model.base_model.model.transformer.h[0].attn.c_attn
    assert c_attn.fan_in_fan_out and c_attn.neuroada_delta["default"].shape == (96, 1)


def test_the_corrected_fan_in_fan_out_is_saved_so_reloading_does_not_warn_again(tmp_path):
    with pytest.warns(UserWarning, match="fan_in_fan_out=False does not match Conv1D layers"):
        get_peft_model(tiny_gpt2(), NeuroAdaConfig()).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fan_in_fan_out")
        PeftModel.from_pretrained(tiny_gpt2(), tmp_path)


def test_bert_defaults_adapt_the_pooler_too_unless_it_is_excluded():
    """`dense` names BERT's pooler as well (README, `target_modules`)."""
    adapted = named_neuroada_layers(get_peft_model(tiny_bert(), NeuroAdaConfig()))
    assert "base_model.model.pooler.dense" in adapted
    excluded = named_neuroada_layers(get_peft_model(tiny_bert(), NeuroAdaConfig(exclude_modules=["pooler.dense"])))
    assert set(adapted) - set(excluded) == {"base_model.model.pooler.dense"}


def test_all_linear_adapts_every_linear_layer_except_the_output_head():
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(target_modules="all-linear"))
    assert adapted_names(model) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not isinstance(model.base_model.model.lm_head, NeuroAdaLayer)


def test_exclude_modules_and_layers_to_transform_narrow_the_targets():
    model = get_peft_model(
        tiny_llama(), NeuroAdaConfig(exclude_modules=["down_proj"], layers_to_transform=[1], layers_pattern="layers")
    )
    adapted = list(named_neuroada_layers(model))
    assert adapted and all(".layers.1." in name for name in adapted)
    assert not any(name.endswith("down_proj") for name in adapted)


class UnknownModule(nn.Module):
    """A module with a weight that neither NeuroAda nor LoRA knows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 8))


# The start of the message peft's tests fix for every method (test_custom_models.py's unknown-layer test), LoRA's.
PEFT_UNSUPPORTED = r"Target module .* not supported"


@pytest.mark.parametrize("config", [LoraConfig(target_modules=["1"]), NeuroAdaConfig(target_modules=["1"])])
def test_an_unknown_module_type_is_refused_with_peft_s_message(config):
    with pytest.raises((TypeError, ValueError), match=PEFT_UNSUPPORTED):
        get_peft_model(nn.Sequential(nn.Linear(8, 8), UnknownModule()), config)


def test_an_unsupported_module_type_is_refused_with_its_name_and_type():
    model = nn.Sequential(nn.Linear(8, 8), nn.Embedding(10, 8))
    with pytest.raises(TypeError, match=PEFT_UNSUPPORTED + r": NeuroAda adapts only torch.nn.Linear") as refusal:
        get_peft_model(model, NeuroAdaConfig(target_modules=["1"]))
    assert "Target module '1' of type Embedding" in str(refusal.value)


def test_k_larger_than_layer_inputs_is_clipped_with_a_warning():
    model = nn.Sequential(nn.Linear(4, 6))
    with pytest.warns(UserWarning, match="k=20 exceeds the 4 inputs"):
        peft_model = get_peft_model(model, NeuroAdaConfig(k=20, target_modules=["0"]))
    layer = peft_model.base_model.model[0]
    assert layer.neuroada_delta["default"].shape == (6, 4)
    assert sorted(layer.placement("default").cols[0].tolist()) == [0, 1, 2, 3]


def test_explicit_delta_dtype_survives_peft_upcast():
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(delta_dtype="bfloat16"))
    deltas = [p for n, p in model.named_parameters() if "neuroada_delta" in n]
    assert deltas and all(p.dtype == torch.bfloat16 for p in deltas)


def test_half_precision_base_gets_float32_deltas_by_default():
    model = get_peft_model(tiny_llama().to(torch.bfloat16), NeuroAdaConfig())
    deltas = [p for n, p in model.named_parameters() if "neuroada_delta" in n]
    assert deltas and all(p.dtype == torch.float32 for p in deltas)


def test_an_adapter_saved_with_the_retired_inplace_forward_field_loads_and_serves_the_same(tmp_path, token_batch):
    """`inplace_forward` chose the old in-place forward; adapters saved with it load, the field ignored."""
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    expected = model(token_batch).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**saved, "inplace_forward": False}))
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    assert not hasattr(reloaded.peft_config["default"], "inplace_forward")
    torch.testing.assert_close(reloaded(token_batch).logits, expected)
