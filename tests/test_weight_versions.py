"""Nothing NeuroAda writes into a frozen weight is visible to autograd's version checks: another graph that saved the
weight (a regulariser, a tied use elsewhere) runs its backward after the adapter's visits, patches and merges, with
the weight's original values."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from peft_neuroada import NeuroAdaConfig


def adapted_linear(dtype: torch.dtype, adapters: int, fan_in_fan_out: bool = False):
    torch.manual_seed(0)
    if fan_in_fan_out:
        from transformers.pytorch_utils import Conv1D

        base = torch.nn.Sequential(Conv1D(8, 16)).to(dtype)
    else:
        base = torch.nn.Sequential(torch.nn.Linear(16, 8)).to(dtype)
    model = get_peft_model(base, NeuroAdaConfig(target_modules=["0"], k=2, init_weights=False))
    for index in range(1, adapters):
        model.add_adapter(f"extra{index}", NeuroAdaConfig(target_modules=["0"], k=2, init_weights=False))
    model.base_model.set_adapter(list(model.peft_config))
    return model


# Visits (which read the weight) and merge + unmerge (which write it at storage positions), in several dtypes, with
# one or two adapters, on Conv1D's transposed weight too.
PATHS = {
    "float32": (torch.float32, 1, False),
    "bfloat16": (torch.bfloat16, 1, False),
    "float64": (torch.float64, 1, False),
    "two-adapters": (torch.float32, 2, False),
    "bfloat16-two-adapters": (torch.bfloat16, 2, False),
    "conv1d-two-adapters": (torch.float32, 2, True),
}


@pytest.mark.parametrize("merge", [False, True], ids=["visits", "visits-and-merge"])
@pytest.mark.parametrize("path", PATHS, ids=list(PATHS))
def test_a_graph_that_saved_the_frozen_weight_runs_its_backward_after_the_adapter_wrote_into_it(path, merge):
    dtype, adapters, fan_in_fan_out = PATHS[path]
    model = adapted_linear(dtype, adapters, fan_in_fan_out)
    layer = model.base_model.model[0]
    weight = layer.get_base_layer().weight
    original = weight.detach().clone()
    z = torch.randn(3, weight.shape[-1], dtype=dtype, requires_grad=True)
    other_graph = (z @ weight.T).square().sum()  # saves the weight for z's gradient
    x = torch.randn(3, layer.in_features, dtype=dtype)
    if merge:
        model.merge_adapter()
        model.unmerge_adapter()
    (model(x).sum() + other_graph).backward()
    expected = 2 * (z.detach() @ original.T) @ original
    torch.testing.assert_close(z.grad, expected)
    assert torch.equal(weight, original)
    assert all(delta.grad is not None for delta in layer.neuroada_delta.values())
