"""The guards (guards.py, components of the plugin's layers and model) check indices wherever they enter a layer: a
state dict loaded into the model or into one layer, and a merge of indices written since. Bad indices are refused
before anything is loaded or written, on layers and on expert stacks alike. An adapter loaded onto another base
model with the same shapes loads as saved, with a warning naming the layers."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.utils.quantization_utils import ForwardOnlyQuantizationBackend

from peft_neuroada import NeuroAdaConfig, NeuroAdaModel
from peft_neuroada.tuner import config as tuner_config
from peft_neuroada.tuner import experts, layer
from peft_neuroada.tuner import model as tuner_model
from tests.conftest import tiny_causal_lm, tiny_llama

TARGETS = {
    "layer": ("llama", "model.layers.0.self_attn.q_proj", {"target_modules": ["q_proj"]}),
    "experts": (
        "mixtral",
        "model.layers.0.mlp.experts",
        {"target_modules": [], "target_parameters": ["gate_up_proj"]},
    ),
}
BAD_COLUMNS = {
    "past-the-inputs": (lambda cols, d_in: d_in + 3, "but the layer has only"),
    "twice-in-a-row": (lambda cols, d_in: int(cols[0, 1]), "a column twice within a neuron's row"),
    "negative": (lambda cols, d_in: -1, r"range over \[-1, "),
}


def guarded(target: str) -> tuple[NeuroAdaModel, torch.nn.Module]:
    """A tiny model with the plugin's model and layers, and the layer under test."""
    model_type, name, options = TARGETS[target]
    base = tiny_llama() if model_type == "llama" else tiny_causal_lm(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NeuroAdaModel(base, NeuroAdaConfig(k=2, init_weights=False, **options), "default")
    adapted = model.model.get_submodule(name)
    assert isinstance(adapted, (layer.Linear, experts.ParamWrapper))
    return model, adapted


def with_bad_column(model, adapted, change) -> tuple[dict[str, torch.Tensor], str]:
    """The model's state dict with neuron 0's first column changed, and the key of the changed index buffer."""
    state = {key: value.clone() for key, value in model.state_dict().items()}
    cols = adapted.placement("default").cols.clone()
    cols[0, 0] = change(cols, adapted.in_features)
    key = next(f"{name}.neuroada_indices.default" for name, module in model.named_modules() if module is adapted)
    state[key] = cols
    return state, key


@pytest.fixture(params=[(target, case) for target in TARGETS for case in BAD_COLUMNS], ids="-".join)
def bad_column(request):
    """A guarded model, its layer under test, a state dict with one bad column there, its key, and the message."""
    target, case = request.param
    change, message = BAD_COLUMNS[case]
    model, adapted = guarded(target)
    state, key = with_bad_column(model, adapted, change)
    return model, adapted, state, key, message


def test_bad_columns_from_a_state_dict_are_refused_from_a_state_dict_before_anything_loads(bad_column):
    model, adapted, state, key, message = bad_column
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"Refusing to load adapter 'default' at layer .*{message}.*Nothing"):
        model.load_state_dict(state)
    prefix = key.rpartition("neuroada_indices.")[0]
    own = {name.removeprefix(prefix): value for name, value in state.items() if name.startswith(prefix)}
    with pytest.raises(ValueError, match=message):  # into the layer alone, as a user's own loading would
        adapted.load_state_dict(own)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_a_merge_of_columns_written_since_is_refused_and_writes_nothing(bad_column):
    model, adapted, state, key, message = bad_column
    with torch.no_grad():
        adapted.neuroada_indices["default"].copy_(state[key])  # a write no load_state_dict saw
    weight = adapted.weight_out_in().detach().clone()
    with pytest.raises(ValueError, match=f"Cannot merge NeuroAda adapter 'default' .*{message}.*Nothing was written"):
        model.merge_adapter()
    assert torch.equal(adapted.weight_out_in(), weight) and not adapted.merged


def test_index_buffers_a_conversion_cast_are_refused_before_computing():
    model, adapted = guarded("layer")
    model.model.type(torch.float64)  # casts every tensor, the index buffers too
    with pytest.raises(ValueError, match="neuroada_indices is a torch.float64.*model.type.*Nothing was computed"):
        model.model(torch.tensor([[1, 2, 3]]))


def test_an_adapter_loaded_on_another_base_with_the_same_shapes_warns_naming_the_layers(smollm2, tmp_path):
    trained = get_peft_model(smollm2, NeuroAdaConfig(k=2, target_modules=["q_proj", "down_proj"]))
    trained.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = PeftModel.from_pretrained(trained.unload(), tmp_path)  # the base it was trained on: no word
    assert not [w for w in caught if "another base model" in str(w.message)]
    torch.manual_seed(0)
    other = type(smollm2)(smollm2.config).eval()  # same shapes, other weights
    with pytest.warns(UserWarning, match=r"selected on another base model: at .*q_proj.* and \d+ more"):
        moved = PeftModel.from_pretrained(other, tmp_path)
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj"
    saved = reloaded.get_submodule(q_proj).placement("default").cols
    assert torch.equal(moved.get_submodule(q_proj).placement("default").cols, saved)  # loaded as saved


class ForwardOnlyLinear(torch.nn.Module):
    """A stand-in for a GPTQ/AWQ/EETQ layer: peft runs its forward but cannot read its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.int32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :4]


def test_the_tuner_alone_refuses_a_layer_peft_can_run_but_not_dequantize_at_injection(monkeypatch):
    forward_only = ForwardOnlyQuantizationBackend("gptq")
    monkeypatch.setattr(
        tuner_model,
        "resolve_quantization_backend",
        lambda base, **kwargs: forward_only if isinstance(base, ForwardOnlyLinear) else None,
    )
    base = torch.nn.Sequential(ForwardOnlyLinear())
    with pytest.raises(TypeError, match="module '0': peft cannot dequantize gptq weights.*Load the base model"):
        tuner_model.NeuroAdaModel(base, tuner_config.NeuroAdaConfig(target_modules=["0"]), "default")
    assert type(base[0]) is ForwardOnlyLinear
