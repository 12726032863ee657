"""The opt-in Triton accelerator (`peft_neuroada.accel.use_triton`) computes the deltas' gradient as the tuner's own
product does, and plugs into one model's layers only. The kernel runs here on CPU tensors through Triton's
interpreter, in a fresh process (the interpreter is chosen when triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import get_peft_model

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.layers import KERNELS
from tests.conftest import neuroada_layers, tiny_llama

pytest.importorskip("triton")
REPO_ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = """
import torch
from peft_neuroada.accel import sparse_products, triton_sampled_grad

def case(tokens, d_in, n, k, rows=None, dtype=torch.float32, strided=False):
    generator = torch.Generator().manual_seed(tokens + k)
    x = torch.randn(tokens, d_in, generator=generator).to(dtype)
    grad = torch.randn(tokens, n if rows is None else 2 * n, generator=generator).to(dtype)
    if strided:
        x, grad = x.T.contiguous().T, grad.T.contiguous().T
    cols = torch.stack([torch.randperm(d_in, generator=generator)[:k] for _ in range(n)]).int()
    tuned = grad if rows is None else grad[:, rows.long()]
    expected = (tuned.double().T @ x.double()).gather(1, cols.long())
    got = triton_sampled_grad.sampled_grad(x, grad, cols, rows)
    assert got.dtype == torch.float32 and got.shape == cols.shape
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(got, triton_sampled_grad.sampled_grad(x, grad, cols, rows)), "two runs, the same bits"

for dtype in (torch.float32, torch.bfloat16, torch.float16):
    case(1, 7, 5, 1, dtype=dtype)  # one token
    case(150, 50, 37, 5, rows=torch.arange(0, 74, 2), dtype=dtype)  # sizes off the 64-wide tiles, some rows
    case(70, 100, 3, 80, dtype=dtype)  # k above a tile's width
case(9, 1, 6, 1)  # one input
case(33, 16, 9, 3, strided=True)
x, grad = torch.randn(40, 30, dtype=torch.float64), torch.randn(40, 20, dtype=torch.float64)
cols = torch.randint(0, 30, (20, 3), dtype=torch.int32)
got = triton_sampled_grad.sampled_grad(x, grad, cols, None)  # float64 operands: accumulated in float64
assert got.dtype == torch.float64 and torch.equal(got, sparse_products.sampled_grad(x, grad, cols, None))
torch.testing.assert_close(got, (grad.T @ x).gather(1, cols.long()), rtol=1e-12, atol=1e-12)
print("checked")
"""


def test_the_triton_kernel_computes_the_tuners_delta_gradient():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", INTERPRETED], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip() == "checked", run.stderr[-3000:]


def test_use_triton_plugs_into_one_models_layers_and_trains_as_the_tuners_product_off_cuda(token_batch):
    from peft_neuroada.accel import use_triton

    config = NeuroAdaConfig(k=2, init_weights=False)
    plain, accelerated = get_peft_model(tiny_llama(), config), get_peft_model(tiny_llama(), config)
    assert use_triton(accelerated) == len(neuroada_layers(accelerated))
    assert all(layer.kernels is KERNELS for layer in neuroada_layers(plain))
    for model in (plain, accelerated):
        model(input_ids=token_batch, labels=token_batch).loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (plain, accelerated)]
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
