"""NeuroAda's accelerators, behind the tuner's one interface (`tuner.layer.Accelerator`): the sparse products on the
C kernels (CPU) or Triton (CUDA), and the in-place merged matmul with its weight lock (paths.py). The plugin's layers
compute through `ACCELERATOR`; a layer of the tuner alone takes the plain path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from ..tuner.layer import Accelerator, NeuroAdaLayer
from . import paths
from .lock import WeightLock, weight_lock


def frozen_linear(layer: NeuroAdaLayer) -> paths.FrozenLinear:
    """The frozen layer under `layer` as the paths take it, with its weight's lock."""
    base = layer.base_layer  # (`get_base_layer()` asks `hasattr` twice, at every visit)
    base = base.get_base_layer() if isinstance(base, BaseTunerLayer) else base
    weight = base.weight.T if layer.fan_in_fan_out else base.weight
    return paths.FrozenLinear(base, weight, layer.weight_shared_with, weight_lock(layer))


class Accelerated(Accelerator):
    """The in-place, direct and general paths of paths.py, each call on the fastest one its situation allows."""

    def frozen_output(self, layer: NeuroAdaLayer, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return paths.frozen_output(frozen_linear(layer), x, *args, **kwargs)

    def adapted_output(
        self, layer: NeuroAdaLayer, x: torch.Tensor, adapters: Sequence[str], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        placements = [layer.placement(name) for name in adapters]
        deltas = [layer.neuroada_delta[name] for name in adapters]
        inplace = all(layer.inplace_forward[name] for name in adapters)
        frozen = frozen_linear(layer)
        return paths.adapted_linear(frozen, x, placements, deltas, layer.out_features, inplace, *args, **kwargs)

    def weight_writes(self, layer: NeuroAdaLayer) -> WeightLock:
        return weight_lock(layer).on(layer.weight_out_in().device)


ACCELERATOR = Accelerated()

__all__ = ["ACCELERATOR", "Accelerated", "WeightLock", "frozen_linear"]
