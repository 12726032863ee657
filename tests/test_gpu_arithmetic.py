"""benchmarks/gpu_arithmetic.py prices each path as the code runs it: its ops for peft's LoRA are the kernels peft
runs, with float32 adapters (peft's default on a bf16 base) and with bf16 ones, and where it has k=1's backward keep
only the input columns the deltas read, the plugin's layers do. (docs/performance.md carries its output; a spec in
test_gpu_path.py checks that it is fresh.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

from peft_neuroada import NeuroAdaConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    import gpu_arithmetic
    import gpu_step
finally:
    sys.path.remove(str(BENCHMARKS))


class KernelCount(TorchDispatchMode):
    """The ATen operators that make a tensor of their own (views and metadata changes are free)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # _unsafe_view is a view that its schema does not mark as one
        self.count += not (func.is_view or func.overloadpacket is torch.ops.aten._unsafe_view)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["lora-peft", "lora-bf16"])
def test_the_arithmetic_prices_each_kernel_peft_runs_for_a_lora_layer(path: str) -> None:
    tokens, d_in, d_out, rank = 8, 32, 48, 4
    weight = gpu_step.weights(d_out, d_in, 0.1, torch.device("cpu"), torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["up_proj"])
    model = get_peft_model(gpu_step.OneLayer(weight), config, autocast_adapter_dtype=path == "lora-peft")
    x = torch.randn(tokens, d_in, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, d_out, dtype=torch.bfloat16)
    with KernelCount() as kernels:
        model(x).backward(grad)
    adapter = gpu_arithmetic.FP32 if path == "lora-peft" else gpu_arithmetic.BF16
    assert kernels.count == len(gpu_arithmetic.lora_ops(tokens, d_in, d_out, rank, adapter))


@pytest.mark.parametrize(("d_in", "d_out", "kept"), [(256, 64, True), (64, 256, False)])
def test_the_arithmetic_keeps_only_the_read_columns_where_the_plugins_layers_do(d_in: int, d_out: int, kept: bool):
    """A down projection's k=1 placement reads few of its inputs, an up projection's most."""
    weight = gpu_step.weights(d_out, d_in, 0.1, torch.device("cpu"), torch.float32)
    model = get_peft_model(gpu_step.OneLayer(weight), NeuroAdaConfig(k=1, target_modules=["up_proj"]))
    model(torch.randn(4, d_in)).sum().backward()
    assert (gpu_step.compacted_layers(model) == 1) == kept
    assert (gpu_arithmetic.kept_columns(d_in, d_out, 1) < d_in) == kept
