"""NeuroAda as peft holds its own tuners (`peft/tuners/neuroada`): config, selection, layers and model in pure torch.

It works alone (tests/test_peft_upstream_suite.py runs it inside a copy of peft's source tree); the plugin around it
adds the accelerators (peft_neuroada.accel) and its guard rails. See docs/upstream.md.
"""

from .config import NeuroAdaConfig
from .experts import ParamWrapper
from .layer import Accelerator, Linear, NeuroAdaLayer
from .model import NeuroAdaModel

__all__ = ["Accelerator", "Linear", "NeuroAdaConfig", "NeuroAdaLayer", "NeuroAdaModel", "ParamWrapper"]
