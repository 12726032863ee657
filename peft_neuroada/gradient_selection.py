"""Gradient-based selection: per neuron, the inputs whose weights have the largest |Σ dL/dw| over the batches.

The dense weight gradient of a layer is `grad_out.T @ x`; it is accumulated only for as many layers at a time as fit
in `max_accumulated_elements`, with one pass over the calibration batches per group of layers, so the full dense
gradient of the whole model never exists at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from .layer import NeuroAdaLayer
from .selection import select_inputs

Batch = dict[str, torch.Tensor]


def _layer_groups(layers: list[tuple[str, NeuroAdaLayer]], budget: int) -> Iterator[list[tuple[str, NeuroAdaLayer]]]:
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
    model: nn.Module,
    group: list[tuple[str, NeuroAdaLayer]],
    batches: list[Batch],
    loss_of: Callable[[nn.Module, Batch], torch.Tensor],
) -> dict[str, torch.Tensor]:
    accumulated = {name: torch.zeros(layer.out_features, layer.in_features) for name, layer in group}
    reached: set[str] = set()

    def watch(name: str) -> Callable:
        def on_forward(layer: NeuroAdaLayer, inputs: tuple, output: torch.Tensor) -> None:
            # Reentrant checkpointing runs each segment first without gradients, then again in backward with them:
            # only the second run's output has a gradient to watch.
            if not output.requires_grad:
                return
            x2d = inputs[0].detach().reshape(-1, layer.in_features)

            def on_grad(grad_out: torch.Tensor) -> None:
                grad2d = grad_out.reshape(-1, layer.out_features)
                accumulated[name].addmm_(grad2d.T.float().cpu(), x2d.float().cpu())
                reached.add(name)

            output.register_hook(on_grad)

        return on_forward

    hooks = [layer.register_forward_hook(watch(name)) for name, layer in group]
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
    loss_of: Callable[[nn.Module, Batch], torch.Tensor] | None = None,
    max_accumulated_elements: int = 1 << 27,
) -> None:
    """Re-select every layer's inputs of `adapter_name` by their summed gradient's magnitude; restart its deltas.

    Call after `get_peft_model(..., NeuroAdaConfig(selection="gradient"))` and before training. `batches` are model
    inputs with labels (e.g. a few tokenized training batches); `loss_of(model, batch)` defaults to
    `model(**batch).loss`. The adapter must be active, trainable and unmerged, since gradients flow through its
    deltas; the gradients the calibration passes leave on the model's parameters are cleared (set to None).
    """
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
        layer.check_reselectable(adapter_name)
    for group in _layer_groups(layers, max_accumulated_elements):
        gradients = _accumulate_gradients(model, group, batches, loss_of)
        for name, layer in group:
            gradient = gradients.pop(name)
            rows = layer.placement(adapter_name).rows
            tuned = gradient if rows is None else gradient[rows.long()]
            cols = select_inputs(tuned, layer.neuroada_delta[adapter_name].shape[1])
            layer.reselect(adapter_name, cols.to(layer.neuroada_indices[adapter_name].device))
    peft_config = getattr(model, "peft_config", {}).get(adapter_name)
    if peft_config is not None:
        peft_config.selection = "gradient"
