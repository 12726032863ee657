"""Mixed batches as peft's LoRA serves them: `adapter_names=[...]` in `forward`/`generate` gives each row of the batch
its own adapter (`"__base__"`: none). The model hands each layer its rows' names through forward pre-hooks, and a
layer runs each adapter's rows as one sub-batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch
from peft.tuners.lora.model import _adapter_names_pre_forward_hook, _get_encoder
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

BASE_ADAPTER_NAME = "__base__"
MIXED_BATCH_REFUSAL = (
    "NeuroAda target_parameters (expert weights) do not serve mixed batches (`adapter_names`), as peft's LoRA "
    "ParamWrapper does not: run one adapter per call, or merge it."
)


class MixedBatch(NamedTuple):
    """peft's `adapter_names` of a forward/generate call, per row; under beam search the encoder layers of an
    encoder-decoder model see the unrepeated names."""

    names: list[str]
    encoder_names: list[str] | None = None
    encoder_layers: frozenset[int] = frozenset()

    def for_layer(self, layer: nn.Module) -> list[str]:
        return self.encoder_names if id(layer) in self.encoder_layers else self.names


@contextmanager
def names_handed_to(modules: list[nn.Module], mixed: MixedBatch) -> Iterator[None]:
    """Within the block, a forward pre-hook on each of `modules` hands it its rows' adapter names, as LoRA's does."""
    hooks = [
        module.register_forward_pre_hook(
            partial(_adapter_names_pre_forward_hook, adapter_names=mixed.for_layer(module)), with_kwargs=True
        )
        for module in modules
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


class MixedBatchLinear:
    """A NeuroAda linear layer serving mixed batches (mixed in before it)."""

    def forward(self, x: torch.Tensor, *args: Any, adapter_names: list[str] | None = None, **kwargs: Any):
        # `disable_adapter()` serves the base model before adapter_names count, as under LoRA
        if adapter_names is None or self.disable_adapters:
            return super().forward(x, *args, **kwargs)
        return self._mixed_batch_forward(x, adapter_names, *args, **kwargs)

    def _mixed_batch_forward(self, x: torch.Tensor, adapter_names: list[str], *args: Any, **kwargs: Any):
        """Each row through its own adapter (`"__base__"` or an adapter this layer lacks: the base layer alone)."""
        if len(x) != len(adapter_names):
            raise ValueError(
                "Length of `adapter_names` should be the same as the number of inputs, but got "
                f"{len(adapter_names)} and {len(x)} respectively."
            )
        if self.merged:
            raise ValueError(
                "Cannot pass `adapter_names` when there are merged adapters, please call `unmerge_adapter` first."
            )
        if not adapter_names:  # no rows: the base layer's empty output, shaped and typed as LoRA's
            return self.base_layer(x, *args, **kwargs)
        rows_of: dict[str, list[int]] = {}
        for row, name in enumerate(adapter_names):
            rows_of.setdefault(name, []).append(row)
        result = None
        for name, rows in rows_of.items():
            index = torch.tensor(rows, device=x.device)
            sub_batch = x.index_select(0, index)
            if name in self.neuroada_delta:
                out = self._adapted(sub_batch, [name], *args, **kwargs)
            else:
                out = self.base_layer(sub_batch, *args, **kwargs)
            if result is None:
                result = out.new_empty((len(x), *out.shape[1:]))
            result.index_copy_(0, index, out.to(result.dtype))
        return result


class MixedBatchModel:
    """A NeuroAda model serving mixed batches (mixed in before it), as LoRA's: pre-hooks hand each layer its rows'
    adapter names."""

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        mixed = self._mixed_batch(kwargs.pop("adapter_names", None), kwargs.get("num_beams"))
        if mixed is None:
            yield
            return
        receivers = [m for m in self.model.modules() if isinstance(m, (MixedBatchLinear, AuxiliaryTrainingWrapper))]
        with names_handed_to(receivers, mixed):
            yield

    def _mixed_batch(self, adapter_names: list[str] | None, num_beams: Any) -> MixedBatch | None:
        """The call's `adapter_names` checked, with what beam search repeats (None: no mixed batch)."""
        if adapter_names is None:
            return None
        if self.training:
            raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
        layers = [module for module in self.model.modules() if isinstance(module, self.tuner_layer_cls)]
        if not all(isinstance(layer, MixedBatchLinear) for layer in layers):
            raise ValueError(MIXED_BATCH_REFUSAL)
        unexpected = {name for name in adapter_names if name != BASE_ADAPTER_NAME} - self.peft_config.keys()
        if unexpected:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unexpected))}")
        if not (isinstance(num_beams, int) and num_beams > 1):
            return MixedBatch(list(adapter_names))
        # Beam search repeats every input num_beams times, except in an encoder.
        encoder = _get_encoder(self.model)
        return MixedBatch(
            [name for name in adapter_names for _ in range(num_beams)],
            list(adapter_names),
            frozenset(id(m) for m in encoder.modules()) if encoder is not None else frozenset(),
        )
