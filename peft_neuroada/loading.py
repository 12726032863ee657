"""Checks of an adapter's saved or loaded tensors against the model, before anything of them loads or is allocated.

Deltas that land on other entries than they were trained on change the model silently, so each way in is checked:
a saved config against its weights file's header before injection (`check_saved_deltas`), a state dict through
peft's loading (`check_saved_tensors`: saved columns of any layout become buffers), and any `load_state_dict`
(`check_layer_state`, run by the tuner model's load pre-hook, as resumes call it directly).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors import SafetensorError, safe_open
from torch import nn

from .atomic_file import weights_to_read
from .tuner.index_storage import BUFFER_DTYPE, PACKED_DTYPE, PACKS_PAIRS, index_dtype, to_buffer
from .tuner.selection import INDEX_DTYPE, tuned_neuron_count

# What an adapter saves per layer (state-dict keys `{layer}.{attribute}.{adapter}`): its deltas and index buffers.
SAVED_TENSORS = ("neuroada_delta", "neuroada_indices", "neuroada_rows")


def check_saved_tensors(layer, name: str, adapter: str, state_dict: dict[str, torch.Tensor]) -> None:
    """Validate a NeuroAda layer's tensors in `state_dict` (keys `{name}.{attribute}.{adapter}`) before any loads, and
    turn saved index tensors (any layout `saved_columns` reads) into the layer's buffers, in place."""
    bounds = {"neuroada_indices": layer.in_features, "neuroada_rows": layer.out_features}
    if f"{name}.neuroada_delta.{adapter}" in state_dict:
        for attribute in bounds:
            if adapter in getattr(layer, attribute) and f"{name}.{attribute}.{adapter}" not in state_dict:
                raise ValueError(
                    f"The NeuroAda adapter holds deltas but no {attribute} for layer '{name}': the deltas would "
                    "land on entries chosen again here, not the trained ones. The file is damaged or incomplete; "
                    "save the adapter again from the model it was trained in."
                )
    fits = f"this layer ({layer.out_features} outputs, {layer.in_features} inputs) needs"
    for attribute in SAVED_TENSORS:
        key = f"{name}.{attribute}.{adapter}"
        if key not in state_dict or adapter not in getattr(layer, attribute):
            continue
        saved, expected = state_dict[key], getattr(layer, attribute)[adapter]
        if attribute == "neuroada_indices":
            expected = layer.placement(adapter).cols
            try:
                saved = saved_columns(saved, tuple(expected.shape))
            except ValueError as error:
                raise ValueError(
                    f"The NeuroAda adapter does not fit the base model at layer '{name}': its {attribute} {error} "
                    f"that {fits} for this config. Load the adapter on the base model it was trained on."
                ) from None
        if saved.shape != expected.shape:
            _refuse_shape(name, attribute, saved, expected, fits, layer.in_features)
        if attribute in bounds:
            if problem := index_problem(saved, bounds[attribute], attribute):
                raise ValueError(
                    f"The NeuroAda adapter's {attribute} for layer '{name}' {problem}: it was trained on another base "
                    "model, or its file is damaged or was edited. Load it on the base model it was trained on, or "
                    "save it again from the model it was trained in."
                )
            saved = saved.to(INDEX_DTYPE)
            state_dict[key] = to_buffer(saved, layer.in_features) if attribute == "neuroada_indices" else saved


def _refuse_shape(name: str, attribute: str, saved, expected, fits: str, d_in: int) -> None:
    """Saved deltas with this layer's neurons but another k it could hold: the config's k disagrees with the file
    (unless k was cut to a smaller layer's inputs where it was trained); else the base model differs."""
    if attribute == "neuroada_delta" and saved.dim() == expected.dim() == 2:
        if saved.shape[0] == expected.shape[0] and saved.shape[1] <= d_in:
            raise ValueError(
                f"The NeuroAda adapter's tensors do not match its config at layer '{name}': its {attribute} holds "
                f"{saved.shape[1]} per neuron, but the config's k gives {expected.shape[1]}. They come from an "
                "adapter with another k (for a saved adapter: its config and weights files do not belong together; "
                "save it again from the model it was trained in), or from one trained on a base model with fewer "
                "inputs here."
            )
    raise ValueError(
        f"The NeuroAda adapter does not fit the base model at layer '{name}': its {attribute} has shape "
        f"{tuple(saved.shape)}, but {fits} {tuple(expected.shape)} for this config. Load the adapter on the base "
        "model it was trained on."
    )


def check_layer_state(layer, name: str, state_dict: dict[str, torch.Tensor]) -> None:
    """Refuse a state dict that would copy invalid indices into a NeuroAda layer's index buffers (kernels and merges
    would write other weight entries), or change a merged adapter's tensors (the merged weights would go on serving
    the old values)."""
    for adapter in layer.neuroada_delta:
        shape = layer.neuroada_delta[adapter].shape
        loaded = {attribute: state_dict.get(f"{name}.{attribute}.{adapter}") for attribute in SAVED_TENSORS}
        if problem := layer.placement_problem(shape, loaded["neuroada_indices"], loaded["neuroada_rows"]):
            raise ValueError(
                f"Refusing to load adapter '{adapter}' at layer '{name}': {problem}. Nothing was loaded. The state "
                "dict does not hold this adapter as saved from this model (damaged, edited, or from another adapter "
                "or base model): load a checkpoint of this model, or load the adapter from its saved files."
            )
        if adapter in layer.merged_adapters and any(
            tensor is not None and not _same_values(tensor, getattr(layer, attribute)[adapter])
            for attribute, tensor in loaded.items()
            if adapter in getattr(layer, attribute)
        ):
            raise ValueError(
                f"Cannot load new values into adapter '{adapter}' (layer '{name}'): it is merged into the base "
                "weights, which would keep serving its old values. Unmerge it first (`model.unmerge_adapter()`), "
                "load, then merge again if you want it merged."
            )


def _same_values(loaded: torch.Tensor, current: torch.Tensor) -> bool:
    if loaded.shape != current.shape or loaded.is_meta:
        return False
    return torch.equal(loaded.to(device=current.device, dtype=current.dtype), current.detach())


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


def buffer_problem(buffer: torch.Tensor, shape: torch.Size | tuple[int, int], d_in: int) -> str | None:
    """How `buffer` differs from `to_buffer`'s for (n, k) columns of `d_in` inputs, or None. Dtype and size must
    match exactly: viewed as int16 pairs, a cast or resized buffer would read as other columns."""
    n, k = shape
    packed = index_dtype(d_in) == PACKED_DTYPE and PACKS_PAIRS
    expected = (n * k + 1) // 2 if packed else (n, k)
    held = buffer.numel() if packed else tuple(buffer.shape)
    if buffer.dtype != BUFFER_DTYPE or buffer.dim() != (1 if packed else 2) or held != expected:
        wanted = f"{expected} int32 pairs of int16 columns" if packed else f"int32 columns of shape {expected}"
        return f"is a {buffer.dtype} tensor of shape {tuple(buffer.shape)}, where {wanted} belong"
    return None


def saved_columns(saved: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The (n, k) columns a saved index tensor (packed or (n, k)) holds, unpacked whatever the machine's byte order."""
    n, k = shape
    if saved.dim() == 2:
        if tuple(saved.shape) != (n, k):
            raise ValueError(f"holds columns of shape {tuple(saved.shape)}, not {(n, k)}")
        return saved
    if saved.dim() != 1 or saved.dtype not in (BUFFER_DTYPE, torch.int64) or saved.numel() != (n * k + 1) // 2:
        raise ValueError(
            f"is a {saved.dtype} tensor of shape {tuple(saved.shape)}, not {(n * k + 1) // 2} int32 pairs of columns "
            f"for {(n, k)}"
        )
    pairs = saved.long()
    return torch.stack([pairs & 0xFFFF, pairs >> 16], dim=-1).reshape(-1)[: n * k].view(n, k)


def index_problem(indices: torch.Tensor, bound: int, attribute: str = "neuroada_indices") -> str | None:
    """What makes `indices` ((n, k) columns or (n,) rows) differ from selection's (integers in [0, bound), none twice
    in a row), or None: kernels and merges would write other weight entries."""
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        return f"have dtype {indices.dtype}, not integer"
    if indices.is_meta or not indices.numel():
        return None
    # Compared as Python ints: torch compares an int16 tensor with 32768 in int16, where it wraps to -32768.
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= bound:
        what = "inputs" if attribute == "neuroada_indices" else "outputs"
        return f"range over [{low}, {high}] but the layer has only {bound} {what}"
    if indices.shape[-1] > 1 and bool((indices.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        return "name a neuron twice" if attribute == "neuroada_rows" else "name a column twice within a neuron's row"
    return None
