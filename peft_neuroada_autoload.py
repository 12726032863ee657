"""Register NeuroAda with peft as soon as peft is imported, so `PeftModel.from_pretrained` finds NEUROADA adapters
even when the process never imports `peft_neuroada`.

Why it exists: peft knows only the method types it was told about, and has no plugin entry points. Clients that load
adapters for the user never import this plugin: transformers' adapter loading (`AutoModelForCausalLM.from_pretrained`
of an adapter folder, `model.load_adapter`), EleutherAI's lm-evaluation-harness (`--model_args ...,peft=ADAPTER`),
a TRL script. Without this hook each of them ends in `KeyError: 'NEUROADA'` inside peft.

What it touches: loaded at interpreter start by `peft_neuroada.pth`, it imports nothing the interpreter has not already
loaded (`os`, `sys`, `_thread`) and puts one finder at the front of `sys.meta_path`. The finder answers only for the
name `peft`; for every other import it returns None after one string comparison. For `peft` it asks the finders behind
it for peft's own spec and returns that spec with its loader's `exec_module` wrapped on that loader object alone: once
peft's module has executed, the wrapper takes the attribute off the loader again, removes the finder from
`sys.meta_path` and imports `peft_neuroada`. A probe that only looks for peft (`importlib.util.find_spec("peft")`, as
transformers' `is_peft_available()` does before anything imports peft) executes nothing, so the finder stays until the
real import. Nothing here can fail the interpreter or `import peft`: a failure of the plugin is a warning. A process
that imported `peft_neuroada` itself while peft was loading registers through that import. Reloading this module
replaces the finder instead of adding a second one. Set PEFT_NEUROADA_NO_AUTOLOAD=1 to switch it off.
"""

import _thread
import os
import sys

_UNWRAPPABLE = "peft's loader cannot be wrapped, NEUROADA will not register itself: `import peft_neuroada` first"
_MARK = "_peft_neuroada_autoload"  # on the finder's class and on the wrapper; outlives importlib.reload of this module


class _RegisterAfterPeftImport:
    """A meta-path finder that wraps peft's loader so `peft_neuroada` is imported right after peft has executed."""

    _peft_neuroada_autoload = True

    def __init__(self) -> None:
        self._searching: set[int] = set()  # threads inside find_spec("peft"): a finder behind us may ask again

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "peft":
            return None
        thread = _thread.get_ident()
        if thread in self._searching:
            return None
        self._searching.add(thread)
        try:
            spec = _spec_from_the_other_finders(fullname, path, target)
        except Exception:  # the regular finders will raise it again, as they would without this hook
            return None
        finally:
            self._searching.discard(thread)
        if spec is not None and spec.loader is not None:
            _wrap(spec.loader)
        return spec


def _spec_from_the_other_finders(fullname: str, path, target):
    for finder in list(sys.meta_path):
        if getattr(type(finder), _MARK, False):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _wrap(loader) -> None:
    """Wrap `exec_module` on this loader object (never on a class), so executing peft imports the plugin after it."""
    if isinstance(loader, type):
        _warn(_UNWRAPPABLE)
        return
    load = getattr(loader, "exec_module", None)
    if load is None or getattr(load, _MARK, False):
        return

    def exec_module(module) -> None:
        load(module)  # peft's own errors propagate unchanged, and the finder stays for a later attempt
        if getattr(module, "__name__", None) != "peft":  # a loader shared by several modules (zipimport)
            return
        try:
            if getattr(loader, "__dict__", {}).get("exec_module") is exec_module:
                del loader.exec_module  # the loader (peft's `__loader__`) is its unwrapped self again
            uninstall()
        except Exception as error:
            _warn(f"peft_neuroada's start-up hook could not remove itself: {error!r}")
        _register()

    setattr(exec_module, _MARK, True)
    try:
        loader.exec_module = exec_module
    except Exception:
        _warn(_UNWRAPPABLE)


def _register() -> None:
    if "peft_neuroada" in sys.modules:  # being imported (it imported peft) or done: that import registers NEUROADA
        return
    try:
        import peft_neuroada  # noqa: F401
    except Exception as error:  # peft itself must keep working whatever happens here
        _warn(f"peft_neuroada could not register the NEUROADA peft type: {error!r}")


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, stacklevel=3)


def uninstall() -> None:
    """Remove the finder (every copy, including one left by a reloaded version of this module). `sys.meta_path` is
    replaced rather than edited: an import in another thread iterates the list it read, and removing an entry before
    its position would make it skip the next finder (PathFinder, say, and then fail)."""
    if any(getattr(type(finder), _MARK, False) for finder in sys.meta_path):
        sys.meta_path = [finder for finder in sys.meta_path if not getattr(type(finder), _MARK, False)]


def install() -> None:
    """Put the finder in `sys.meta_path` unless peft is already imported or PEFT_NEUROADA_NO_AUTOLOAD=1."""
    uninstall()
    if os.environ.get("PEFT_NEUROADA_NO_AUTOLOAD") != "1" and "peft" not in sys.modules:
        sys.meta_path.insert(0, _RegisterAfterPeftImport())


install()
