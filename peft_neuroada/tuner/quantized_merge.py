"""Merging into quantized weights, and running with accelerate's offloading.

* **Quantized merge**: the dequantized weight, added to and quantized again through peft's quantization backend
  (rounded to the grid, which warns, as peft's LoRA does); the replaced quantized weight and its quantization state are
  kept, and unmerge puts them back bit for bit.
* **Offload**: where accelerate offloaded the adapter's own containers (offloading after the adapter was added), they
  are read, never called, so each forward runs their hooks around the layer's computation, as peft's `onload_layer`
  does for a merge; a base layer accelerate offloaded cannot have inputs selected on it.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from accelerate.hooks import AlignDevicesHook
from torch import nn

from .forward import placed_entries, write_placed_

FULL_PRECISION_HINT = (
    "To get a merged model in full precision, load the base model in float32/bfloat16 and call "
    "`PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()`."
)


class QuantizedMerge:
    """Merge and unmerge into a quantized base weight (mixed in before a NeuroAda linear layer). A quantized weight
    (`layer.quantized()`) is requantized through peft's backend: `requantize_refusal`, `snapshot` and `requantize`
    say how, and a layer reading its weights otherwise may say it otherwise."""

    def requantize_refusal(self, quantized: Any) -> str | None:
        """Why the merged weight cannot be quantized again (None: it can)."""
        if getattr(getattr(quantized.base.weight, "quant_state", None), "packing_format_for_cpu", False):
            return "bitsandbytes packed this 4-bit weight for CPU inference, a layout it reads back only approximately"
        return None if quantized.backend.supports_merge else f"peft cannot requantize {quantized.kind} weights"

    def snapshot(self, quantized: Any) -> Callable[[], None]:
        """What puts the quantized weight (and its quantization state) back as it is now."""
        base, weight = quantized.base, quantized.base.weight
        state = {name: copy.copy(vars(base)[name]) for name in ("state", "quant_state") if name in vars(base)}
        weight_state = dict(vars(weight))  # peft's requantizing marks the replaced weight unquantized

        def restore() -> None:
            if self.get_base_layer() is not base:  # the backend replaced the module (HQQ)
                self.base_layer = base
            vars(weight).update(weight_state)
            base.weight = weight
            for name, value in state.items():
                setattr(base, name, value)

        return restore

    def requantize(self, quantized: Any, weight: torch.Tensor) -> None:
        """Quantize `weight` (the dequantized weight with the deltas added) again and install it."""
        self.set_base_weight(weight.to(quantized.stored_dtype))

    def _snapshots(self) -> dict[str, Callable[[], None]]:
        """Per merged adapter, what puts back the quantized weight its merge replaced."""
        return vars(self).setdefault("_quantized_originals", {})

    def merged_into_quantized_weight(self) -> bool:
        """Whether adapters are merged into its quantized weight (requantized: the base values are gone)."""
        return bool(self._snapshots())

    def unreadable(self) -> str | None:
        return super().unreadable() or ("adapters are merged into it" if self._snapshots() else None)

    def check_mergeable(self) -> None:
        """Refuse a quantized weight peft cannot quantize again; the tuner's checks for a float one."""
        quantized = self.quantized()
        if quantized is None:
            return super().check_mergeable()
        if reason := self.requantize_refusal(quantized):
            name = self.layer_name or "this layer"
            raise ValueError(f"Cannot merge NeuroAda deltas into '{name}': {reason}. {FULL_PRECISION_HINT}")

    def _merge_one(self, name: str, safe_merge: bool) -> None:
        """The tuner's for a float weight. A quantized one is dequantized, added to and quantized again; the
        replaced quantized weight is kept for unmerge."""
        quantized = self.quantized()  # the layer as the previous adapter left it
        if quantized is None:
            return super()._merge_one(name, safe_merge)
        weight, placement = quantized.dense(), self.placement(name)
        merged = placed_entries(weight, placement) + self.neuroada_delta[name].detach().to(weight.dtype)
        self.check_finite(name, merged, safe_merge)
        warnings.warn(
            f"Merge NeuroAda deltas into a {quantized.kind} layer may get different generations due to rounding "
            f"errors: the merged weight is quantized again (unmerge restores the original exactly). "
            f"{FULL_PRECISION_HINT}",
            stacklevel=3,
        )
        self._snapshots()[name] = self.snapshot(quantized)
        self.merged_adapters.append(name)
        write_placed_(weight, placement, merged)
        self.requantize(quantized, weight)

    def unmerge_to(self, count: int) -> None:
        """On a quantized weight each step restores one snapshot, then forgets it, so the layer stays as
        `merged_adapters` says; the tuner's on a float one."""
        snapshots = self._snapshots()
        if not snapshots:
            return super().unmerge_to(count)
        while len(self.merged_adapters) > count:
            snapshots[self.merged_adapters[-1]]()
            del snapshots[self.merged_adapters.pop()]


@contextmanager
def onloaded(containers: Sequence[nn.Module]) -> Iterator[None]:
    """accelerate's hooks of `containers` run around the block as around a call. Not peft's `onload_layer`, which
    also onloads the base layer and writes a disk-offloaded one back: right for a merge, a needless write per call."""
    for container in containers:
        container._hf_hook.pre_forward(container)
    try:
        yield
    finally:
        for container in containers:
            container._hf_hook.post_forward(container, None)


def unreadable_weight(base: nn.Module) -> str | None:
    """Why the values of `base`'s weight cannot be read to select inputs (None: they can)."""
    hook = getattr(base, "_hf_hook", None)
    if isinstance(hook, AlignDevicesHook) and hook.offload:
        return "it is offloaded by accelerate"
    return "it is on the meta device (offloaded or not loaded)" if base.weight.is_meta else None


class Offloaded:
    """A NeuroAda layer under accelerate's offloading (mixed in before it)."""

    def offloaded_containers(self) -> list[nn.Module]:
        """The adapter's containers accelerate hooked (offloading after the adapter was added)."""
        containers = [self.neuroada_delta, self.neuroada_indices, self.neuroada_rows]
        return [container for container in containers if "_hf_hook" in vars(container)]

    def unreadable(self) -> str | None:
        return unreadable_weight(self.get_base_layer()) or super().unreadable()

    def _adapted(self, x: torch.Tensor, adapters: list[str], *args: Any, **kwargs: Any) -> torch.Tensor:
        offloaded = self.offloaded_containers()
        with onloaded(offloaded) if offloaded else nullcontext():
            return super()._adapted(x, adapters, *args, **kwargs)
