"""The CUDA training path, specified on the CPU: every part of it has a twin here that computes the same values (the
device script, benchmarks/gpu_step.py, times them on a GPU, and tests/test_cuda.py runs these specs there).

* the deltas' gradient as one GEMM gathered at the placement (`forward.sampled_grad`, the tuner's),
* the merged copy written without an accumulating (sorting) write, the same bits as one,
* a training step that asks nothing of the host the device would wait for (no `unique`, `nonzero` or `item`),
* no more ATen operators per adapted layer than LoRA's at the same budget (benchmarks/step_profile.py).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.accel import sparse_products
from peft_neuroada.tuner import forward
from peft_neuroada.tuner.forward import Placement, entry_index, merged_copy
from peft_neuroada.tuner.layer import Linear
from tests.conftest import neuroada_layers, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    gpu_step = importlib.import_module("gpu_step")
finally:
    sys.path.remove(str(BENCHMARKS))
HALF_AND_FULL = [torch.float32, torch.bfloat16, torch.float16]
# (tokens, d_in, neurons, k, some rows only): tile-free sizes, one token, one input, k=1 and k above a 64-wide tile.
SHAPES = [
    (37, 53, 29, 20, False),
    (1, 16, 12, 3, False),
    (9, 1, 7, 1, False),
    (70, 100, 40, 1, True),
    (5, 90, 6, 80, True),
]


def _case(tokens: int, d_in: int, n: int, k: int, some_rows: bool, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    d_out = 2 * n if some_rows else n
    x = torch.randn(tokens, d_in, generator=generator).to(dtype)
    grad = torch.randn(tokens, d_out, generator=generator).to(dtype)
    cols = torch.stack([torch.randperm(d_in, generator=generator)[:k] for _ in range(n)]).int()
    rows = torch.randperm(d_out, generator=generator)[:n].int() if some_rows else None
    return x, grad, cols, rows


def _dense_reference(x, grad, cols, rows) -> torch.Tensor:
    """The dense weight gradient in float64, at the placement."""
    tuned = grad if rows is None else grad[:, rows.long()]
    return (tuned.double().T @ x.double()).gather(1, cols.long())


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + ("-rows" if s[4] else ""))
def test_the_gathered_delta_gradient_is_the_dense_weight_gradient_at_the_placement(shape, dtype) -> None:
    """Operands read in their own dtype (exact products), accumulated and returned in float32."""
    x, grad, cols, rows = _case(*shape, dtype)
    got = forward.sampled_grad(x, grad, cols, rows)
    assert got.dtype == torch.float32 and got.shape == cols.shape
    scale = float(x.double().abs().max() * grad.double().abs().max() * x.shape[0]) or 1.0
    torch.testing.assert_close(got.double(), _dense_reference(x, grad, cols, rows), rtol=0, atol=2e-6 * scale)
    assert torch.equal(got, forward.sampled_grad(x, grad, cols, rows)), "two runs, the same bits"


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "x".join(map(str, s[:4])))
def test_the_gathered_and_the_sparse_delta_gradients_agree(shape) -> None:
    """CUDA's default and the CPU's compute the same values from the same placement."""
    x, grad, cols, rows = _case(*shape, torch.float32)
    gathered, sparse = forward.sampled_grad(x, grad, cols, rows), sparse_products.sampled_grad(x, grad, cols, rows)
    torch.testing.assert_close(gathered, sparse, rtol=1e-5, atol=1e-5)


def _accumulated(weight, placements, deltas) -> torch.Tensor:
    """The merged copy as an accumulating write makes it (what CUDA sorts for)."""
    copy = weight.clone()
    for placement, delta in zip(placements, deltas, strict=True):
        copy.index_put_(entry_index(copy, placement), delta.to(copy.dtype), accumulate=True)
    return copy


def _weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    plain = torch.randn(24, 40, generator=generator).to(dtype)
    return {
        "row-major": plain,
        "transposed": torch.randn(40, 24, generator=generator).to(dtype).T,  # Conv1D's (d_in, d_out) storage
        "expert-stack": torch.randn(3, 8, 40, generator=generator).to(dtype),  # neurons counted expert after expert
    }


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
@pytest.mark.parametrize("layout", ["row-major", "transposed", "expert-stack"])
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "as-loaded"])
def test_the_merged_copy_is_the_accumulating_writes_bits_overlapping_adapters_included(dtype, layout, prepared):
    weight = _weights(dtype)[layout]
    generator = torch.Generator().manual_seed(2)
    full = Placement(torch.stack([torch.randperm(40, generator=generator)[:5] for _ in range(24)]).int())
    some = Placement(full.cols[::2, :3].clone(), torch.arange(0, 24, 2, dtype=torch.int32))  # shares entries
    placements = [p.prepared() if prepared else p for p in (full, some)]
    deltas = [torch.randn(24, 5, generator=generator) * 1e-2, torch.randn(12, 3, generator=generator).to(dtype)]
    got = merged_copy(weight, placements, deltas)
    assert torch.equal(got, _accumulated(weight, placements, deltas))
    assert got.stride() == weight.stride() and got.data_ptr() != weight.data_ptr()


class _Calls(TorchDispatchMode):
    """Counts the ATen operators called under it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# What makes the host wait for a CUDA device: results whose size or value the host must read.
WAITS_ON_THE_DEVICE = re.compile(r"^_?(unique\w*|nonzero\w*|_local_scalar_dense|item|masked_select)$")


@pytest.mark.parametrize("k", [1, 20])
def test_a_training_steps_forward_and_backward_ask_the_device_for_nothing(k, token_batch) -> None:
    """Compaction at k=1 reads `unique` once per kept placement, not per call (`layers.with_read_columns`); the
    optimizer's step, whose CPU implementation reads its step count, is not the tuner's."""
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=k))
    compacted = [layer.placement("default").read is not None for layer in neuroada_layers(model)]
    assert (k == 1) == any(compacted), "k=1 compacts some layers' inputs, k=20 none"
    model(input_ids=token_batch, labels=token_batch).loss.backward()
    with _Calls() as calls:
        model(input_ids=token_batch, labels=token_batch).loss.backward()
    waits = {name: count for name, count in calls.counts.items() if WAITS_ON_THE_DEVICE.match(name)}
    assert not waits, waits


@pytest.mark.parametrize("k", [1, 20])
def test_the_tuner_alone_asks_the_device_for_nothing_in_a_step_either(k) -> None:
    """The tuner's own layers, as peft would hold them (no placement kept between calls, no compaction), on the merged
    copy and on the bypass."""
    torch.manual_seed(0)
    layer = Linear(nn.Linear(48, 40).requires_grad_(False), "default", NeuroAdaConfig(k=k, init_weights=False))
    x = torch.randn(2, 40, 48, requires_grad=True)
    hooked = Linear(nn.Linear(48, 40).requires_grad_(False), "default", NeuroAdaConfig(k=k, init_weights=False))
    hooked.get_base_layer().register_forward_hook(lambda module, args, out: None)  # the bypass
    for adapted in (layer, hooked):
        adapted(x).square().sum().backward()
        with _Calls() as calls:
            adapted(x).square().sum().backward()
        waits = {name: count for name, count in calls.counts.items() if WAITS_ON_THE_DEVICE.match(name)}
        assert not waits, waits


def test_a_neuroada_step_calls_no_more_operators_per_adapted_layer_than_loras_at_the_same_budget() -> None:
    command = [sys.executable, "-W", "ignore", str(BENCHMARKS / "step_profile.py"), "--model", "tiny"]
    command += ["--warmup", "1", "--per-layer", "neuroada-k1", "neuroada-k20", "lora-budget"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    counts = dict(re.findall(r"beyond the floor, (\S+): ([\d.]+)", completed.stdout))
    assert set(counts) == {"neuroada-k1", "neuroada-k20", "lora-budget"}, completed.stdout
    assert float(counts["neuroada-k1"]) <= float(counts["lora-budget"]), counts
    assert float(counts["neuroada-k20"]) <= float(counts["lora-budget"]), counts


def test_performance_md_carries_the_device_scripts_arithmetic_and_the_committed_step_files_tables() -> None:
    doc = (ROOT / "docs" / "performance.md").read_text()
    fresh = gpu_step.with_generated(doc, gpu_step.committed_report())
    assert fresh == doc, "stale: run `python benchmarks/gpu_step.py --write-docs`"
