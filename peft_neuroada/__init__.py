"""NeuroAda for PEFT: importing this package registers the NEUROADA tuner type with peft."""

from .config import NeuroAdaConfig
from .layer import Linear, NeuroAdaLayer
from .model import NeuroAdaModel
from .registration import register

NEUROADA = register()

__all__ = ["NEUROADA", "Linear", "NeuroAdaConfig", "NeuroAdaLayer", "NeuroAdaModel", "register"]
