"""NeuroAda for PEFT: importing this package registers the NEUROADA tuner type with peft."""

from .budget import k_for_budget
from .config import NeuroAdaConfig
from .gradient_selection import select_by_gradient
from .layer import Linear, NeuroAdaLayer
from .model import NeuroAdaModel
from .registration import register
from .safe_io import install as _install_safe_adapter_io

NEUROADA = register()
_install_safe_adapter_io()

__all__ = [
    "NEUROADA",
    "Linear",
    "NeuroAdaConfig",
    "NeuroAdaLayer",
    "NeuroAdaModel",
    "k_for_budget",
    "register",
    "select_by_gradient",
]
