"""Which modules and parameters a config adapts in a model, resolved as peft's injection resolves them (for budgets,
pre-checks and weighted adapters, before any layer exists)."""

from __future__ import annotations

import copy

from peft.tuners.tuners_utils import _maybe_include_all_linear_layers, check_target_module_exists
from torch import nn

from .tuner.config import NeuroAdaConfig, default_targets
from .tuner.model import _parameters_without_wrappers


def targeted_modules(model: nn.Module, config: NeuroAdaConfig) -> list[tuple[str, nn.Module]]:
    """The modules `config` adapts in `model`, resolving default and "all-linear" targets as injection does."""
    config = copy.deepcopy(config)
    if config.target_modules is None:
        config.target_modules = default_targets(getattr(getattr(model, "config", None), "model_type", None))
    config = _maybe_include_all_linear_layers(config, model)
    return [(name, module) for name, module in model.named_modules() if check_target_module_exists(config, name)]


def targeted_parameters(model: nn.Module, config: NeuroAdaConfig) -> list[tuple[str, nn.Parameter]]:
    """The parameters `config.target_parameters` names in `model`, matched as peft matches them (by full name or
    name suffix), under their names without peft's wrapper levels."""
    targets = config.target_parameters or ()
    return [
        (name, param)
        for name, param in _parameters_without_wrappers(model)
        if any(name == target or name.endswith(f".{target}") for target in targets)
    ]
