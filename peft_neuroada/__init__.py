"""NeuroAda for PEFT: importing this package registers the NEUROADA tuner type with peft (and does nothing else)."""

from .registration import register  # first: it refuses an older peft before any other module reaches into it

# isort: split
from .budget import k_for_budget
from .config import NeuroAdaConfig
from .gradient_selection import select_by_gradient
from .layers import NeuroAdaLinear as Linear
from .layers import ParamWrapper
from .model import NeuroAdaModel
from .tuner.layer import NeuroAdaLayer

NEUROADA = register()

__all__ = [
    "NEUROADA",
    "Linear",
    "NeuroAdaConfig",
    "NeuroAdaLayer",
    "NeuroAdaModel",
    "ParamWrapper",
    "k_for_budget",
    "register",
    "select_by_gradient",
]
