"""The fused CPU kernels: the results of the torch ops they replace, and a clean fallback where none can be built."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from peft_neuroada import NeuroAdaConfig, native
from peft_neuroada.functional import Placement, add_deltas_, restore_, sampled_weight_grad
from tests.conftest import tiny_llama

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the CPU kernels cannot be built")


@pytest.fixture(autouse=True)
def fresh_kernel_lookup():
    """Each test looks the kernels up anew, and leaves no switched-off lookup behind for the next one."""
    native.library.cache_clear()
    yield
    native.library.cache_clear()


@pytest.fixture
def torch_ops_only(monkeypatch):
    """From here on, run with the kernels switched off (PEFT_NEUROADA_NATIVE=0), as on a machine without them."""
    monkeypatch.setenv("PEFT_NEUROADA_NATIVE", "0")
    native.library.cache_clear()


def random_placement(d_out: int, d_in: int, k: int, tuned: int | None, seed: int) -> Placement:
    generator = torch.Generator().manual_seed(seed)
    cols = torch.stack([torch.randperm(d_in, generator=generator)[:k].sort().values for _ in range(tuned or d_out)])
    rows = None if tuned is None else torch.randperm(d_out, generator=generator)[:tuned].sort().values
    return Placement(cols.to(torch.int32), None if rows is None else rows.to(torch.int32))


SHAPES = [  # tokens, d_in, d_out, k, tuned neurons (None = all): odd sizes exercise every remainder loop
    (37, 19, 23, 3, None),
    (300, 64, 48, 20, None),
    (5, 33, 70, 1, 17),
    (129, 576, 96, 7, 40),
]


@pytest.mark.parametrize(("tokens", "d_in", "d_out", "k", "tuned"), SHAPES)
def test_sampled_gradient_matches_the_dense_weight_gradient_at_the_placement(tokens, d_in, d_out, k, tuned):
    placement = random_placement(d_out, d_in, k, tuned, seed=tokens)
    x, grad = torch.randn(tokens, d_in), torch.randn(tokens, d_out)
    dense = grad.T @ x
    rows = torch.arange(d_out) if placement.rows is None else placement.rows.long()
    expected = dense[rows[:, None], placement.cols.long()]
    torch.testing.assert_close(sampled_weight_grad(x, grad, placement), expected, rtol=1e-5, atol=1e-4)


def test_sampled_gradient_reads_strided_inputs():
    """Inputs that are column slices of wider tensors (as compacted or sliced activations are) need no copy first."""
    placement = random_placement(24, 16, 5, None, seed=0)
    x, grad = torch.randn(40, 32)[:, 8:24], torch.randn(40, 48)[:, :24]
    expected = (grad.T @ x).gather(1, placement.cols.long())
    torch.testing.assert_close(sampled_weight_grad(x, grad, placement), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d-layout"])
@pytest.mark.parametrize("tuned", [None, 9])
def test_adding_and_restoring_deltas_is_bit_exact_and_agrees_with_torch_ops(transposed, tuned, request):
    placement = random_placement(20, 30, 4, tuned, seed=1)
    delta = torch.randn(placement.cols.shape)
    storage = torch.randn(30, 20) if transposed else torch.randn(20, 30)
    weight = storage.T if transposed else storage
    original = weight.clone()

    (native_originals,) = add_deltas_(weight, [placement], [delta])
    native_sum = weight.clone()
    restore_(weight, [placement], [native_originals])
    assert torch.equal(weight, original)

    request.getfixturevalue("torch_ops_only")
    (torch_originals,) = add_deltas_(weight, [placement], [delta])
    assert torch.equal(weight, native_sum)
    assert torch.equal(torch_originals, native_originals)
    restore_(weight, [placement], [torch_originals])
    assert torch.equal(weight, original)


def delta_gradients(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=tokens, labels=tokens).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def smollm2_with_adapter(smollm2):
    torch.manual_seed(0)
    return get_peft_model(smollm2, NeuroAdaConfig(k=20, init_weights=False))


def test_kernels_and_torch_ops_give_the_same_training_gradients_on_smollm2(smollm2_with_adapter, request):
    model = smollm2_with_adapter.train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with_kernels = delta_gradients(model, tokens)
    request.getfixturevalue("torch_ops_only")
    with_torch_ops = delta_gradients(model, tokens)
    assert with_kernels.keys() == with_torch_ops.keys() and len(with_kernels) == 30 * 7
    for name, grad in with_kernels.items():
        torch.testing.assert_close(grad, with_torch_ops[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_a_compiler_training_falls_back_to_torch_ops_with_one_warning(monkeypatch, tmp_path, token_batch):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PEFT_NEUROADA_CACHE", str(tmp_path))
    native.library.cache_clear()
    with pytest.warns(UserWarning, match="could not build its CPU kernels.*no-such-compiler"):
        assert native.library() is None
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    model(input_ids=token_batch, labels=token_batch).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert not any(tmp_path.rglob("*.so"))
