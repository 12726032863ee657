"""Optional accelerators: faster functions of tensors for one of the tuner's products, plugged into one model's
layers on request. None is on by default: an accelerator earns a default only where the step benchmark shows it at
least 10% faster than the tuner's own path on the device it runs on (docs/performance.md)."""

from __future__ import annotations

from torch import nn

from ..tuner.layer import NeuroAdaLayer
from . import triton_sampled_grad


def use_triton(model: nn.Module) -> int:
    """Compute the deltas' gradient of `model`'s NeuroAda layers with the Triton kernel on CUDA tensors (torch's
    product elsewhere); returns how many layers now use it. Opt-in: not yet timed on a GPU (benchmarks/gpu.sh)."""
    if not triton_sampled_grad.available():
        raise RuntimeError("use_triton needs the triton package: `pip install triton` (Linux, with a CUDA torch).")
    layers = [module for module in model.modules() if isinstance(module, NeuroAdaLayer)]
    for layer in layers:
        layer.kernels = layer.kernels._replace(sampled_grad=triton_sampled_grad.sampled_grad)
    return len(layers)


__all__ = ["use_triton"]
