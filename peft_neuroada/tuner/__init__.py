"""NeuroAda as peft holds its own tuners (`peft/tuners/neuroada`): config, selection, layers and model in pure torch.

It works alone: tests/test_peft_upstream_suite.py runs it inside a copy of peft's source tree. See docs/upstream.md.
"""

from .config import NeuroAdaConfig
from .layer import Linear, NeuroAdaLayer
from .model import NeuroAdaModel

__all__ = ["Linear", "NeuroAdaConfig", "NeuroAdaLayer", "NeuroAdaModel"]
