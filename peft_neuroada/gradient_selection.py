"""Gradient-based selection, as the official code's `perCell_gra_add`: per neuron, the inputs with the largest
|Σ dL/dw| over the batches, accumulated for as many layers as fit in `max_accumulated_elements` per pass, so the
model's dense gradients never exist at once. It re-selects an adapter the tuner made by magnitude (a workflow with
calibration batches, which the plugin adds beside the tuner's offline selections)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial

import torch
from torch import nn

from .tuner.experts import ParamWrapper
from .tuner.layer import NeuroAdaLayer
from .tuner.selection import INDEX_DTYPE as BUFFER_DTYPE
from .tuner.selection import STRATEGIES, Strategy, select_inputs

Batch = dict[str, torch.Tensor]
Layers = list[tuple[str, NeuroAdaLayer]]
LossOf = Callable[[nn.Module, Batch], torch.Tensor]

# selection="gradient": inputs chosen by magnitude when the adapter is made, until `select_by_gradient` re-selects.
STRATEGIES["gradient"] = Strategy(
    STRATEGIES["magnitude"].score,
    then=f"inputs are chosen by magnitude until you call {__name__}.select_by_gradient(model, calibration_batches) "
    "before training",
)


def _layer_groups(layers: Layers, budget: int) -> Iterator[Layers]:
    group, used = [], 0
    for name, layer in layers:
        size = layer.in_features * layer.out_features
        if group and used + size > budget:
            yield group
            group, used = [], 0
        group.append((name, layer))
        used += size
    if group:
        yield group


def _accumulate_gradients(
    model: nn.Module, group: Layers, batches: list[Batch], loss_of: LossOf
) -> dict[str, torch.Tensor]:
    accumulated = {name: torch.zeros(layer.out_features, layer.in_features) for name, layer in group}
    reached: set[str] = set()

    def on_forward(name: str, layer: NeuroAdaLayer, inputs: tuple, output: torch.Tensor) -> None:
        # Reentrant checkpointing runs each segment without gradients, then again in backward with them.
        if output.requires_grad:
            output.register_hook(partial(on_grad, name, layer, inputs[0].detach().reshape(-1, layer.in_features)))

    def on_grad(name: str, layer: NeuroAdaLayer, x2d: torch.Tensor, grad_out: torch.Tensor) -> None:
        grad2d = grad_out.reshape(-1, layer.out_features)
        accumulated[name].addmm_(grad2d.T.float().cpu(), x2d.float().cpu())
        reached.add(name)

    hooks = [layer.register_forward_hook(partial(on_forward, name)) for name, layer in group]
    try:
        with torch.enable_grad():
            for batch in batches:
                loss_of(model, batch).backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    if missed := [name for name, _ in group if name not in reached]:
        more = f" (and {len(missed) - 1} more)" if len(missed) > 1 else ""
        raise ValueError(
            f"No gradient reached the NeuroAda layer '{missed[0]}'{more} during gradient selection: the loss must "
            "depend on the layers' outputs through their trainable deltas."
        )
    return accumulated


def select_by_gradient(
    model: nn.Module,
    batches: Iterable[Batch],
    adapter_name: str = "default",
    loss_of: LossOf | None = None,
    max_accumulated_elements: int = 1 << 27,
) -> None:
    """Re-select `adapter_name`'s inputs by their summed gradient's magnitude, restarting its deltas: call after
    `get_peft_model(..., NeuroAdaConfig(selection="gradient"))`, before training, with a few labelled batches. The
    adapter must be active, trainable and unmerged; the parameters' gradients are cleared after."""
    loss_of = loss_of or (lambda m, batch: m(**batch).loss)
    batches = list(batches)
    layers = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, NeuroAdaLayer) and adapter_name in module.neuroada_delta
    ]
    if not layers:
        raise ValueError(f"The model has no NeuroAda layers for adapter '{adapter_name}'.")
    for _, layer in layers:
        check_reselectable(layer, adapter_name)
    for group in _layer_groups(layers, max_accumulated_elements):
        gradients = _accumulate_gradients(model, group, batches, loss_of)
        for name, layer in group:
            gradient, rows = gradients.pop(name), layer.placement(adapter_name).rows
            tuned = gradient if rows is None else gradient[rows.long()]
            cols = select_inputs(tuned, layer.neuroada_delta[adapter_name].shape[1])
            reselect(layer, adapter_name, cols.to(layer.neuroada_indices[adapter_name].device))
    if (peft_config := getattr(model, "peft_config", {}).get(adapter_name)) is not None:
        peft_config.selection = "gradient"


def check_reselectable(layer: NeuroAdaLayer, adapter_name: str) -> None:
    """Raise if the adapter's inputs cannot be selected again: an expert stack (whose forward hides each expert's
    input), a merged adapter, or deltas that do not train."""
    if isinstance(layer, ParamWrapper):
        raise ValueError(
            f"Gradient selection does not reach NeuroAda expert weights ('{layer.layer_name}'): the experts' own "
            "forward hides each expert's input. Use selection='magnitude' for target_parameters, or leave them out "
            "of this adapter (target_parameters=[])."
        )
    _refuse_merged(layer, adapter_name)
    if not layer.neuroada_delta[adapter_name].requires_grad:
        raise ValueError(
            f"Adapter '{adapter_name}' does not train (loaded for inference, or not the active adapter); "
            "selecting its inputs by gradient needs gradients through its deltas: load it with "
            "`PeftModel.from_pretrained(..., is_trainable=True)` or make it the active adapter."
        )


def reselect(layer: NeuroAdaLayer, adapter_name: str, cols: torch.Tensor) -> None:
    """Move an unmerged adapter to new input columns (same neurons) and restart its deltas from initialisation."""
    _refuse_merged(layer, adapter_name)
    delta = layer.neuroada_delta[adapter_name]
    layer.neuroada_indices[adapter_name] = cols.to(BUFFER_DTYPE)
    with torch.no_grad():
        delta.copy_(layer._initial_delta(adapter_name, *delta.shape, delta.dtype))


def _refuse_merged(layer: NeuroAdaLayer, adapter_name: str) -> None:
    if adapter_name in layer.merged_adapters:
        raise ValueError(f"Adapter '{adapter_name}' is merged; unmerge it before selecting its inputs again.")
