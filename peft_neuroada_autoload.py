"""Register NeuroAda with peft as soon as peft is imported, so `PeftModel.from_pretrained` finds NEUROADA adapters
even when the user never imported `peft_neuroada`.

Loaded at interpreter start by `peft_neuroada.pth`; costs one meta-path lookup and imports nothing heavy. Set
PEFT_NEUROADA_NO_AUTOLOAD=1 to switch it off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec


class _RegisterAfterPeftImport(MetaPathFinder):
    """Wraps peft's loader so that `peft_neuroada` is imported right after `peft` finishes importing."""

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if fullname != "peft":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("peft")
        if spec is None or spec.loader is None:
            return spec
        load_peft = spec.loader.exec_module

        def load_peft_then_register(module) -> None:
            load_peft(module)
            try:
                import peft_neuroada  # noqa: F401
            except Exception as error:  # peft itself must keep working whatever happens here
                warnings.warn(f"peft_neuroada could not register the NEUROADA peft type: {error!r}", stacklevel=2)

        spec.loader.exec_module = load_peft_then_register
        return spec


def install() -> None:
    if os.environ.get("PEFT_NEUROADA_NO_AUTOLOAD") != "1" and "peft" not in sys.modules:
        sys.meta_path.insert(0, _RegisterAfterPeftImport())


install()
