"""NeuroAda for PEFT: importing this package registers the NEUROADA tuner type with peft."""

from .budget import k_for_budget
from .config import NeuroAdaConfig
from .gradient_selection import select_by_gradient
from .layer import Linear, NeuroAdaLayer
from .model import NeuroAdaModel
from .peft_compat import route_safetensors_calls
from .registration import register

NEUROADA = register()
route_safetensors_calls()

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
