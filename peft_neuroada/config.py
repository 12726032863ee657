"""The plugin's NeuroAdaConfig: the tuner's, with crash-safe saving and the weights file's shapes kept on loading."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from peft.config import PeftConfig
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

from .atomic_file import commit_config
from .loading import SavedDeltas, saved_deltas
from .tuner import config as tuner_config

# LoRA's options a LoRA user reaches for, and NeuroAda's way to the same end.
LORA_OPTIONS = {
    "r": "LoRA's rank: NeuroAda's size is k, inputs tuned per neuron, and peft_neuroada.k_for_budget(model, "
    "NeuroAdaConfig(), lora_rank=r) gives the k of LoRA's parameter count",
    "lora_alpha": "LoRA's scaling: NeuroAda adds its deltas unscaled; tune the learning rate instead",
    "lora_dropout": "use neuroada_dropout",
}


@dataclass
class NeuroAdaPluginConfig(tuner_config.NeuroAdaConfig):
    __doc__ = tuner_config.NeuroAdaConfig.__doc__

    def __new__(cls, *args, **kwargs):
        """A field it lacks is refused naming the class users import and, for LoRA's options, NeuroAda's way, in
        Python's words (peft reads them to drop the fields of a newer release from a saved config)."""
        for name in sorted(kwargs.keys() - {field.name for field in fields(cls)}):
            hint = f" ({LORA_OPTIONS[name]})" if name in LORA_OPTIONS else ""
            raise TypeError(f"NeuroAdaConfig got an unexpected keyword argument '{name}'{hint}.")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        super().__post_init__()
        # Not a field (never saved): set by `from_pretrained`, checked by `NeuroAdaModel._pre_injection_hook`.
        self._saved_deltas: SavedDeltas | None = None

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """Write adapter_config.json by one rename, which commits the adapter's save (see atomic_file.py)."""
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
        if isinstance(config, NeuroAdaPluginConfig) and (folder / CONFIG_NAME).is_file():
            config._saved_deltas = saved_deltas(folder)
        return config

    @property
    def trainable_token_indices(self) -> None:
        """LoRA's option, which tools such as TRL read on any peft config; setting it says what to do instead."""
        return None

    @trainable_token_indices.setter
    def trainable_token_indices(self, value: object) -> None:
        raise ValueError(
            f"NeuroAda has no trainable_token_indices (asked for {value!r}): it is a LoRA option in peft. Train the "
            'embeddings through modules_to_save (e.g. NeuroAdaConfig(modules_to_save=["embed_tokens", "lm_head"])), '
            "after adding the new tokens to the tokenizer and resizing the model's embeddings yourself."
        )


NeuroAdaConfig = NeuroAdaPluginConfig  # the name users import
