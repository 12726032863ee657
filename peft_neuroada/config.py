"""Configuration of a NeuroAda adapter."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Literal

import torch
from peft.config import PeftConfig
from peft.utils import PeftType

from .selection import STRATEGIES

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
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"NeuroAdaConfig.k must be a positive integer (got {self.k!r}); the paper uses 1 or 20.")
        if self.selection not in STRATEGIES:
            raise ValueError(f"NeuroAdaConfig.selection must be one of {STRATEGIES} (got {self.selection!r}).")
        if not 0.0 < self.neuron_fraction <= 1.0:
            raise ValueError(f"NeuroAdaConfig.neuron_fraction must be in (0, 1] (got {self.neuron_fraction!r}).")
        if self.bias not in BIAS_OPTIONS:
            raise ValueError(f"NeuroAdaConfig.bias must be one of {BIAS_OPTIONS} (got {self.bias!r}).")
        if self.delta_dtype is not None and self.delta_dtype not in DTYPES:
            raise ValueError(
                f"NeuroAdaConfig.delta_dtype must be one of {sorted(DTYPES)} or None (got {self.delta_dtype!r})."
            )
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)
        if isinstance(self.exclude_modules, list):
            self.exclude_modules = set(self.exclude_modules)
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError("NeuroAdaConfig.layers_pattern only has an effect together with layers_to_transform.")

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
        """Write adapter_config.json atomically: an interrupted save leaves the previous config readable."""
        os.makedirs(save_directory, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=save_directory, prefix=".config-") as staging:
            super().save_pretrained(staging, **kwargs)
            for name in os.listdir(staging):
                with open(os.path.join(staging, name), "rb") as written:
                    os.fsync(written.fileno())  # on disk before the rename makes it the config
                os.replace(os.path.join(staging, name), os.path.join(save_directory, name))
