"""Teach peft about the NEUROADA method.

peft keeps its method names in a closed ``PeftType`` enum, so a plugin has to add its member before calling
``register_peft_method``. Both steps are idempotent: importing the package twice (or reloading it) is harmless.
"""

from __future__ import annotations

import enum

import peft
from packaging.version import Version

# The oldest peft the plugin runs on (its specs passed there): 0.22 unloads `modules_to_save` without copying a weight
# into the module and saves the layers FSDP1 auto-wrapping renames, which the plugin worked around before. Checked
# here, before any module reaches into peft.
MINIMUM_PEFT = "0.22.0"
if Version(peft.__version__) < Version(MINIMUM_PEFT):
    raise ImportError(f"peft-neuroada needs peft>={MINIMUM_PEFT}, but peft {peft.__version__} is installed")

from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING  # noqa: E402
from peft.utils import PeftType, register_peft_method  # noqa: E402

from .config import NeuroAdaConfig  # noqa: E402
from .model import NeuroAdaModel  # noqa: E402
from .tuner.config import METHOD_NAME, PREFIX  # noqa: E402


def _add_enum_member(enum_cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Add ``name = value`` to an existing str-Enum, the way ``EnumType`` would have at class creation."""
    if name in enum_cls.__members__:
        return enum_cls[name]
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member.__init__(value)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    return member


def register() -> PeftType:
    """Register NEUROADA with peft (once) and return its ``PeftType`` member."""
    peft_type = _add_enum_member(PeftType, METHOD_NAME.upper(), METHOD_NAME.upper())
    if peft_type not in PEFT_TYPE_TO_TUNER_MAPPING:
        register_peft_method(
            name=METHOD_NAME,
            config_cls=NeuroAdaConfig,
            model_cls=NeuroAdaModel,
            prefix=PREFIX,
        )
    return peft_type
