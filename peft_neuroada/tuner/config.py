"""Configuration of a NeuroAda adapter."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Literal

import torch
from peft.config import PeftConfig
from peft.utils import PeftType

from .selection import STRATEGIES

# The paper's projections (attention q/k/v/o, MLP gate/up/down) under the names transformers 5 gives them.
LLAMA_STYLE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Defaults for `target_modules=None`, as peft's TRANSFORMERS_MODELS_TO_*_TARGET_MODULES_MAPPING tables (transformers
# 5 names). MoE models keep attention and any dense or shared-expert MLP here; their experts are parameters.
TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING: dict[str, list[str]] = {
    **dict.fromkeys(
        "llama mistral qwen2 qwen3 gemma gemma2 gemma3_text olmo2 mixtral qwen2_moe qwen3_moe gpt_oss olmoe "
        "granitemoe phimoe".split(),
        LLAMA_STYLE_TARGETS,
    ),
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    # DeepSeek's multi-head latent attention projects q and kv through a low-rank pair each.
    **dict.fromkeys(
        ("deepseek_v2", "deepseek_v3"),
        ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", *LLAMA_STYLE_TARGETS[4:]],
    ),
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "gptj": ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"],
    **dict.fromkeys(("bert", "roberta"), ["query", "key", "value", "dense"]),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # the one dtype table
METHOD_NAME = "neuroada"  # peft's name for the method
PREFIX = "neuroada_"  # of every adapter attribute and state-dict key it owns
BIAS_OPTIONS = ("none", "all", f"{METHOD_NAME}_only")  # peft's, as its BaseTuner names them
SEED_RANGE = (-(2**63), 2**64 - 1)  # torch.Generator.manual_seed's; layer_generator's XOR with a CRC32 stays inside


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_none_or_names(value: object, *kinds: type) -> bool:
    """None, or one of `kinds`: a string, or a collection of strings."""
    return value is None or (
        isinstance(value, kinds) and (isinstance(value, str) or all(isinstance(v, str) for v in value))
    )


@dataclass
class NeuroAdaConfig(PeftConfig):
    """Configuration for [`NeuroAdaModel`]: each neuron (output row) of the targeted linear layers gets `k` trainable
    deltas on its inputs of largest |w|, stored with their column indices; the frozen weight is never copied.

    Args:
        k (`int`, *optional*, defaults to `1`):
            Inputs tuned per neuron (the paper: 1 or 20); a layer with fewer inputs tunes all of them.
        target_modules (`Optional[Union[list[str], str]]`, *optional*, defaults to `None`):
            Module names, a regex or 'all-linear'. None: the architecture's default projections (attention q/k/v/o,
            MLP gate/up/down); an architecture without defaults must name them.
        exclude_modules (`Optional[Union[list[str], str]]`, *optional*, defaults to `None`):
            Module names or a regex to leave untouched.
        target_parameters (`Optional[list[str]]`, *optional*, defaults to `None`):
            Parameters adapted by name, as LoRA's: MoE experts' 3-D weights (e.g. 'experts.gate_up_proj'), k per
            neuron of each expert. None with target_modules None: the model's expert projections.
        layers_to_transform (`Optional[Union[list[int], int]]`, *optional*, defaults to `None`):
            Layer indices to adapt (all when None).
        layers_pattern (`Optional[Union[list[str], str]]`, *optional*, defaults to `None`):
            The name of the model's list of layers, with layers_to_transform.
        selection (`str`, *optional*, defaults to `"magnitude"`):
            How inputs are chosen per neuron: 'magnitude' (the paper), 'reverse' or 'random' (selection.STRATEGIES).
        selection_seed (`int`, *optional*, defaults to `0`):
            Seed of 'random' and of neuron_fraction's draw, combined with each layer's name.
        neuron_fraction (`float`, *optional*, defaults to `1.0`):
            Share of each layer's neurons that is tuned (the paper's coverage ablation).
        neuroada_dropout (`float`, *optional*, defaults to `0.0`):
            Dropout on the deltas' input in training, as LoRA's `lora_dropout` (the frozen layer sees the input
            unchanged).
        fan_in_fan_out (`bool`, *optional*, defaults to `False`):
            True for (in, out) weights such as GPT-2's Conv1D (detected and corrected).
        init_weights (`bool`, *optional*, defaults to `True`):
            Zero deltas, so the model starts as its base; False: random ones, for tests.
        bias (`str`, *optional*, defaults to `"none"`):
            Biases trained beside the deltas: 'none', 'all' or 'neuroada_only'.
        delta_dtype (`Optional[str]`, *optional*, defaults to `None`):
            'float32', 'bfloat16' or 'float16' for the deltas; None follows peft's `autocast_adapter_dtype`.
        modules_to_save (`Optional[list[str]]`, *optional*, defaults to `None`):
            Extra modules trained fully and saved with the adapter.
    """

    k: int = field(default=1, metadata={"help": "Inputs tuned per neuron (the paper: 1 or 20)."})
    target_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Module names, a regex or 'all-linear'; None: the model's defaults."}
    )
    exclude_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Module names or a regex to leave untouched."}
    )
    target_parameters: list[str] | None = field(
        default=None, metadata={"help": "Parameters to adapt by name, e.g. MoE experts' 'experts.gate_up_proj'."}
    )
    layers_to_transform: list[int] | int | None = field(
        default=None, metadata={"help": "Layer indices to adapt (all when None)."}
    )
    layers_pattern: list[str] | str | None = field(
        default=None, metadata={"help": "The model's list of layers, with layers_to_transform (e.g. 'h')."}
    )
    selection: str = field(default="magnitude", metadata={"help": "How inputs are chosen (the paper: magnitude)."})
    selection_seed: int = field(default=0, metadata={"help": "Seed of 'random' and of neuron_fraction's draw."})
    neuron_fraction: float = field(default=1.0, metadata={"help": "Share of each layer's neurons that is tuned."})
    neuroada_dropout: float = field(
        default=0.0, metadata={"help": "Dropout on the deltas' input in training, as LoRA's lora_dropout."}
    )
    fan_in_fan_out: bool = field(default=False, metadata={"help": "True for (in, out) weights like GPT-2's Conv1D."})
    init_weights: bool = field(default=True, metadata={"help": "Zero deltas (False: random ones, for tests)."})
    bias: Literal["none", "all", "neuroada_only"] = field(
        default="none", metadata={"help": "Biases trained beside the deltas."}
    )
    delta_dtype: str | None = field(
        default=None, metadata={"help": "float32, bfloat16 or float16; None follows autocast_adapter_dtype."}
    )
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Extra modules trained fully and saved with the adapter."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = PeftType.NEUROADA
        self._check_fields()
        self.neuron_fraction = float(self.neuron_fraction)
        for name in ("target_modules", "exclude_modules"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, set(getattr(self, name)))
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError("NeuroAdaConfig.layers_pattern only has an effect together with layers_to_transform.")
        if isinstance(self.target_modules, str) and self.layers_to_transform is not None:
            raise ValueError(
                "NeuroAdaConfig.layers_to_transform cannot be used when target_modules is a str (a regex)."
            )

    def _check_fields(self) -> None:
        """Refuse a wrong field by name before anything reads it (loaded configs too: peft builds them from JSON)."""
        names, fraction, flag = "a list or set of module names", self.neuron_fraction, "True or False"
        layers = self.layers_to_transform if isinstance(self.layers_to_transform, list) else [self.layers_to_transform]
        accepted = {
            "k": (_is_int(self.k) and self.k >= 1, "a positive integer (the paper uses 1 or 20)"),
            "target_modules": (
                _is_none_or_names(self.target_modules, str, list, set),
                f"None, a string (a regex, or 'all-linear') or {names}",
            ),
            "exclude_modules": (_is_none_or_names(self.exclude_modules, str, list, set), f"None, a regex or {names}"),
            "target_parameters": (
                _is_none_or_names(self.target_parameters, list, set, tuple),
                "None or a list of parameter names (e.g. ['experts.gate_up_proj', 'experts.down_proj'])",
            ),
            "layers_to_transform": (
                self.layers_to_transform is None or all(_is_int(i) and i >= 0 for i in layers),
                "None, a layer index (an integer >= 0) or a list of layer indices",
            ),
            "layers_pattern": (
                _is_none_or_names(self.layers_pattern, str, list),
                "None, the name of the model's list of layers (e.g. 'layers', 'h') or a list of such names",
            ),
            "selection": (
                isinstance(self.selection, str) and self.selection in STRATEGIES,
                f"one of {tuple(STRATEGIES)}",
            ),
            "selection_seed": (
                _is_int(self.selection_seed) and SEED_RANGE[0] <= self.selection_seed <= SEED_RANGE[1],
                "an integer from -2**63 to 2**64 - 1 (what torch.Generator.manual_seed takes)",
            ),
            "neuron_fraction": (
                isinstance(fraction, numbers.Real) and not isinstance(fraction, bool) and 0 < fraction <= 1,
                "in (0, 1]: a number, the share of each layer's neurons that is tuned",
            ),
            "neuroada_dropout": (
                isinstance(self.neuroada_dropout, numbers.Real)
                and not isinstance(self.neuroada_dropout, bool)
                and 0 <= self.neuroada_dropout < 1,
                "a number in [0, 1): the probability of zeroing each input of the deltas in training",
            ),
            "fan_in_fan_out": (isinstance(self.fan_in_fan_out, bool), flag),
            "init_weights": (isinstance(self.init_weights, bool), flag),
            "bias": (isinstance(self.bias, str) and self.bias in BIAS_OPTIONS, f"one of {BIAS_OPTIONS}"),
            "delta_dtype": (
                self.delta_dtype is None or (isinstance(self.delta_dtype, str) and self.delta_dtype in DTYPES),
                f"one of {sorted(DTYPES)} or None",
            ),
            "modules_to_save": (_is_none_or_names(self.modules_to_save, list), "None or a list of module names"),
        }
        for name, (ok, what) in accepted.items():
            if not ok:
                raise ValueError(f"NeuroAdaConfig.{name} must be {what} (got {getattr(self, name)!r}).")
