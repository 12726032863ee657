"""Configuration of a NeuroAda adapter."""

from __future__ import annotations

import numbers
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME, PeftType
from safetensors import SafetensorError, safe_open
from torch import nn

from .atomic_file import commit_config, weights_to_read
from .selection import STRATEGIES, tuned_neuron_count

LLAMA_STYLE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Per-architecture defaults used when `target_modules` is left as None (same role as peft's
# TRANSFORMERS_MODELS_TO_*_TARGET_MODULES_MAPPING tables). Unknown architectures fall back to LLAMA_STYLE_TARGETS.
TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING: dict[str, list[str]] = {
    **{
        model_type: LLAMA_STYLE_TARGETS
        for model_type in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2")
    },
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "bert": ["query", "key", "value", "dense"],
    "roberta": ["query", "key", "value", "dense"],
}


def default_targets(model_type: str | None) -> set[str]:
    """The modules adapted when `target_modules` is None, for a model of this `config.model_type`."""
    return set(TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING.get(model_type, LLAMA_STYLE_TARGETS))


# The one dtype table: the names a config, a recipe or a command line may give for delta storage and model weights.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# peft's name for the method, and the prefix of every adapter attribute (and state-dict key) it owns.
METHOD_NAME = "neuroada"
PREFIX = "neuroada_"
# peft's bias options; "<method>_only" is the name peft's BaseTuner gives the adapted layers' biases.
BIAS_OPTIONS = ("none", "all", f"{METHOD_NAME}_only")
# The seeds torch.Generator.manual_seed takes. `selection.layer_generator` XORs a 32-bit CRC into a seed's low bits,
# which keeps every seed of this range inside it.
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class SavedDeltas:
    """What a saved adapter's weights file holds, as its header lists it: each layer's delta shape (by the layer's
    state-dict name, e.g. `base_model.model.model.layers.0.self_attn.q_proj`) and the layers saved with
    `neuroada_rows` (those trained with neuron_fraction < 1)."""

    config_file: str
    weights_file: str
    shapes: dict[str, tuple[int, ...]]
    with_rows: frozenset[str]


@dataclass
class NeuroAdaConfig(PeftConfig):
    """Configuration for [`NeuroAdaModel`].

    Every neuron (output row) of each targeted linear layer gets `k` trainable deltas placed on its `k`
    largest-magnitude input connections. The frozen weight is never copied; only `k` values and `k` integer indices
    are stored per row.

    Args:
        k: Number of input connections tuned per neuron (the paper uses 1 and 20). A layer with fewer inputs than `k`
            uses all of its inputs and a warning is emitted (the clipped `k` is visible in its deltas' shape).
        target_modules: Module names or a regex to adapt; `"all-linear"` adapts every linear layer except the output
            head. `None` picks the architecture default (q/k/v/o/gate/up/down for Llama-style models).
        exclude_modules: Module names or a regex to leave untouched.
        layers_to_transform: Layer indices to adapt (all when None).
        layers_pattern: Name of the layer list used with `layers_to_transform` (e.g. `"layers"`, `"h"`).
        selection: How each neuron's inputs are chosen: `"magnitude"` (largest |w|, the paper's default),
            `"reverse"` (smallest |w|), `"random"` (uniform, seeded) or `"gradient"` (largest accumulated |grad w|
            on calibration batches: call `peft_neuroada.select_by_gradient(model, batches)` after `get_peft_model`;
            until then the magnitude choice stands in). Saved adapters store their indices, so reloading
            reproduces the selection whatever the strategy.
        selection_seed: Seed for `random` selection and for `neuron_fraction`; combined with each layer's name, so
            every layer differs but every process and run agrees.
        neuron_fraction: Share of neurons per layer that get a bypass (1.0 = all, the paper's setting; smaller values
            reproduce the coverage ablation). The tuned neurons are drawn at random with `selection_seed`.
        fan_in_fan_out: True for layers that store their weight as (in, out), like GPT-2's `Conv1D`. Detected and
            corrected automatically with a warning.
        init_weights: True (default) starts every delta at zero, so the adapted model equals the base model. False
            draws small random deltas, which is only useful for tests.
        bias: Which biases train beside the deltas, as in LoRA: `"none"` (the paper's setting), `"all"` (every bias of
            the model) or `"neuroada_only"` (the biases of the adapted layers). Trained biases are the base layers'
            own, so they are saved with the adapter and need nothing to merge; only one adapter of a model may train
            them (peft's rule), and `disable_adapter()` does not undo them.
        delta_dtype: Storage dtype of the deltas (`"float32"`, `"bfloat16"`, `"float16"`). None keeps peft's
            behaviour: deltas follow the base weight dtype and are upcast to float32 unless `autocast_adapter_dtype`
            is False.
        inplace_forward: When True (default) the forward pass writes the deltas into the frozen weight for the
            duration of one matmul and restores the exact original values afterwards, so training costs no more than
            a frozen model. It is used only for plain, frozen, dense weights that the layer alone holds, outside
            `torch.compile`, and each visit holds the weight's lock, so threads are safe; other cases use a separate
            sparse bypass automatically. False always uses the bypass.
        modules_to_save: Extra modules (e.g. a classification head) trained fully and saved with the adapter.
    """

    k: int = field(default=1, metadata={"help": "Number of input connections tuned per neuron."})
    target_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Module names or regex to adapt; 'all-linear' for every linear layer."}
    )
    exclude_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Module names or regex to exclude."}
    )
    layers_to_transform: list[int] | int | None = field(default=None, metadata={"help": "Layer indices to adapt."})
    layers_pattern: list[str] | str | None = field(
        default=None, metadata={"help": "Layer list name used with layers_to_transform."}
    )
    selection: str = field(default="magnitude", metadata={"help": f"One of {STRATEGIES}."})
    selection_seed: int = field(default=0, metadata={"help": "Seed for random selection and neuron_fraction."})
    neuron_fraction: float = field(default=1.0, metadata={"help": "Share of neurons per layer that are tuned."})
    fan_in_fan_out: bool = field(default=False, metadata={"help": "True if the layer stores weight as (in, out)."})
    init_weights: bool = field(default=True, metadata={"help": "Zero deltas (True) or small random ones for tests."})
    bias: Literal["none", "all", "neuroada_only"] = field(
        default="none", metadata={"help": "Biases trained beside the deltas: 'none', 'all' or 'neuroada_only'."}
    )
    delta_dtype: str | None = field(default=None, metadata={"help": "float32, bfloat16 or float16."})
    inplace_forward: bool = field(
        default=True, metadata={"help": "Fold deltas into the frozen weight during each matmul (restored exactly)."}
    )
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Extra modules trained fully and saved with the adapter."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = PeftType[METHOD_NAME.upper()]
        # Not a field (never saved): set by `from_pretrained`, checked by `NeuroAdaModel._pre_injection_hook`.
        self._saved_deltas: SavedDeltas | None = None
        self._check_fields()
        self.neuron_fraction = float(self.neuron_fraction)
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)
        if isinstance(self.exclude_modules, list):
            self.exclude_modules = set(self.exclude_modules)
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError("NeuroAdaConfig.layers_pattern only has an effect together with layers_to_transform.")

    def _check_fields(self) -> None:
        """Refuse, by name, any field of the wrong type or out of range, before anything reads it (a loaded config
        comes through here too: peft builds it from the JSON file's keys)."""
        names = "a list or set of module names"
        layers = self.layers_to_transform
        accepted = {
            "k": (_is_int(self.k) and self.k >= 1, "a positive integer (the paper uses 1 or 20)"),
            "target_modules": (
                _is_none_or_names(self.target_modules, (str, list, set)),
                f"None, a string (a regex, or 'all-linear') or {names}",
            ),
            "exclude_modules": (
                _is_none_or_names(self.exclude_modules, (str, list, set)),
                f"None, a regex or {names}",
            ),
            "layers_to_transform": (
                layers is None
                or _is_layer_index(layers)
                or (isinstance(layers, list) and all(_is_layer_index(layer) for layer in layers)),
                "None, a layer index (an integer >= 0) or a list of layer indices",
            ),
            "layers_pattern": (
                _is_none_or_names(self.layers_pattern, (str, list)),
                "None, the name of the model's list of layers (e.g. 'layers', 'h') or a list of such names",
            ),
            "selection": (isinstance(self.selection, str) and self.selection in STRATEGIES, f"one of {STRATEGIES}"),
            "selection_seed": (
                _is_int(self.selection_seed) and SEED_RANGE[0] <= self.selection_seed <= SEED_RANGE[1],
                "an integer from -2**63 to 2**64 - 1 (what torch.Generator.manual_seed takes)",
            ),
            "neuron_fraction": (
                isinstance(self.neuron_fraction, numbers.Real)
                and not isinstance(self.neuron_fraction, bool)
                and 0 < self.neuron_fraction <= 1,
                "in (0, 1]: a number, the share of each layer's neurons that is tuned",
            ),
            "fan_in_fan_out": (isinstance(self.fan_in_fan_out, bool), "True or False"),
            "init_weights": (isinstance(self.init_weights, bool), "True or False"),
            "bias": (isinstance(self.bias, str) and self.bias in BIAS_OPTIONS, f"one of {BIAS_OPTIONS}"),
            "delta_dtype": (
                self.delta_dtype is None or (isinstance(self.delta_dtype, str) and self.delta_dtype in DTYPES),
                f"one of {sorted(DTYPES)} or None",
            ),
            "inplace_forward": (isinstance(self.inplace_forward, bool), "True or False"),
            "modules_to_save": (_is_none_or_names(self.modules_to_save, (list,)), "None or a list of module names"),
        }
        for name, (ok, what) in accepted.items():
            if not ok:
                raise ValueError(f"NeuroAdaConfig.{name} must be {what} (got {getattr(self, name)!r}).")

    @property
    def trainable_token_indices(self) -> None:
        """LoRA's option for training single token embeddings, which NeuroAda does not have (always None). Tools that
        read it on any peft config (TRL, when a chat template adds tokens) get None; setting it says what to do."""
        return None

    @trainable_token_indices.setter
    def trainable_token_indices(self, value: object) -> None:
        raise ValueError(
            f"NeuroAda has no trainable_token_indices (asked for {value!r}): it is a LoRA option in peft. Train the "
            'embeddings through modules_to_save (e.g. NeuroAdaConfig(modules_to_save=["embed_tokens", "lm_head"])), '
            "after adding the new tokens to the tokenizer and resizing the model's embeddings yourself."
        )

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """Write adapter_config.json atomically, as the commit of an adapter's save: its one rename makes the weights
        written before it the folder's adapter (atomic_file.py), so an interrupted save leaves the previous adapter
        readable."""
        os.makedirs(save_directory, exist_ok=True)
        folder = Path(save_directory)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".config-") as staging:
            super().save_pretrained(staging, **kwargs)
            staged = Path(staging, CONFIG_NAME)
            with open(staged, "rb") as written:
                os.fsync(written.fileno())  # on disk before the rename makes it the config
            commit_config(staged, folder / CONFIG_NAME, folder / SAFETENSORS_WEIGHTS_NAME)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, subfolder: str | None = None, **kwargs
    ) -> PeftConfig:
        """peft's, keeping what the weights file beside a local config holds (read from its header, no tensor data):
        injection then refuses a config that would create other deltas before it allocates any
        (`NeuroAdaModel._pre_injection_hook`), where a k of 10**9 would build dense-sized ones first. peft's
        `PeftModel.from_pretrained` and `load_adapter` build configs through here."""
        config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        folder = Path(pretrained_model_name_or_path, subfolder or "")
        if isinstance(config, NeuroAdaConfig) and (folder / CONFIG_NAME).is_file():
            config._saved_deltas = _saved_deltas(folder)
        return config

    def check_saved_deltas(self, targeted: Iterable[tuple[str, nn.Module]]) -> None:
        """For a config loaded with its weights (`from_pretrained`): refuse it if its k or neuron_fraction would give
        one of the `targeted` (module name, module) pairs other deltas than the file holds, before anything is
        allocated. Other differences (saved neurons that no fraction explains, more inputs per neuron than the layer
        has) come from another base model: the layers' own load check names those."""
        saved = self._saved_deltas
        if saved is None:
            return
        for name, module in targeted:
            key = f"base_model.model.{name}"  # as peft saves a PeftModel's adapter
            shape = saved.shapes.get(key)
            if shape is None or len(shape) != 2:
                continue
            base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
            d_in, d_out = _get_in_out_features(base)
            if d_in is None:
                continue
            neurons, k = shape
            tuned = tuned_neuron_count(d_out, self.neuron_fraction)
            expected = (tuned, min(self.k, d_in))
            with_rows = key in saved.with_rows
            fields = []
            if with_rows != (self.neuron_fraction < 1) or (with_rows and neurons != tuned and neurons <= d_out):
                fields.append("neuron_fraction")
            if k != expected[1] and k <= d_in:
                fields.append("k")
            if fields:
                settings = " and ".join(f"{field}={getattr(self, field)!r}" for field in fields)
                rows = " with neuroada_rows (a share of the neurons)" if with_rows else ""
                raise ValueError(
                    f"The NeuroAda adapter's config and weights disagree at layer '{key}': '{saved.weights_file}' "
                    f"holds neuroada_delta of shape {shape}{rows}, but '{saved.config_file}' says {settings}, which "
                    f"gives {expected} for this layer ({d_out} outputs, {d_in} inputs). The two files do not belong "
                    f"together (an edited config, or files of different saves): set {' and '.join(fields)} in the "
                    "config to what the adapter was trained with, or save the adapter again from the model it was "
                    "trained in. Nothing was loaded or changed."
                )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_layer_index(value: object) -> bool:
    return _is_int(value) and value >= 0


def _is_none_or_names(value: object, kinds: tuple[type, ...]) -> bool:
    """None, or one of `kinds`: a string, or a collection of strings."""
    return value is None or (
        isinstance(value, kinds) and (isinstance(value, str) or all(isinstance(v, str) for v in value))
    )


def _saved_deltas(folder: Path) -> SavedDeltas | None:
    """The deltas of the adapter in `folder`, from the header of the weights file that loading will read; None without
    a readable safetensors file (loading reports a damaged one)."""
    config_file = folder / CONFIG_NAME
    weights = weights_to_read(folder / SAFETENSORS_WEIGHTS_NAME, config_file)
    try:
        with safe_open(weights, framework="pt") as saved:
            shapes = {key: tuple(saved.get_slice(key).get_shape()) for key in saved.keys()}
    except (OSError, SafetensorError):
        return None
    delta, rows = f".{PREFIX}delta", f".{PREFIX}rows"
    return SavedDeltas(
        config_file=str(config_file),
        weights_file=str(weights),
        shapes={key.removesuffix(delta): shape for key, shape in shapes.items() if key.endswith(delta)},
        with_rows=frozenset(key.removesuffix(rows) for key in shapes if key.endswith(rows)),
    )
