"""Whatever raises inside a NeuroAda forward, backward, merge or unmerge leaves every weight bit-identical to what it
was before the call (and the adapter's merged state unchanged).

Failures are injected at every torch call of the operation in turn: a torch function mode raises at its n-th call,
once, for n = 1, 2, ... until the operation completes without reaching n.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.overrides import TorchFunctionMode

from peft_neuroada import Linear, NeuroAdaConfig
from tests.conftest import neuroada_layers, tiny_llama

FAILURES = [RuntimeError, KeyboardInterrupt]


class FailAt(TorchFunctionMode):
    """Raises `error` at the n-th torch call made under it, once; counts the calls."""

    def __init__(self, n: int, error: type[BaseException]) -> None:
        super().__init__()
        self.n, self.error, self.calls = n, error, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.n:
            raise self.error(f"injected at torch call {self.n}: {getattr(func, '__name__', func)}")
        return func(*args, **(kwargs or {}))


def fail_at_every_step(operation: Callable[[], object], unchanged: Callable[[], None], error) -> int:
    """Run `operation` with a failure injected at each of its torch calls in turn, checking after each failure that
    nothing changed, until it completes; return how many torch calls it made."""
    n = 0
    grad_enabled = torch.is_grad_enabled()
    while True:
        n += 1
        try:
            with FailAt(n, error):
                operation()
        except error:
            unchanged()
            continue
        finally:
            torch.set_grad_enabled(grad_enabled)  # a failure injected into `no_grad().__exit__` leaves it off
        assert n > 1, "the operation made no torch call"
        return n - 1


def same_weights(layers: list, weights: list[torch.Tensor]) -> bool:
    return all(torch.equal(layer.get_base_layer().weight, w) for layer, w in zip(layers, weights, strict=True))


def two_adapter_layer(d_in: int = 12, d_out: int = 10) -> Linear:
    """A layer with two active, overlapping adapters (every neuron and half of them)."""
    torch.manual_seed(0)
    base = nn.Linear(d_in, d_out).requires_grad_(False)
    layer = Linear(base, "a", NeuroAdaConfig(k=3, init_weights=False))
    layer.update_layer("b", NeuroAdaConfig(k=3, init_weights=False, neuron_fraction=0.5))
    layer.set_adapter(["a", "b"])
    return layer


def one_adapter_layer(d_in: int = 12, d_out: int = 10) -> Linear:
    torch.manual_seed(0)
    base = nn.Linear(d_in, d_out).requires_grad_(False)
    return Linear(base, "a", NeuroAdaConfig(k=3, init_weights=False))


LAYERS = [pytest.param(two_adapter_layer, id="two-adapters"), pytest.param(one_adapter_layer, id="one-adapter")]


def weight_unchanged(layer: Linear) -> Callable[[], None]:
    original = layer.get_base_layer().weight.detach().clone()
    merged = list(layer.merged_adapters)

    def check() -> None:
        assert torch.equal(layer.get_base_layer().weight, original)
        assert layer.merged_adapters == merged

    return check


@pytest.mark.parametrize("make_layer", LAYERS)
@pytest.mark.parametrize("error", FAILURES, ids=lambda e: e.__name__)
def test_a_failure_at_any_step_of_the_forward_leaves_the_weight_as_it_was(error, make_layer):
    layer = make_layer()
    x = torch.randn(64, 12)  # (a batch: the merged-copy path)
    check = weight_unchanged(layer)
    with torch.no_grad():
        assert fail_at_every_step(lambda: layer(x), check, error) > 5
    check()


@pytest.mark.parametrize("make_layer", LAYERS)
@pytest.mark.parametrize("error", FAILURES, ids=lambda e: e.__name__)
def test_a_failure_at_any_step_of_forward_and_backward_leaves_the_weight_as_it_was(error, make_layer):
    layer = make_layer()
    x = torch.randn(4, 12, requires_grad=True)
    check = weight_unchanged(layer)
    fail_at_every_step(lambda: layer(x).square().sum().backward(), check, error)
    check()


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: e.__name__)
def test_a_failure_at_any_step_of_merge_leaves_the_layer_unmerged(error):
    layer = two_adapter_layer()
    original = layer.get_base_layer().weight.detach().clone()
    fail_at_every_step(lambda: layer.merge(adapter_names=["a", "b"]), weight_unchanged(layer), error)
    assert layer.merged_adapters == ["a", "b"] and not torch.equal(layer.get_base_layer().weight, original)


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: e.__name__)
def test_a_failure_at_any_step_of_unmerge_leaves_the_layer_merged(error):
    layer = two_adapter_layer()
    original = layer.get_base_layer().weight.detach().clone()
    layer.merge(adapter_names=["a", "b"])
    fail_at_every_step(layer.unmerge, weight_unchanged(layer), error)
    assert not layer.merged and torch.equal(layer.get_base_layer().weight, original)


def test_a_failing_second_adapter_leaves_the_first_adapters_deltas_out_of_the_weight():
    layer = two_adapter_layer()
    check = weight_unchanged(layer)
    # "a" is added first, then "b"'s values (on no device) fail to add.
    layer.neuroada_delta["b"] = nn.Parameter(torch.zeros_like(layer.neuroada_delta["b"], device="meta"))
    with pytest.raises(RuntimeError), torch.no_grad():
        layer(torch.randn(4, 12))
    check()


def test_bad_input_shapes_leave_the_weight_intact():
    layer = two_adapter_layer()
    check = weight_unchanged(layer)
    with pytest.raises(RuntimeError):
        layer(torch.randn(4, 7))
    check()


def test_a_gradient_hook_raising_during_backward_leaves_the_weight_intact():
    layer = two_adapter_layer()
    check = weight_unchanged(layer)
    x = torch.randn(4, 12, requires_grad=True)
    out = layer(x)

    def interrupt(grad: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt

    out.register_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        out.sum().backward()
    check()


def test_safe_merge_failing_at_a_late_layer_unmerges_every_earlier_layer():
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    layers = neuroada_layers(model)
    originals = [layer.get_base_layer().weight.detach().clone() for layer in layers]
    with torch.no_grad():
        layers[-1].neuroada_delta["default"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=PEFT_BROKEN):
        model.merge_adapter(safe_merge=True)
    assert all(not layer.merged for layer in layers)
    assert same_weights(layers, originals)


# peft's refusal of a broken adapter under safe_merge, LoRA's, which peft's tests match for every method.
PEFT_BROKEN = "NaNs detected in the merged weights. The adapter default seems to be broken"


@pytest.mark.parametrize(
    "config",
    [LoraConfig(target_modules=["q_proj"], init_lora_weights=False), NeuroAdaConfig(k=2, init_weights=False)],
    ids=["lora", "neuroada"],
)
def test_safe_merge_refuses_a_broken_adapter_with_peft_s_message(config):
    model = get_peft_model(tiny_llama(), config)
    with torch.no_grad():
        for parameter in (parameter for parameter in model.parameters() if parameter.requires_grad):
            parameter.view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=PEFT_BROKEN):
        model.merge_and_unload(safe_merge=True)


@pytest.mark.parametrize("operation", ["merge_adapter", "unmerge_adapter"])
def test_an_interrupted_model_merge_or_unmerge_is_all_or_nothing(operation):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    layers = neuroada_layers(model)
    unmerged_weights = [layer.get_base_layer().weight.detach().clone() for layer in layers]
    if operation == "unmerge_adapter":
        model.merge_adapter()
    weights = [layer.get_base_layer().weight.detach().clone() for layer in layers]
    merged = [list(layer.merged_adapters) for layer in layers]

    def unchanged() -> None:
        assert [list(layer.merged_adapters) for layer in layers] == merged
        assert same_weights(layers, weights)

    fail_at_every_step(getattr(model, operation), unchanged, KeyboardInterrupt)
    assert all(layer.merged == (operation == "merge_adapter") for layer in layers)
    if operation == "merge_adapter":
        model.unmerge_adapter()
    assert same_weights(layers, unmerged_weights)
