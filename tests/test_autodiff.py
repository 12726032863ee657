"""Every derivative torch can ask of a NeuroAda model is the one of the same deltas in a dense differentiable form,
`W + index_put(zeros, positions, Θ)`: gradients of the second order (gradient penalties, Hessian-vector products,
second-order MAML), forward-mode AD (`torch.autograd.forward_ad`, `torch.func.jvp`) and the `torch.func` transforms
(`grad`, `vmap` of `grad` for per-sample gradients, `jacrev`, `hessian`), on the merged copy and on the bypass, with
the input compacted to the columns the deltas read and without, at k=1 (the column loop) and k=5 (the sparse
kernels)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.func import functional_call

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.tuner.experts import ParamWrapper
from peft_neuroada.tuner.forward import input_for_backward
from peft_neuroada.tuner.layer import NeuroAdaLayer
from tests.test_moe_layouts import adapted as adapted_moe
from tests.test_moe_layouts import wrappers as expert_wrappers

WIDE, NARROW, OUT = 256, 16, 8
PATHS = ("copy", "bypass")  # a forward hook on each base layer sends it to the bypass
KS = (1, 5)  # the column loop, and the sparse kernels
EXACT = dict(rtol=1e-10, atol=1e-10)  # float64: both sides are exact up to summation order


class TanhMLP(nn.Module):
    """256 -> 16 -> 256 -> 8: `a` and `c` read few of their 256 inputs at small k (backward keeps only those
    columns), `b` reads all 16 of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(WIDE, NARROW), nn.Linear(NARROW, WIDE), nn.Linear(WIDE, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def adapted(path: str, k: int, method: str = "neuroada") -> nn.Module:
    torch.manual_seed(0)
    base = TanhMLP().double().requires_grad_(False)
    if path == "bypass":
        for layer in (base.a, base.b, base.c):
            layer.register_forward_hook(lambda module, args, out: out)
    if method == "lora":
        config = LoraConfig(r=2, target_modules=["a", "b", "c"], init_lora_weights=False)
    else:
        config = NeuroAdaConfig(k=k, target_modules=["a", "b", "c"], init_weights=False)
    return get_peft_model(base, config).double()


def layers(model: nn.Module) -> dict[str, NeuroAdaLayer]:
    return {name.rsplit(".", 1)[-1]: m for name, m in model.named_modules() if isinstance(m, NeuroAdaLayer)}


def deltas(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def dense_forward(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The model with each layer's deltas placed into its weight by a differentiable `index_put`."""
    h = x
    for short, layer in layers(model).items():
        (name,) = [name for name in params if f".{short}." in name]
        weight, cols = layer.weight_out_in().detach(), layer.placement("default").cols.long()
        rows = torch.arange(weight.shape[0])[:, None]
        h = F.linear(h, weight + torch.zeros_like(weight).index_put((rows, cols), params[name]), layer.base_layer.bias)
        h = h if short == "c" else torch.tanh(h)
    return h


def model_forward(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return functional_call(model, params, (x,))


FORWARDS = {"model": model_forward, "dense": dense_forward}


def inputs(rows: int = 6) -> torch.Tensor:
    return torch.randn(rows, WIDE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def leaves(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: p.clone().requires_grad_(True) for name, p in params.items()}


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def gradient_penalty_grad(forward, model, x) -> torch.Tensor:
    """d/dΘ of ‖dL/dΘ‖²."""
    params = leaves(deltas(model))
    grads = torch.autograd.grad((forward(model, params, x) ** 2).sum(), list(params.values()), create_graph=True)
    return flat(torch.autograd.grad(sum((g**2).sum() for g in grads), list(params.values())))


def hessian_vector_product(forward, model, x) -> torch.Tensor:
    params = leaves(deltas(model))
    grads = torch.autograd.grad((forward(model, params, x) ** 2).sum(), list(params.values()), create_graph=True)
    vector = [torch.linspace(-1, 1, g.numel(), dtype=g.dtype).view_as(g) for g in grads]
    return flat(torch.autograd.grad(grads, list(params.values()), grad_outputs=vector))


def second_order_maml_grad(forward, model, x) -> torch.Tensor:
    """The outer loss after one inner step, differentiated through the inner step."""
    params = leaves(deltas(model))
    support, query = x[:3], x[3:]
    inner = torch.autograd.grad((forward(model, params, support) ** 2).sum(), list(params.values()), create_graph=True)
    adapted_params = {name: p - 0.1 * g for (name, p), g in zip(params.items(), inner, strict=True)}
    return flat(torch.autograd.grad(forward(model, adapted_params, query).sum(), list(params.values())))


SECOND_ORDER = {
    "gradient-penalty": gradient_penalty_grad,
    "hessian-vector-product": hessian_vector_product,
    "second-order-maml": second_order_maml_grad,
}


def test_the_models_below_keep_only_the_columns_the_deltas_read_where_few_are_read():
    """The specs below cover backward's compacted input (layers a and c) and its whole input (layer b) at each k."""
    for k in KS:
        kept = {
            short: input_for_backward(torch.zeros(2, layer.in_features), [layer.placement("default")])[0]
            for short, layer in layers(adapted("copy", k)).items()
        }
        assert kept["a"] is not None and kept["c"] is not None and kept["b"] is None, k


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", SECOND_ORDER.values(), ids=SECOND_ORDER.keys())
def test_second_order_gradients_of_the_deltas_are_those_of_the_dense_reference(case, path, k):
    model = adapted(path, k)
    torch.testing.assert_close(case(model_forward, model, inputs()), case(dense_forward, model, inputs()), **EXACT)


@pytest.mark.parametrize("path", PATHS)
def test_the_hessian_of_a_loss_in_the_input_is_that_of_the_dense_reference(path):
    """Second order through the input too (input-gradient penalties, double backward through the frozen layers)."""
    model, x = adapted(path, 1), inputs(2)
    params = deltas(model)
    hessians = [
        torch.autograd.functional.hessian(lambda x_, forward=forward: loss(forward, model, params, x_), x)
        for forward in FORWARDS.values()
    ]
    torch.testing.assert_close(*hessians, **EXACT)


def tangents(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return {name: torch.randn(p.shape, dtype=p.dtype, generator=generator) for name, p in params.items()}


EPS = 1e-6


def central_difference(function, params, direction, eps: float = EPS) -> torch.Tensor:
    def shifted(sign: int) -> dict[str, torch.Tensor]:
        return {name: p + sign * eps * direction[name] for name, p in params.items()}

    return (function(shifted(1)) - function(shifted(-1))) / (2 * eps)


def forward_ad_jvp(model, params, direction, x, grad_enabled=True) -> torch.Tensor:
    with torch.set_grad_enabled(grad_enabled), fwAD.dual_level():
        dual = {name: fwAD.make_dual(p, direction[name]) for name, p in params.items()}
        return fwAD.unpack_dual(model_forward(model, dual, x)).tangent


def func_jvp(model, params, direction, x) -> torch.Tensor:
    return torch.func.jvp(lambda p: model_forward(model, p, x), (params,), (direction,))[1]


JVPS = {
    "forward_ad": forward_ad_jvp,
    "forward_ad-no-grad": lambda *args: forward_ad_jvp(*args, grad_enabled=False),
    "torch.func.jvp": func_jvp,
}


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("jvp", JVPS.values(), ids=JVPS.keys())
def test_forward_mode_derivatives_in_the_deltas_agree_with_the_dense_reference_and_finite_differences(jvp, path, k):
    model, x = adapted(path, k), inputs()
    params = deltas(model)
    direction = tangents(params)
    tangent = jvp(model, params, direction, x)
    _, reference = torch.func.jvp(lambda p: dense_forward(model, p, x), (params,), (direction,))
    torch.testing.assert_close(tangent, reference, **EXACT)
    numeric = central_difference(lambda p: model_forward(model, p, x), params, direction)
    torch.testing.assert_close(tangent, numeric, atol=1e-6, rtol=0)


@pytest.mark.parametrize("path", PATHS)
def test_forward_mode_derivatives_in_the_input_agree_with_the_dense_reference(path):
    model, x = adapted(path, 1), inputs()
    params, direction = deltas(model), torch.randn_like(inputs())
    results = [
        torch.func.jvp(lambda x_, forward=forward: forward(model, params, x_), (x,), (direction,))[1]
        for forward in FORWARDS.values()
    ]
    torch.testing.assert_close(*results, **EXACT)


@pytest.mark.parametrize("path", PATHS)
def test_lora_is_the_control_the_forward_mode_specs_hold_it_to(path):
    """The same finite-difference check, on the method every user compares against."""
    model, x = adapted(path, 0, method="lora"), inputs()
    params = deltas(model)
    direction = tangents(params)
    expected = central_difference(lambda p: model_forward(model, p, x), params, direction)
    for jvp in JVPS.values():
        torch.testing.assert_close(jvp(model, params, direction, x), expected, atol=1e-6, rtol=0)


def loss(forward, model, params, x) -> torch.Tensor:
    return (forward(model, params, x) ** 2).sum()


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("path", PATHS)
def test_torch_func_per_sample_gradients_and_grad_are_those_of_the_dense_reference(path, k):
    """Per-sample gradients first: the model's first call runs under `vmap(grad)`."""
    x, results = inputs(), []
    for forward in FORWARDS.values():
        model = adapted(path, k)
        params = deltas(model)

        def sample_loss(p, row, forward=forward, model=model):
            return loss(forward, model, p, row[None])

        per_sample = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0))(params, x)
        results.append(
            (per_sample, torch.func.grad(lambda p, forward=forward, model=model: loss(forward, model, p, x))(params))
        )
    (per_sample, grads), (dense_per_sample, dense_grads) = results
    for name in per_sample:
        assert per_sample[name].shape == (len(x), *dense_grads[name].shape)
        torch.testing.assert_close(per_sample[name], dense_per_sample[name], **EXACT)
        torch.testing.assert_close(grads[name], dense_grads[name], **EXACT)


NESTED = {
    "grad": torch.func.grad,
    "jacrev-jacrev": lambda f: torch.func.jacrev(torch.func.jacrev(f)),
    "hessian": torch.func.hessian,  # forward over reverse
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("transform", NESTED.values(), ids=NESTED.keys())
def test_torch_func_transforms_of_one_layers_deltas_are_those_of_the_dense_reference(transform, path):
    """The other layers' deltas and inputs are constants to the transform, so their autograd Functions run under it."""
    model, x = adapted(path, 5), inputs(2)
    params = deltas(model)
    (name,) = [name for name in params if ".c." in name]  # one layer's deltas: a 40 x 40 Hessian
    results = [
        transform(lambda d, forward=forward: loss(forward, model, {**params, name: d}, x))(params[name])
        for forward in FORWARDS.values()
    ]
    torch.testing.assert_close(*results, **EXACT)


@pytest.mark.parametrize("path", PATHS)
def test_the_hessian_in_the_deltas_by_reverse_over_reverse_is_that_of_the_dense_reference(path):
    model, x = adapted(path, 5), inputs(2)
    params = deltas(model)
    (name,) = [name for name in params if ".c." in name]
    hessians = [
        torch.autograd.functional.hessian(
            lambda d, forward=forward: loss(forward, model, {**params, name: d}, x), params[name]
        )
        for forward in FORWARDS.values()
    ]
    torch.testing.assert_close(*hessians, **EXACT)


@pytest.mark.parametrize("tangent_of", ["input", "deltas"])
def test_forward_mode_without_grad_past_the_gather_limit_is_that_of_the_dense_reference(tangent_of):
    """Without gradients, many tokens on the bypass reach the sparse kernels' size (`GATHER_MAX_ENTRIES`), which have
    no forward-mode derivative: the tangents take the gathers."""
    model, x = adapted("bypass", 5), inputs(64)  # 64 tokens x 256 neurons x 5 of layer b: past 2**16 entries
    params = deltas(model)
    direction = (
        tangents(params) if tangent_of == "deltas" else {name: torch.zeros_like(p) for name, p in params.items()}
    )
    x_direction = torch.randn_like(x) if tangent_of == "input" else torch.zeros_like(x)
    results = []
    for forward in FORWARDS.values():
        with torch.no_grad(), fwAD.dual_level():
            dual = {name: fwAD.make_dual(p, direction[name]) for name, p in params.items()}
            results.append(fwAD.unpack_dual(forward(model, dual, fwAD.make_dual(x, x_direction))).tangent)
    torch.testing.assert_close(*results, **EXACT)
    assert results[0].abs().max() > 0


@pytest.mark.parametrize("path", PATHS)
def test_on_a_bf16_base_the_deltas_tangent_passes_the_rounding_as_their_gradient_does(path):
    """The bypass rounds the deltas into the weight's dtype as a merge does (`rounded_deltas`); the tangent of deltas
    that carry one but do not require grad (functional_call with dual tensors) must pass that rounding, not vanish."""
    torch.manual_seed(0)
    base = nn.Linear(64, 8).to(torch.bfloat16).requires_grad_(False)
    if path == "bypass":
        base.register_forward_hook(lambda module, args, out: out)
    model = get_peft_model(nn.Sequential(base), NeuroAdaConfig(k=2, target_modules=["0"], init_weights=False))
    (layer,) = layers(model).values()
    params = deltas(model)
    (name,) = params
    direction = {name: torch.ones_like(params[name])}
    x = torch.randn(3, 64).to(torch.bfloat16)
    tangent = forward_ad_jvp(model, params, direction, x)
    cols = layer.placement("default").cols.long()
    expected = x.float()[:, cols].sum(-1)  # (P ⊙ 1) x
    torch.testing.assert_close(tangent.float(), expected, rtol=2e-2, atol=2e-2)
    assert tangent.abs().sum() > 0


def test_moe_experts_forward_mode_and_second_order_agree_with_reverse_mode_and_finite_differences():
    """The experts' 3-D parameters (a parametrization adding the deltas). The router computes in float32, so finite
    differences take a wider step, and forward and reverse mode agree to the router's precision."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = adapted_moe("qwen3_moe", init_weights=False).double()
    # Neither torch's grouped expert matmul nor its CPU flash attention has forward-mode AD, adapter or not.
    model.config._experts_implementation = model.config._attn_implementation = "eager"
    assert expert_wrappers(model)
    tokens = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    params = deltas(model)
    direction = tangents(params)
    weights = torch.randn(2, 6, 100, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def score(p):
        return (functional_call(model, p, (tokens,), {"use_cache": False}).logits * weights).sum()

    with fwAD.dual_level():
        forward_mode = fwAD.unpack_dual(score({n: fwAD.make_dual(p, direction[n]) for n, p in params.items()})).tangent
    at = leaves(params)
    grads = torch.autograd.grad(score(at), list(at.values()), create_graph=True)
    reverse_mode = sum((g * direction[name]).sum() for g, name in zip(grads, at, strict=True))
    torch.testing.assert_close(forward_mode, reverse_mode.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(forward_mode, central_difference(score, params, direction, eps=1e-3), rtol=1e-3, atol=0)

    curvature = torch.autograd.grad(reverse_mode, list(at.values()))  # d/dΘ of the directional derivative
    second = sum((c * direction[name]).sum() for c, name in zip(curvature, at, strict=True))

    def directional(p):
        leaves_ = leaves(p)
        grads_ = torch.autograd.grad(score(leaves_), list(leaves_.values()))
        return sum((g * direction[name]).sum() for g, name in zip(grads_, leaves_, strict=True))

    torch.testing.assert_close(second, central_difference(directional, params, direction, eps=1e-3), rtol=1e-2, atol=0)


def test_vmap_over_the_tokens_of_adapted_experts_with_gradients_on_gives_each_token_s_own_output():
    """`vmap` of the experts' forward with gradients on (the routing given, as transformers' routers are not
    vmappable): the parametrization's Function runs inside it. The transforms that differentiate through the experts
    are refused by torch, as LoRA's are (the design page)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = adapted_moe("qwen3_moe", init_weights=False).double()
    model.config._experts_implementation = "eager"  # (torch's grouped matmul takes no float64)
    hidden = torch.randn(4, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    route, weights = torch.tensor([[0, 1]]), torch.full((1, 2), 0.5, dtype=torch.float64)
    experts = next(m for m in model.modules() if isinstance(m, ParamWrapper))  # the outermost of a module's wrappers
    batched = torch.func.vmap(lambda token: experts(token[None], route, weights)[0])(hidden)
    each = torch.cat([experts(token[None], route, weights) for token in hidden])
    torch.testing.assert_close(batched, each, **EXACT)


@pytest.mark.parametrize("path", PATHS)
def test_a_first_call_under_a_transform_leaves_every_later_call_as_it_would_be(path):
    """What a layer keeps between calls (its placements) is never made under a transform, whose tensors die with it."""
    model, x = adapted(path, 5), inputs(2)
    params = deltas(model)
    torch.func.hessian(lambda p: loss(model_forward, model, p, x))(params)
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense_forward(model, params, x), **EXACT)
    torch.func.grad(lambda p: loss(model_forward, model, p, x))(params)


@pytest.mark.parametrize("path", PATHS)
def test_compiled_torch_func_grad_gives_every_parameters_gradient_as_eager(path):
    """Under torch.compile around a transform the Functions are told no input needs a gradient: they give all, and
    the compiled graph keeps those asked for (the deltas, the frozen weights and biases when differentiated too)."""
    model, x = adapted(path, 5), inputs(3)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def full_loss(p):
        return loss(model_forward, model, p, x)

    compiled = torch.compile(lambda p: torch.func.grad(full_loss)(p), backend="aot_eager")(params)
    at = leaves(params)
    expected = dict(zip(at, torch.autograd.grad(full_loss(at), list(at.values())), strict=True))
    for name, grad in expected.items():
        torch.testing.assert_close(compiled[name], grad, **EXACT, msg=name)


def test_vmap_over_stacked_models_and_over_one_of_two_adapters_gives_each_members_output():
    """Ensembles (`torch.func.stack_module_state`, index buffers batched too) and a second active adapter's deltas
    batched alone."""
    members = [adapted("copy", 5) for _ in range(2)]
    with torch.no_grad():
        members[1].base_model.model.c.neuroada_delta["default"].mul_(-2)
    params, buffers = torch.func.stack_module_state(members)
    x = inputs(2)
    stacked = torch.func.vmap(lambda p, b: functional_call(members[0], (p, b), (x,)))(params, buffers)
    torch.testing.assert_close(stacked, torch.stack([m(x) for m in members]), **EXACT)

    model = adapted("copy", 5)
    model.add_adapter("other", NeuroAdaConfig(k=3, target_modules=["a", "b", "c"], init_weights=False))
    model.base_model.set_adapter(["default", "other"])
    other = {n: p.detach() for n, p in model.named_parameters() if ".other" in n}
    batch = {n: torch.stack([p, -p]) for n, p in other.items()}
    outputs = torch.func.vmap(lambda p: functional_call(model, p, (x,)))(batch)
    expected = [functional_call(model, {n: sign * p for n, p in other.items()}, (x,)) for sign in (1, -1)]
    torch.testing.assert_close(outputs, torch.stack(expected), **EXACT)
