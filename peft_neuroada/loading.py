"""A saved adapter's config checked against its weights file's header before injection, before any delta is
allocated (`check_saved_deltas`). The tensors themselves are checked by the tuner as they load
(guards.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors import SafetensorError, safe_open
from torch import nn

from .atomic_file import weights_to_read
from .tuner.selection import tuned_neuron_count


@dataclass(frozen=True)
class SavedDeltas:
    """A saved adapter's delta shapes by layer (state-dict names, e.g. `base_model.model.model.layers.0.mlp.up_proj`)
    and the layers saved with `neuroada_rows` (neuron_fraction < 1), as its weights file's header lists them."""

    config_file: str
    weights_file: str
    shapes: dict[str, tuple[int, ...]]
    with_rows: frozenset[str]


def saved_deltas(folder: Path) -> SavedDeltas | None:
    """What the weights file that loading will read holds (header only, no tensor data); None without a readable
    one (loading reports a damaged file)."""
    config_file = folder / CONFIG_NAME
    weights = weights_to_read(folder / SAFETENSORS_WEIGHTS_NAME, config_file)
    try:
        with safe_open(weights, framework="pt") as saved:
            shapes = {key: tuple(saved.get_slice(key).get_shape()) for key in saved.keys()}
    except (OSError, SafetensorError):
        return None
    delta, rows = ".neuroada_delta", ".neuroada_rows"
    return SavedDeltas(
        config_file=str(config_file),
        weights_file=str(weights),
        shapes={key.removesuffix(delta): shape for key, shape in shapes.items() if key.endswith(delta)},
        with_rows=frozenset(key.removesuffix(rows) for key in shapes if key.endswith(rows)),
    )


def check_saved_deltas(config, targeted: Iterable[tuple[str, nn.Module]]) -> None:
    """For a config loaded with its weights (`NeuroAdaConfig.from_pretrained`): refuse it, before any delta is
    allocated (a k of 10**9 would build dense-sized ones first), if its k or neuron_fraction gives one of the
    `targeted` (name, module) pairs other deltas than the file holds. Other differences come from another base model:
    `check_saved_tensors` names those."""
    saved = config._saved_deltas
    for name, module in targeted if saved is not None else ():
        key = f"base_model.model.{name}"  # as peft saves a PeftModel's adapter
        shape = saved.shapes.get(key)
        if shape is None or len(shape) != 2:
            continue
        d_in, d_out = _get_in_out_features(module.get_base_layer() if isinstance(module, BaseTunerLayer) else module)
        if d_in is None:
            continue
        (neurons, k), with_rows = shape, key in saved.with_rows
        expected = (tuned_neuron_count(d_out, config.neuron_fraction), min(config.k, d_in))
        fields = []
        if with_rows != (config.neuron_fraction < 1) or (with_rows and neurons != expected[0] and neurons <= d_out):
            fields.append("neuron_fraction")
        if k != expected[1] and k <= d_in:
            fields.append("k")
        if fields:
            settings = " and ".join(f"{field}={getattr(config, field)!r}" for field in fields)
            rows = " with neuroada_rows (a share of the neurons)" if with_rows else ""
            raise ValueError(
                f"The NeuroAda adapter's config and weights disagree at layer '{key}': '{saved.weights_file}' holds "
                f"neuroada_delta of shape {shape}{rows}, but '{saved.config_file}' says {settings}, which gives "
                f"{expected} for this layer ({d_out} outputs, {d_in} inputs). The two files do not belong together "
                f"(an edited config, or files of different saves): set {' and '.join(fields)} in the config to what "
                "the adapter was trained with, or save the adapter again from the model it was trained in. Nothing "
                "was loaded or changed."
            )
