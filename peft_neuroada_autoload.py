"""Register NeuroAda with peft as soon as peft is imported, so `PeftModel.from_pretrained` finds NEUROADA adapters
even when the user never imported `peft_neuroada`.

Loaded at interpreter start by `peft_neuroada.pth`. It imports nothing that the interpreter has not already loaded
(`os`, `sys`), adds one finder to `sys.meta_path` that answers only for `peft` (and removes itself then), and can
never fail the interpreter: anything that goes wrong is at most a warning when peft is imported. An interpreter that
never imports peft pays about one string comparison per import. Set PEFT_NEUROADA_NO_AUTOLOAD=1 to switch it off.
"""

import os
import sys


class _RegisterAfterPeftImport:
    """A meta-path finder that wraps peft's loader so `peft_neuroada` is imported right after `peft` itself."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "peft":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        try:
            spec = importlib.util.find_spec("peft")
        except Exception:  # the regular finders will report it
            return None
        if spec is None or spec.loader is None:
            return spec
        load_peft = spec.loader.exec_module

        def load_peft_then_register(module) -> None:
            load_peft(module)
            try:
                import peft_neuroada  # noqa: F401
            except Exception as error:  # peft itself must keep working whatever happens here
                import warnings

                warnings.warn(f"peft_neuroada could not register the NEUROADA peft type: {error!r}", stacklevel=2)

        spec.loader.exec_module = load_peft_then_register
        return spec


def install() -> None:
    if os.environ.get("PEFT_NEUROADA_NO_AUTOLOAD") != "1" and "peft" not in sys.modules:
        sys.meta_path.insert(0, _RegisterAfterPeftImport())


install()
