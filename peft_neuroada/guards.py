"""Guards on the tensors that enter a layer from outside (peft's adapter loading, any `load_state_dict`, a merge of
indices written since, a cast of the buffers) and on merges into a weight other modules hold: deltas that land on other
entries than they were trained on would change the model without a word, and a merge would write other neurons' (or
modules') weights. Each check runs before anything of its input is loaded or written. The plugin's layers and model
call them as components and hooks.

Adapters saved before 2026-12-05 hold int16 columns packed in pairs into a flat int32 tensor (the first column of a
pair in the low half); `saved_columns` reads them, and (n, k) columns of any integer dtype, on any host.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from .tuner.forward import Placement, entry_index, placed_entries
from .tuner.selection import INDEX_DTYPE as BUFFER_DTYPE

# What an adapter saves per layer (state-dict keys `{layer}.{attribute}.{adapter}`): its deltas and index buffers.
INDEX_TENSORS = ("neuroada_indices", "neuroada_rows")
SAVED_TENSORS = ("neuroada_delta", *INDEX_TENSORS)
ANOTHER_BASE = "it was trained on another base model, or its file is damaged or was edited"


def index_range(indices: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest of non-empty `indices`, as Python ints."""
    low, high = torch.stack(indices.aminmax()).tolist()
    return low, high


def saved_columns(saved: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The (n, k) columns a saved index tensor holds: (n, k) columns, or an older adapter's packed pairs."""
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


def index_problem(
    indices: torch.Tensor, bound: int, attribute: str = "neuroada_indices", repeats: bool = False
) -> str | None:
    """What makes `indices` ((n, k) columns or (n,) rows) differ from selection's (integers in [0, bound), none twice
    in a row unless `repeats`), or None."""
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        return f"have dtype {indices.dtype}, not integer"
    if indices.is_meta or not indices.numel():
        return None
    low, high = index_range(indices)
    if low < 0 or high >= bound:
        what = "inputs" if attribute == "neuroada_indices" else "outputs"
        return f"range over [{low}, {high}] but the layer has only {bound} {what}"
    if not repeats and indices.shape[-1] > 1 and bool((indices.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        return "name a neuron twice" if attribute == "neuroada_rows" else "name a column twice within a neuron's row"
    return None


def buffer_problem(buffer: torch.Tensor, shape: torch.Size | tuple[int, int]) -> str | None:
    """How `buffer` differs from an (n, k) int32 column buffer for deltas of `shape`, or None."""
    if buffer.dtype != BUFFER_DTYPE or tuple(buffer.shape) != tuple(shape):
        held = f"is a {buffer.dtype} tensor of shape {tuple(buffer.shape)}"
        return f"{held}, where int32 columns of shape {tuple(shape)} belong"
    return None


def placement_problem(
    layer, shape: torch.Size, buffer: torch.Tensor | None, rows: torch.Tensor | None, repeats: bool = False
) -> str | None:
    """What makes an index buffer or rows (held, or about to be loaded; None: not given) unfit for deltas of `shape`
    in `layer` ("its neuroada_indices ..."), or None; `repeats`: an index named twice is no problem."""
    if buffer is not None:
        if problem := buffer_problem(buffer, shape) or index_problem(buffer, layer.in_features, repeats=repeats):
            return f"its neuroada_indices {problem}"
    if rows is not None:
        problem = "is not an (n,) integer tensor" if rows.shape != shape[:1] else None
        if problem := problem or index_problem(rows, layer.out_features, "neuroada_rows", repeats):
            return f"its neuroada_rows {problem}"
    return None


def check_saved_tensors(layer, name: str, adapter: str, state_dict: dict[str, torch.Tensor]) -> bool:
    """Validate a layer's tensors in a saved adapter's `state_dict` (keys `{name}.{attribute}.{adapter}`) as peft
    loads it, and turn saved index tensors (any layout `saved_columns` reads) into the layer's buffers, in place.
    Returns whether the saved columns look chosen on another base: on sampled rows, less than half of them are among
    the columns this layer just selected on its own base (quantizing a base moves a few, another base nearly all)."""
    chosen_elsewhere = False
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
                    f"The NeuroAda adapter's {attribute} for layer '{name}' {problem}: {ANOTHER_BASE}. Load it on the "
                    "base model it was trained on, or save it again from the model it was trained in."
                )
            saved = saved.to(BUFFER_DTYPE)
            if attribute == "neuroada_indices":
                chosen_elsewhere = _shared_share(saved, expected) < 0.5
            state_dict[key] = saved
    return chosen_elsewhere


def _shared_share(saved: torch.Tensor, selected: torch.Tensor, sampled_rows: int = 64) -> float:
    """The share of saved columns that are among the selected ones, on up to `sampled_rows` rows spread evenly."""
    rows = torch.linspace(0, len(saved) - 1, min(len(saved), sampled_rows)).long()
    saved, selected = saved[rows].to(selected.device, torch.long), selected[rows].long()
    return (saved[:, :, None] == selected[:, None, :]).any(-1).float().mean().item()


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


def check_layer_state(layer, state_dict: dict[str, torch.Tensor], prefix: str, *_: object) -> None:
    """Refuse a state dict (any `load_state_dict`; keys `{prefix}{attribute}.{adapter}`) that would copy invalid
    indices into a layer's index buffers, or change a merged adapter's tensors without the base weights (the merged
    weights would go on serving the old values). A layer's load pre-hook, and its model's for all layers before any
    loads.

    A state dict that holds the base layer's tensors too, loaded while adapters are merged, is a merged model's state:
    it loads as given (an index named twice included: a merge refuses it later), and `merged_state_loaded` then makes
    unmerging subtract the loaded deltas from the loaded weight, as LoRA's unmerge subtracts its delta."""
    name = prefix.removesuffix(".") or layer.layer_name
    base = {f"{prefix}base_layer.{key}": value for key, value in layer.base_layer.state_dict(keep_vars=True).items()}
    as_merged = bool(layer.merged_adapters) and layer.quantized() is None and base.keys() <= state_dict.keys()
    changed = as_merged and any(not _same_values(state_dict[key], value) for key, value in base.items())
    for adapter in layer.neuroada_delta:
        shape = layer.neuroada_delta[adapter].shape
        loaded = {attribute: state_dict.get(f"{prefix}{attribute}.{adapter}") for attribute in SAVED_TENSORS}
        merged = adapter in layer.merged_adapters
        rows = loaded["neuroada_rows"]
        if problem := placement_problem(layer, shape, loaded["neuroada_indices"], rows, repeats=merged and as_merged):
            raise ValueError(
                f"Refusing to load adapter '{adapter}' at layer '{name}': {problem}. Nothing was loaded. The state "
                "dict does not hold this adapter as saved from this model (damaged, edited, or from another adapter "
                "or base model): load a checkpoint of this model, or load the adapter from its saved files."
            )
        if merged and any(
            tensor is not None and not _same_values(tensor, getattr(layer, attribute)[adapter])
            for attribute, tensor in loaded.items()
            if adapter in getattr(layer, attribute)
        ):
            if not as_merged:
                raise ValueError(
                    f"Cannot load new values into adapter '{adapter}' (layer '{name}'): it is merged into the base "
                    "weights, which would keep serving its old values. Unmerge it first (`model.unmerge_adapter()`), "
                    "load, then merge again if you want it merged; or load a full state dict, base weights included."
                )
            changed = True
    layer.merged_state_changed = changed


def merged_state_loaded(layer, *_: object) -> None:
    """After a merged model's state loaded into `layer` (`check_layer_state`): what unmerging writes back becomes the
    loaded weight less the loaded deltas of each merged adapter, the latest first (an index named twice subtracts
    each of its deltas). A layer's load post-hook."""
    if not layer.merged_state_changed:
        return
    layer.merged_state_changed = False
    weight = layer.weight_out_in().detach()
    unmerged = weight.clone()
    for name in reversed(layer.merged_adapters):
        rows = layer.neuroada_rows[name] if name in layer.neuroada_rows else None
        placement = Placement(layer.neuroada_indices[name], rows).copy()  # (layer.placement may refuse repeats)
        delta = layer.neuroada_delta[name].detach().to(weight.dtype)
        unmerged.index_put_(entry_index(unmerged, placement), -delta, accumulate=True)
        layer._merge_originals[name] = (placement, placed_entries(unmerged, placement))


def _same_values(loaded: torch.Tensor, current: torch.Tensor) -> bool:
    if loaded.shape != current.shape or loaded.is_meta:
        return False
    return torch.equal(loaded.to(device=current.device, dtype=current.dtype), current.detach())


def _storage_key(tensor: torch.Tensor) -> tuple:
    """Tensors with equal keys share memory (for tensors without plain storage: only the tensor itself)."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        pointer = 0
    return (tensor.device, pointer) if pointer else ("object", id(tensor))


def mark_shared_weights(model: nn.Module, layer_cls: type) -> None:
    """Record on every NeuroAda layer (`layer_cls`) which other modules hold its base weight (the same tensor, or
    its memory)."""
    holders: dict[tuple, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        own = itertools.chain(
            module.named_parameters(recurse=False, remove_duplicate=False),
            module.named_buffers(recurse=False, remove_duplicate=False),
        )
        for _, tensor in own:
            if tensor is not None:
                holders.setdefault(_storage_key(tensor), []).append((name, module))
    for module in model.modules():
        if isinstance(module, layer_cls):
            base = module.get_base_layer()
            held = holders.get(_storage_key(module.weight_out_in()), [])
            module.weight_shared_with = tuple(sorted({name for name, holder in held if holder is not base}))


def check_merge(layer, names: list[str]) -> None:
    """A layer's `merge_check` component: refuse, before anything is written, indices written since they were loaded
    (a merge would write other entries), and a weight other modules hold (a merge would change them too)."""
    for name in [name for name in names if name in layer.neuroada_delta]:
        rows = layer.neuroada_rows[name] if name in layer.neuroada_rows else None
        shape = layer.neuroada_delta[name].shape
        if problem := placement_problem(layer, shape, layer.neuroada_indices[name], rows):
            raise ValueError(
                f"Cannot merge NeuroAda adapter '{name}' into '{layer.layer_name}': {problem}, so it would write "
                "other weight entries. Nothing was written: load the adapter again from its saved files."
            )
    if shared := getattr(layer, "weight_shared_with", ()):
        raise ValueError(
            f"Cannot merge NeuroAda deltas into the weight of '{layer.layer_name or 'this layer'}': it is shared "
            f"with {', '.join(shared)}, and merging would change those modules too. Give the layer its own copy of "
            "the weight first, e.g. `layer.base_layer.weight = torch.nn.Parameter(layer.base_layer.weight.detach()"
            ".clone(), requires_grad=False)` (a frozen copy), or keep the adapter unmerged."
        )


def guard_loads(layer: nn.Module) -> None:
    """Check the indices any `load_state_dict` brings into `layer`, and keep a merged model's loaded state
    unmergeable (`check_layer_state`, `merged_state_loaded`)."""
    layer.merged_state_changed = False
    layer.register_load_state_dict_pre_hook(check_layer_state)
    layer.register_load_state_dict_post_hook(merged_state_loaded)


def check_before_load(model: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
    """A NeuroAda model's load pre-hook: every layer's tensors checked before any loads (resumes)."""
    for name, layer in model.named_modules():
        if isinstance(layer, model.tuner_layer_cls):
            check_layer_state(layer, state_dict, f"{prefix}{name}.")
