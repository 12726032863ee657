"""The tuner (`peft_neuroada/tuner/`, what peft would hold as `peft/tuners/neuroada`) is plain torch a peft reviewer
can adopt. Its sizes are measured and generated into docs/upstream.md, not walls here."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "peft_neuroada"
TUNER = PACKAGE / "tuner"
# What peft's own tuners do not hold, and the tuner must not either (docs/design.md, "Layers").
FOREIGN_TO_A_PEFT_TUNER = {
    "threads or locks": r"\bimport threading\b|\bfrom threading\b|\bLock\(",
    "ctypes": r"\bctypes\b",
    "fork handlers": r"register_at_fork",
    "context variables": r"\bContextVar\b|\bcontextvars\b",
    "monkeypatching another module": r"^\s*[a-z_]+(\.[a-z_]+)+\.[A-Za-z_]+ = ",
    "private torch attributes": r"\._version\b|\._parameters\b|\._buffers\b|\._modules\b|_global_\w+_hooks",
    "process-global registrations": r"torch\.library|register_peft_method",
}


def test_the_tuner_holds_nothing_a_peft_tuner_would_not():
    found = [
        f"{path.name}:{number}: {what}"
        for path in TUNER.glob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for what, pattern in FOREIGN_TO_A_PEFT_TUNER.items()
        if re.search(pattern, line)
    ]
    assert not found, found


# The classes a model adapted by the plugin is made of: each layer kind, the model and the config.
def _built_classes() -> dict[str, type]:
    from peft_neuroada import layers
    from peft_neuroada.config import NeuroAdaPluginConfig
    from peft_neuroada.model import NeuroAdaPluginModel
    from peft_neuroada.tuner import experts
    from peft_neuroada.tuner import layer as tuner_layer

    return {
        "tuner Linear": tuner_layer.Linear,
        "plugin Linear": layers.NeuroAdaLinear,
        "ParamWrapper": experts.ParamWrapper,
        "model": NeuroAdaPluginModel,
        "config": NeuroAdaPluginConfig,
    }


def test_a_layer_has_peft_s_two_levels_and_at_most_the_plugin_s_one_subclass_above():
    for name in ("tuner Linear", "plugin Linear", "ParamWrapper"):
        mro = _built_classes()[name].__mro__
        assert len(mro) <= 7, f"{name}: {[cls.__name__ for cls in mro]}"
        own = [cls for cls in mro if cls.__module__.startswith("peft_neuroada")]
        assert len(own) <= 3, f"{name}: NeuroAdaLayer, the layer, and at most one plugin subclass: {own}"


def test_no_class_name_appears_twice_in_any_class_chain():
    for name, cls in _built_classes().items():
        names = [base.__name__ for base in cls.__mro__]
        assert len(names) == len(set(names)), f"{name}: {names}"


def test_a_layer_has_one_forward_to_read():
    import torch.nn

    for name in ("plugin Linear", "ParamWrapper"):
        defining = [cls for cls in _built_classes()[name].__mro__ if "forward" in vars(cls)]
        assert defining[1:] == [torch.nn.Module], f"{name}: forward defined by {defining}"


def test_every_plugin_method_that_overrides_the_tuner_s_calls_it():
    """No tuner method the plugin makes unreachable: an override extends the tuner's through super()."""
    import inspect

    from peft_neuroada.tuner.layer import NeuroAdaLayer

    unreachable = []
    for name in ("plugin Linear", "model", "config"):
        cls = _built_classes()[name]
        tuner_bases = [base for base in cls.__mro__[1:] if base.__module__.startswith("peft_neuroada.tuner")]
        for method, member in vars(cls).items():
            function = getattr(member, "__func__", member)
            replaced = method in NeuroAdaLayer.COMPONENTS  # components are replaced by design
            if inspect.isfunction(function) and not replaced and any(method in vars(base) for base in tuner_bases):
                try:
                    source = inspect.getsource(function)
                except OSError:  # written by @dataclass (its __init__, __eq__): no source, and nothing of ours
                    continue
                if "super()" not in source:
                    unreachable.append(f"{cls.__name__}.{method}")
    assert not unreachable
