"""Adapters save as k values + k indices per neuron, reload bit-exactly, and refuse base models they do not fit."""

from __future__ import annotations

import json
import re
import site
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.errors import EntryNotFoundError
from peft import (
    AutoPeftModelForCausalLM,
    PeftConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from peft_neuroada import NeuroAdaConfig, NeuroAdaLayer, select_by_gradient
from tests.conftest import (
    TINY_AND_REAL,
    hidden,
    indices_by_layer,
    logits,
    named_neuroada_layers,
    tiny_llama,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def trained_smollm2_adapter(smollm2, tmp_path):
    """A k=1 SmolLM2 adapter with non-zero deltas, saved to disk, plus the PeftModel that saved it."""
    model = get_peft_model(smollm2, NeuroAdaConfig(k=1, init_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    return model, tmp_path / "adapter"


def test_saved_adapter_holds_only_deltas_and_compact_indices(trained_smollm2_adapter):
    model, adapter_dir = trained_smollm2_adapter
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {p.name for p in adapter_dir.iterdir()}
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    assert {key.rsplit(".", 1)[-1] for key in tensors} == {"neuroada_delta", "neuroada_indices"}
    deltas = {key.rsplit(".", 1)[0]: t for key, t in tensors.items() if key.endswith("neuroada_delta")}
    assert all(t.dtype == torch.float32 and t.shape[1] == 1 for t in deltas.values())
    for layer, delta in deltas.items():  # (n, k) int32 columns
        indices = tensors[f"{layer}.neuroada_indices"]
        assert indices.dtype == torch.int32 and indices.shape == delta.shape, layer
    neurons = sum(t.shape[0] for t in deltas.values())
    payload = neurons * (4 + 4)
    size = (adapter_dir / "adapter_model.safetensors").stat().st_size
    print(f"\nSmolLM2-135M NeuroAda k=1 adapter: {size:,} bytes for {neurons:,} neurons (payload {payload:,} bytes)")
    header_budget = 160 * len(tensors)  # safetensors' JSON header: name, dtype, shape, offsets per tensor
    assert payload <= size <= payload + header_budget


def test_model_card_names_the_method_and_the_base_model(trained_smollm2_adapter, smollm2_path):
    _, adapter_dir = trained_smollm2_adapter
    card = (adapter_dir / "README.md").read_text()
    assert "neuroada" in card
    assert f"base_model: {smollm2_path}" in card


def test_reload_in_a_fresh_process_reproduces_outputs_bit_exactly(trained_smollm2_adapter, smollm2_path, tmp_path):
    model, adapter_dir = trained_smollm2_adapter
    tokens = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    script = f"""
import torch, peft_neuroada
from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained({str(smollm2_path)!r})
model = PeftModel.from_pretrained(base, {str(adapter_dir)!r}).eval()
with torch.no_grad():
    torch.save(model(torch.load({str(tmp_path / "tokens.pt")!r})).logits, {str(tmp_path / "reloaded.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO_ROOT, capture_output=True)
    assert torch.equal(torch.load(tmp_path / "reloaded.pt"), logits(model, tokens))


def test_peft_config_and_auto_peft_model_load_a_neuroada_adapter(trained_smollm2_adapter, token_batch):
    model, adapter_dir = trained_smollm2_adapter
    assert isinstance(PeftConfig.from_pretrained(adapter_dir), NeuroAdaConfig)
    auto = AutoPeftModelForCausalLM.from_pretrained(adapter_dir)
    assert torch.equal(logits(auto, token_batch), logits(model, token_batch))


def test_low_cpu_mem_usage_loading_gives_the_same_model(trained_smollm2_adapter, smollm2_path, token_batch):
    model, adapter_dir = trained_smollm2_adapter
    base = AutoModelForCausalLM.from_pretrained(smollm2_path)
    loaded = PeftModel.from_pretrained(base, adapter_dir, low_cpu_mem_usage=True)
    assert not any(p.is_meta for p in loaded.parameters())
    assert torch.equal(logits(loaded, token_batch), logits(model, token_batch))


@TINY_AND_REAL
def test_state_dict_helpers_move_an_adapter_between_models(make_model, token_batch):
    source = get_peft_model(make_model(), NeuroAdaConfig(k=3, init_weights=False))
    state = get_peft_model_state_dict(source)
    assert state and all(key.endswith(("neuroada_delta", "neuroada_indices")) for key in state)
    target = get_peft_model(make_model(), NeuroAdaConfig(k=3))
    assert not torch.equal(hidden(target, token_batch), hidden(source, token_batch))
    result = set_peft_model_state_dict(target, state)
    assert not result.unexpected_keys
    assert torch.equal(hidden(target, token_batch), hidden(source, token_batch))


def test_loading_onto_a_differently_shaped_base_names_the_layer(tmp_path):
    get_peft_model(tiny_llama(), NeuroAdaConfig(k=2)).save_pretrained(tmp_path)
    other = LlamaForCausalLM(
        LlamaConfig(vocab_size=128, hidden_size=40, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    )
    with pytest.raises(ValueError, match=r"does not fit the base model at layer '.*layers\.0\.self_attn\.q_proj'"):
        PeftModel.from_pretrained(other, tmp_path)


def edit_config(adapter_dir: Path, **fields) -> None:
    config_path = adapter_dir / "adapter_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | fields))


FIRST_LAYER = r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj"


def disagreement(adapter_dir: Path, layer: str, setting: str) -> str:
    """The message refusing a config that disagrees with its weights at `layer`: it names both files."""
    weights, config = (
        re.escape(str(adapter_dir / name)) for name in ("adapter_model.safetensors", "adapter_config.json")
    )
    return rf"disagree at layer '{layer}': '{weights}' holds neuroada_delta of shape .* but '{config}' says {setting},"


def no_delta_is_created():
    return mock.patch.object(NeuroAdaLayer, "update_layer", side_effect=AssertionError("a delta was created"))


@pytest.mark.parametrize(
    ("trained", "edit", "setting"),
    [
        ({"k": 2}, {"k": 3}, "k=3"),
        ({"k": 2}, {"k": 10**9}, "k=1000000000"),
        ({"k": 2}, {"neuron_fraction": 0.5}, "neuron_fraction=0.5"),
        ({"k": 2, "neuron_fraction": 0.5}, {"neuron_fraction": 1.0}, "neuron_fraction=1.0"),
        ({"k": 2, "neuron_fraction": 0.5}, {"neuron_fraction": 0.75}, "neuron_fraction=0.75"),
        ({"k": 2, "neuron_fraction": 0.5}, {"k": 10**9, "neuron_fraction": 1.0}, "neuron_fraction=1.0 and k=10+"),
    ],
)
def test_a_config_that_disagrees_with_its_saved_deltas_is_refused_before_any_delta_is_created(
    tmp_path, trained, edit, setting
):
    """The base model is the right one: the message blames the config field and names the layer and both files,
    and the base model is left as it was (a k of 10**9 used to build dense-sized deltas before failing)."""
    get_peft_model(tiny_llama(), NeuroAdaConfig(**trained)).save_pretrained(tmp_path)
    edit_config(tmp_path, **edit)
    base = tiny_llama()
    before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    with no_delta_is_created(), pytest.raises(ValueError, match=disagreement(tmp_path, FIRST_LAYER, setting)):
        PeftModel.from_pretrained(base, tmp_path)
    assert not any(isinstance(module, BaseTunerLayer) for module in base.modules())
    after = base.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)


def test_load_adapter_refuses_a_disagreeing_config_before_the_model_changes(tmp_path, token_batch):
    """`PeftModel.load_adapter` builds its config through NeuroAdaConfig as well (here from a subfolder)."""
    get_peft_model(tiny_llama(), NeuroAdaConfig(k=2)).save_pretrained(tmp_path / "second")
    edit_config(tmp_path / "second", k=10**9)
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=1, init_weights=False)).eval()
    before = logits(model, token_batch)
    with (
        no_delta_is_created(),
        pytest.raises(ValueError, match=disagreement(tmp_path / "second", FIRST_LAYER, "k=10+")),
    ):
        model.load_adapter(tmp_path, "second", subfolder="second")
    assert list(model.peft_config) == ["default"]
    assert all(list(layer.neuroada_delta) == ["default"] for layer in named_neuroada_layers(model).values())
    assert torch.equal(logits(model, token_batch), before)


def test_a_smollm2_adapter_whose_config_says_k_1e9_is_refused_before_any_delta_is_created(
    trained_smollm2_adapter, smollm2_path
):
    """The issue's case: the k=1 deltas of every layer against k=10**9, clipped to each layer's inputs."""
    _, adapter_dir = trained_smollm2_adapter
    edit_config(adapter_dir, k=10**9)
    base = AutoModelForCausalLM.from_pretrained(smollm2_path)
    with (
        no_delta_is_created(),
        pytest.raises(ValueError, match=disagreement(adapter_dir, FIRST_LAYER, "k=1000000000")),
    ):
        PeftModel.from_pretrained(base, adapter_dir)
    assert not any(isinstance(module, BaseTunerLayer) for module in base.modules())


def test_a_config_given_by_hand_is_checked_by_each_layer_as_its_tensors_load(tmp_path):
    """A config passed to from_pretrained is not read with the weights file, so no shapes are known before
    injection: each layer's load check still refuses it, blaming the config and the file rather than the base."""
    get_peft_model(tiny_llama(), NeuroAdaConfig(k=2)).save_pretrained(tmp_path)
    message = r"tensors do not match its config at layer '.*q_proj': its neuroada_delta holds 2 per neuron, but the"
    with pytest.raises(ValueError, match=message):
        PeftModel.from_pretrained(tiny_llama(), tmp_path, config=NeuroAdaConfig(k=3))


def test_loading_indices_outside_the_layer_names_the_layer(tmp_path, token_batch):
    get_peft_model(tiny_llama(), NeuroAdaConfig(k=2)).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    layer = "base_model.model.model.layers.1.mlp.down_proj"
    saved_cols(tensors, layer)[0, 0] = 48
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"layer '.*layers\.1\.mlp\.down_proj'.*\[0, 48\].*only 48 inputs"):
        PeftModel.from_pretrained(tiny_llama(), tmp_path)


@pytest.mark.parametrize(
    ("config", "attribute", "repeat", "message"),
    [
        (NeuroAdaConfig(k=2), "neuroada_indices", lambda t: t[:, 1].copy_(t[:, 0]), "a column twice within a neuron"),
        (NeuroAdaConfig(k=1, neuron_fraction=0.5), "neuroada_rows", lambda t: t[1].copy_(t[0]), "a neuron twice"),
    ],
    ids=["column", "neuron"],
)
def test_loading_an_index_repeated_where_selection_never_repeats_one_is_refused(
    tmp_path, token_batch, config, attribute, repeat, message
):
    """A repeated column would make a merge differ from the unmerged adapter; a repeated neuron, a merge write the same
    entries twice."""
    get_peft_model(tiny_llama(), config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    repeat(saved_cols(tensors, layer) if attribute == "neuroada_indices" else tensors[f"{layer}.{attribute}"])
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    base = tiny_llama()
    before = hidden(base, token_batch)
    with pytest.raises(ValueError, match=rf"{attribute} for layer '.*layers\.0\.self_attn\.q_proj' name {message}"):
        PeftModel.from_pretrained(base, tmp_path)
    assert torch.equal(hidden(base, token_batch), before)


def test_the_saved_model_card_is_tagged_with_the_method_and_the_package(tmp_path):
    get_peft_model(tiny_llama(), NeuroAdaConfig(k=1)).save_pretrained(tmp_path)
    assert {"neuroada", "peft-neuroada"} <= set(ModelCard.load(tmp_path / "README.md").data.tags)


def test_push_to_hub_uploads_the_adapter_through_peft(tmp_path):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=1, init_weights=False))
    api = mock.MagicMock()
    api.create_repo.return_value.repo_id = "me/neuroada-adapter"
    uploaded: dict[str, bytes] = {}

    def create_commit(**kwargs):
        uploaded.update({op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in kwargs["operations"]})

    api.create_commit.side_effect = create_commit
    no_remote_card = mock.patch.object(ModelCard, "load", side_effect=EntryNotFoundError("new repo"))
    model.peft_config["default"].base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # as README says
    with mock.patch("transformers.utils.hub.hf_api", return_value=api), no_remote_card:
        model.push_to_hub("me/neuroada-adapter")
    api.create_repo.assert_called_once()
    assert set(uploaded) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    config = json.loads(uploaded["adapter_config.json"])
    assert config["peft_type"] == "NEUROADA"
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    save_file_path = tmp_path / "pushed.safetensors"
    save_file_path.write_bytes(uploaded["adapter_model.safetensors"])
    assert load_file(save_file_path).keys() == get_peft_model_state_dict(model).keys()


def saved_cols(tensors: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """A saved layer's (n, k) columns."""
    return tensors[f"{layer}.neuroada_indices"]


def test_columns_are_n_by_k_int32_in_memory_and_on_disk(tmp_path):
    """int32: DDP broadcasts buffers, and gloo and NCCL broadcast it; saved as held, so loaders that assign tensors
    by name (transformers') load them as they are, on hosts of either byte order."""
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3))
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    for name, layer in named_neuroada_layers(loaded).items():
        buffer, cols = layer.neuroada_indices["default"], layer.placement("default").cols
        assert buffer.dtype == torch.int32 and buffer.shape == layer.neuroada_delta["default"].shape
        assert cols is buffer
        assert torch.equal(buffer, saved[f"{name}.neuroada_indices"]), name
        assert torch.equal(cols, named_neuroada_layers(model)[name].placement("default").cols), name


def gradient_selected_adapter(base: nn.Module, tokens: torch.Tensor):
    """An adapter whose columns a fresh magnitude selection would not pick, with trained-looking deltas."""
    model = get_peft_model(base, NeuroAdaConfig(k=2, selection="gradient"))
    select_by_gradient(model, [{"input_ids": tokens, "labels": tokens}])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "neuroada_delta" in name:
                parameter.normal_(std=0.05)
    return model.eval()


@pytest.mark.parametrize("how", ["load_adapter", "from_pretrained"])
def test_transformers_own_adapter_loading_reproduces_the_adapter(tmp_path, token_batch, how):
    """`model.load_adapter(dir)` and `AutoModelForCausalLM.from_pretrained(adapter_dir)` assign the saved tensors by
    name after comparing shapes, without peft's load hooks."""
    base_dir = tmp_path / "base"
    tiny_llama().save_pretrained(base_dir)
    model = gradient_selected_adapter(AutoModelForCausalLM.from_pretrained(base_dir), token_batch)
    fresh = indices_by_layer(get_peft_model(tiny_llama(), NeuroAdaConfig(k=2)))
    assert any(not torch.equal(cols, fresh[name]) for name, cols in indices_by_layer(model).items())
    model.save_pretrained(tmp_path / "adapter")
    if how == "load_adapter":
        loaded = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        loaded.load_adapter(tmp_path / "adapter")
    else:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    assert torch.equal(logits(loaded, token_batch), logits(model, token_batch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda cols: cols[0].fill_(-1), r"range over \[-1, .*only 32 inputs"),
        (lambda cols: cols[1].fill_(32), r"range over \[0, 32\] but the layer has only 32 inputs"),
        (lambda cols: cols[:, 1].copy_(cols[:, 0]), "a column twice within a neuron's row"),
    ],
    ids=["negative", "past the inputs", "repeated"],
)
def test_columns_loaded_by_transformers_are_checked_before_a_forward_or_merge_uses_them(
    tmp_path, token_batch, dtype, edit, message
):
    """transformers' loading runs no peft check; the layer checks a new index buffer before its first use (the C
    kernels would refuse such columns in float32, but bf16's gather path and merges would write other entries)."""
    base_dir = tmp_path / "base"
    tiny_llama().to(dtype).save_pretrained(base_dir)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), NeuroAdaConfig(k=2)).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    edit(saved_cols(tensors, "base_model.model.model.layers.0.self_attn.q_proj"))
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    model.load_adapter(tmp_path)
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if "base_layer" in name}
    layer = r"layer 'model\.layers\.0\.self_attn\.q_proj'"
    with pytest.raises(ValueError, match=rf"{layer}.*{message}"):
        logits(model, token_batch)
    with pytest.raises(ValueError, match=message):
        named_neuroada_layers(model)["model.layers.0.self_attn.q_proj"].merge()
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters() if "base_layer" in name)


def test_an_adapter_file_with_deltas_but_no_indices_is_refused_naming_the_layer(tmp_path):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2))
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.1.mlp.up_proj.neuroada_indices"]
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"deltas but no neuroada_indices for layer '.*layers\.1\.mlp\.up_proj'"):
        PeftModel.from_pretrained(tiny_llama(), tmp_path)


def test_columns_saved_in_int64_load_like_int32_ones(tmp_path, token_batch):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=3, init_weights=False))
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    widened = {key: t.long() for key, t in tensors.items() if key.endswith("neuroada_indices")}
    save_file(tensors | widened, tmp_path / "adapter_model.safetensors")
    assert torch.equal(
        logits(PeftModel.from_pretrained(tiny_llama(), tmp_path), token_batch), logits(model, token_batch)
    )


def test_transformers_load_adapter_reproduces_a_smollm2_adapter(smollm2_path, smollm2_tokenizer, tmp_path):
    tokens = smollm2_tokenizer(["The capital of France is"], return_tensors="pt")["input_ids"]
    model = gradient_selected_adapter(AutoModelForCausalLM.from_pretrained(smollm2_path), tokens)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    loaded.load_adapter(tmp_path)
    assert torch.equal(logits(loaded, tokens), logits(model, tokens))


class WideInput(nn.Module):
    """One nn.Linear(40000, 4) whose largest weights sit in columns past int16's range (32767)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Linear(40000, 4)
        with torch.no_grad():
            self.wide.weight[:, [32768, 39999]] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x)


def test_indices_past_int16s_range_load_back(tmp_path):
    """A layer with more than 32768 inputs must not wrap its column indices around when saved compactly."""
    model = get_peft_model(WideInput(), NeuroAdaConfig(k=2, target_modules=["wide"], init_weights=False))
    indices = model.base_model.model.wide.placement("default").cols.clone()
    assert indices.dtype == torch.int32 and indices.min() > torch.iinfo(torch.int16).max
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")["base_model.model.wide.neuroada_indices"]
    assert saved.dtype == torch.int32 and torch.equal(saved, indices)
    reloaded = PeftModel.from_pretrained(WideInput(), tmp_path)
    assert torch.equal(reloaded.base_model.model.wide.placement("default").cols, indices)
    x = torch.randn(3, 40000)
    with torch.no_grad():
        assert torch.equal(reloaded(x), model(x))


def test_installed_package_registers_itself_when_peft_is_imported(tmp_path):
    """Users who forget `import peft_neuroada` can still load adapters: the installed .pth hook registers NEUROADA."""
    if not any((Path(site_dir) / "peft_neuroada.pth").exists() for site_dir in site.getsitepackages()):
        pytest.skip("peft-neuroada is not pip-installed, so its peft_neuroada.pth start-up hook is absent")
    tiny_llama().save_pretrained(tmp_path / "base")
    get_peft_model(tiny_llama(), NeuroAdaConfig(k=2)).save_pretrained(tmp_path / "adapter")
    script = """
import sys
from peft import PeftModel
from transformers import AutoModelForCausalLM
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("base"), "adapter")
print(type(model.base_model).__name__, "peft_neuroada" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout.split() == ["NeuroAdaPluginModel", "True"]


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
@pytest.mark.parametrize("is_trainable", [False, True])
@pytest.mark.parametrize(("delta_dtype", "base_dtype"), [("float32", torch.bfloat16), ("bfloat16", torch.float32)])
def test_a_fixed_delta_dtype_holds_bit_for_bit_on_every_load_path(
    delta_dtype, base_dtype, is_trainable, low_cpu_mem_usage, tmp_path
):
    """`low_cpu_mem_usage=True` assigns the saved tensors and peft then casts adapter tensors to the base layer's
    dtype: deltas whose dtype the config fixes keep it (with `delta_dtype=None` the dtype is peft's, as LoRA's)."""
    model = get_peft_model(tiny_llama().to(base_dtype), NeuroAdaConfig(k=2, delta_dtype=delta_dtype))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "neuroada_delta" in name:
                parameter.normal_(std=1e-3)  # values a bf16 rounding would change
    saved = {name: p.detach().clone() for name, p in model.named_parameters() if "neuroada_delta" in name}
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(
        tiny_llama().to(base_dtype), tmp_path, is_trainable=is_trainable, low_cpu_mem_usage=low_cpu_mem_usage
    )
    deltas = {name: p for name, p in loaded.named_parameters() if "neuroada_delta" in name}
    assert deltas.keys() == saved.keys()
    for name, delta in deltas.items():
        assert delta.dtype == getattr(torch, delta_dtype) and torch.equal(delta, saved[name]), name
        assert delta.requires_grad == is_trainable
