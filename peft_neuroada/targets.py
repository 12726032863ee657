"""Which modules and parameters a config adapts in a model, resolved as peft's injection resolves them (for budgets,
pre-checks, weighted adapters and estimates, before any layer exists)."""

from __future__ import annotations

import copy

from peft.tuners.tuners_utils import _maybe_include_all_linear_layers, check_target_module_exists
from torch import nn
from torch.nn.utils import parametrize

from .tuner.config import TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING, NeuroAdaConfig
from .tuner.experts import expert_projections, parameters_without_wrappers
from .tuner.model import TARGETS_REQUIRED


def default_targets(model_type: str | None, target_parameters: list[str] | None) -> set[str]:
    """The modules adapted when `target_modules` is None: the architecture's entry of the tuner's mapping; for one it
    does not know, none beside `target_parameters`, or the tuner's refusal without them."""
    if model_type not in TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING:
        if not target_parameters:
            raise ValueError(TARGETS_REQUIRED)
        return set()
    return set(TRANSFORMERS_MODELS_TO_NEUROADA_TARGET_MODULES_MAPPING[model_type])


def targeted_modules(model: nn.Module, config: NeuroAdaConfig) -> list[tuple[str, nn.Module]]:
    """The modules `config` adapts in `model`, resolving default and "all-linear" targets as injection does."""
    config = copy.deepcopy(config)
    if config.target_modules is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        config.target_modules = default_targets(model_type, config.target_parameters)
    config = _maybe_include_all_linear_layers(config, model)
    return [(name, module) for name, module in model.named_modules() if check_target_module_exists(config, name)]


def targeted_parameters(model: nn.Module, config: NeuroAdaConfig) -> list[tuple[str, nn.Parameter]]:
    """The parameters `config.target_parameters` names in `model` (by default, when neither target is given, its
    experts' projections, as injection resolves them), matched as peft matches them: by full name or name suffix, but
    on a module the user parametrized (torch.nn.utils.parametrize) by full name alone, since peft skips the rest of
    such a module's parameters. Named without peft's wrapper levels."""
    if config.target_modules is None and config.target_parameters is None:
        targets = {short for short, _ in expert_projections(model)}
    else:
        targets = set(config.target_parameters or ())
    parametrized = {
        name.replace(".base_layer", "") for name, m in model.named_modules() if parametrize.is_parametrized(m)
    }
    return [
        (name, param)
        for name, param in parameters_without_wrappers(model)
        if name in targets
        or (name.rpartition(".")[0] not in parametrized and any(name.endswith(f".{target}") for target in targets))
    ]
