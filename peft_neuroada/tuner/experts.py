"""NeuroAda on a parameter through `target_parameters`, as peft's LoRA: the 3-D expert weights of MoE models,
(E, d_out, d_in) or (E, d_in, d_out) (`is_transposed` tells which), E * d_out neurons over d_in inputs (neuron
`e * d_out + i` is row i of expert e). The experts' own forward (a loop, grouped_mm, ...) runs on a transient
`W + P ⊙ Θ` made through torch's parametrization, as LoRA's `ParamWrapper` makes `W + B A`; its dense gradient is
sampled at the placements (`_AddedAtPlacements`). Merge and unmerge write the entries, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .config import PREFIX, NeuroAdaConfig
from .forward import Placement, entry_index, merged_copy, transformed, write_placed_
from .layer import Linear, NeuroAdaLayer

# MoE experts' 3-D weights (transformers 5) that are projections of the paper's set, adapted by default.
EXPERT_PROJECTIONS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


# How a weight is held where the module has no `is_transposed` flag (transformers' `use_experts_implementation` classes
# have it), by class name: "out_in" ((E,) d_out, d_in), read as F.linear(x, W[e]); "in_out" ((E,) d_in, d_out), read
# as x @ W[e]; None: refused, with the reason. Other modules are refused, not guessed.
WEIGHT_LAYOUTS: dict[str, str | None] = {
    "Linear": "out_in",  # torch's nn.Linear (and its subclasses): a layer's weight named as a parameter
    "Conv1D": "in_out",  # transformers' GPT-2 layer
    "Llama4TextExperts": "in_out",  # torch.bmm(h, W)
    "JetMoeParallelExperts": "out_in",
    "LongcatFlashExperts": "out_in",
    "Step3p7Experts": "out_in",
    "InklingSharedExperts": "out_in",
    "DbrxExpertGLU": None,  # its parent reads w1, v1, w2 (2-D, E * ffn rows) outside its call, and passes them in
}


def is_transposed(module: nn.Module, param: torch.Tensor, name: str | None = None) -> bool:
    """Whether `param` is held (E,) d_in, d_out, by the module's `is_transposed` flag or WEIGHT_LAYOUTS: either
    layout reads as a valid weight of the other, so nothing is guessed."""
    if param.dim() == 3 and hasattr(module, "is_transposed"):
        return bool(module.is_transposed)
    key = next((cls.__name__ for cls in type(module).__mro__ if cls.__name__ in WEIGHT_LAYOUTS), None)
    if key is not None and WEIGHT_LAYOUTS[key] is not None:
        return WEIGHT_LAYOUTS[key] == "in_out"
    if name is None:  # the parameter's own name, past a user's parametrization of it
        found = (n for n, p in module.named_parameters() if p is param)
        name = next(found, "?").removeprefix("parametrizations.").removesuffix(".original")
    why = (
        f"WEIGHT_LAYOUTS['{key}'] refuses it (see why there)"
        if key
        else "the module has no `is_transposed` flag, and WEIGHT_LAYOUTS does not name its class"
    )
    raise ValueError(
        f"NeuroAda cannot tell which axis of '{name}' {tuple(param.shape)} of {type(module).__name__} holds its "
        f"output neurons: {why} (the tuner's experts.py). Leave it out of target_parameters (name the "
        "others), or, for a class of your own, set `is_transposed` on it or add it to WEIGHT_LAYOUTS: 'out_in' if "
        "its forward computes F.linear(x, W[e]), 'in_out' if x @ W[e]."
    )


class ParamWrapper(nn.Module, NeuroAdaLayer):
    """NeuroAda on one parameter (`parameter_name`) of `base_layer`, a 3-D expert stack or a 2-D weight. Named as
    LoRA's, by which peft finds it; several parameters of a module nest one wrapper each."""

    # One more component: what a call runs under (it changes the experts module for the call: a lock, say).
    call_guard: AbstractContextManager = nullcontext()
    COMPONENTS = (*NeuroAdaLayer.COMPONENTS, "call_guard")

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, parameter_name: str, config: NeuroAdaConfig, **kwargs: Any
    ) -> None:
        self.parameter_name = parameter_name
        super().__init__()
        NeuroAdaLayer.__init__(self, base_layer, **kwargs)
        if config.neuroada_dropout:
            raise ValueError(
                f"NeuroAda target_parameters do not take neuroada_dropout (got {config.neuroada_dropout}), as LoRA's "
                f"ParamWrapper does not take lora_dropout: the experts' own forward reads '{parameter_name}' with the "
                "deltas added, so their input cannot be dropped apart. Set neuroada_dropout=0 for this adapter."
            )
        if config.fan_in_fan_out:
            raise ValueError(
                f"NeuroAda target_parameters take the layout from the module (its `is_transposed` or WEIGHT_LAYOUTS), "
                f"not fan_in_fan_out: set fan_in_fan_out=False to adapt '{parameter_name}'."
            )
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_name=kwargs.get("layer_name", ""))

    def get_param(self) -> nn.Parameter:
        return getattr(self.get_base_layer(), self.parameter_name)

    def in_out_features(self) -> tuple[int, int]:
        """d_in and the neurons of the whole stack (E * d_out); refuses a parameter NeuroAda cannot adapt."""
        param = self.get_param()
        if param.dim() not in (2, 3) or not param.dtype.is_floating_point:
            raise TypeError(
                f"NeuroAda can adapt a 2-D or 3-D floating-point parameter, but '{self.parameter_name}' of "
                f"{type(self.get_base_layer()).__name__} is {param.dtype} {tuple(param.shape)}. Remove it from "
                "target_parameters."
            )
        shape = self.weight_out_in().shape
        return shape[-1], shape[:-1].numel()

    def weight_out_in(self) -> torch.Tensor:
        """The parameter as a (d_out, d_in) weight or an (E, d_out, d_in) stack of them (a view)."""
        return self._oriented(self.get_param())

    def _transposed(self) -> bool:
        return is_transposed(self.get_base_layer(), self.get_param(), self.parameter_name)

    @property
    def num_experts(self) -> int:
        weight = self.weight_out_in()
        return weight.shape[0] if weight.dim() == 3 else 1

    def unreadable(self) -> str | None:
        return "it is on the meta device (not loaded)" if self.get_param().is_meta else None

    def quantized(self) -> None:
        return None  # quantized expert stacks are refused by `in_out_features` (not floating point)

    def _get_base_layer_device_and_dtype(self, base_layer: nn.Module) -> tuple[torch.device, torch.dtype]:
        param = self.get_param()
        return param.device, param.dtype

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The adapter as a dense tensor shaped like the parameter (for inspection and tests)."""
        delta = self.neuroada_delta[adapter_name].detach()
        dense = torch.zeros_like(self.get_param(), dtype=delta.dtype)
        write_placed_(self._oriented(dense), self.placement(adapter_name), delta)
        return dense

    def _oriented(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like the parameter, seen as `weight_out_in` sees the parameter."""
        return tensor.transpose(-2, -1) if self._transposed() else tensor

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        active = [name for name in self.active_adapters if name in self.neuroada_delta]
        if self.merged or not active:
            return self.base_layer(x, *args, **kwargs)
        if self.get_param().is_meta or any(self.neuroada_delta[name].is_meta for name in active):
            raise ValueError(
                f"NeuroAda expert weights ('{self.layer_name}') cannot run offloaded by accelerate (cpu_offload, "
                "disk_offload, a device_map with offloaded modules): their deltas are added to the experts' "
                "parameter, which offloading replaces. Nothing was computed. Merge first and offload the plain model "
                "(`model.merge_and_unload()`), or keep the MoE layers in memory."
            )
        with self.call_guard, self._deltas_added(active):
            return self.base_layer(x, *args, **kwargs)

    merge, unmerge = Linear.merge, Linear.unmerge  # the entries of the parameter, as a linear layer's weight

    @contextmanager
    def _deltas_added(self, adapters: list[str]) -> Iterator[None]:
        """Within the block the module reads its parameter as `W + Σ P ⊙ Θ`, made on first read (backward frees it
        after the matmul that read it); the parameter is not written. One call at a time, as LoRA's wrapper."""
        placements = tuple(self.placement(name) for name in adapters)
        deltas = tuple(self.neuroada_delta[name] for name in adapters)
        base, name = self.get_base_layer(), self.parameter_name
        parametrize.register_parametrization(
            base, name, _DeltasAdded(self._transposed(), placements, deltas), unsafe=True
        )
        try:
            with parametrize.cached():
                yield
        finally:
            parametrize.remove_parametrizations(base, name, leave_parametrized=False)

    def __repr__(self) -> str:
        text = super().__repr__()
        start = text.find("(") + 1
        return f"neuroada.{text[:start]}\n  parameter_name='{self.parameter_name}',{text[start:]}"


class _DeltasAdded(nn.Module):
    """The parameter plus the deltas, in its dtype as a merge adds them: unmerged and merged compute the same."""

    def __init__(self, transposed: bool, placements: tuple[Placement, ...], deltas: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.transposed, self.placements, self.deltas = transposed, placements, deltas

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        oriented = weight.transpose(-2, -1) if self.transposed else weight
        if torch.is_grad_enabled() and not any(map(transformed, (weight, *self.deltas))):
            copy = _AddedAtPlacements.apply(oriented, self.placements, *self.deltas)
        else:  # plain torch operations: forward-mode AD differentiates them
            copy = merged_copy(oriented, self.placements, self.deltas)
        return copy.transpose(-2, -1) if self.transposed else copy


class _AddedAtPlacements(torch.autograd.Function):
    """`merged_copy` whose backward keeps nothing (autograd's keeps int64 indices): it samples the dense gradient."""

    generate_vmap_rule = True  # (`vmap` over the experts' input, with gradients on)

    @staticmethod
    def forward(weight, placements, *deltas):
        return merged_copy(weight, placements, deltas)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.placements, *deltas = inputs
        ctx.delta_dtypes = [delta.dtype for delta in deltas]

    @staticmethod
    def backward(ctx, grad):
        needed = zip(ctx.placements, ctx.delta_dtypes, ctx.needs_input_grad[2:], strict=True)
        grads = [grad[entry_index(grad, placement)].to(dtype) if need else None for placement, dtype, need in needed]
        return grad if ctx.needs_input_grad[0] else None, None, *grads


def expert_projections(model: nn.Module) -> list[tuple[str, str]]:
    """(e.g. 'experts.gate_up_proj', full name) of every 3-D parameter named in EXPERT_PROJECTIONS."""
    return [
        (".".join(name.split(".")[-2:]), name)
        for name, param in parameters_without_wrappers(model)
        if param.dim() == 3 and name.rpartition(".")[2] in EXPERT_PROJECTIONS
    ]


def parameters_without_wrappers(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The model's parameters, named as in the model before any NeuroAda layer wrapped them."""
    for name, param in model.named_parameters():
        if PREFIX not in name:
            yield name.replace(".base_layer", "").replace(".parametrizations.", ".").removesuffix(".original"), param
