"""Installing and importing peft_neuroada changes nothing for other peft methods or for interpreters that never use it,
and the tuner's own modules import each other in one direction only."""

from __future__ import annotations

import ast
import os
import site
import subprocess
import sys
from pathlib import Path

import peft.peft_model
import peft.utils.save_and_load
import pytest
import safetensors.torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import SafetensorError

from peft_neuroada import NeuroAdaConfig
from tests.conftest import tiny_llama

PACKAGE = Path(__file__).resolve().parents[1] / "peft_neuroada"


def recorded_save_targets(model, directory: Path, monkeypatch) -> list[str]:
    """The paths safetensors' `save_file` writes to while `model` saves itself into `directory`."""
    targets = []
    real_save = safetensors.torch.save_file

    def recording_save(tensors, filename, metadata=None):
        targets.append(Path(filename).name)
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", recording_save)
    model.save_pretrained(directory)
    return targets


def test_other_methods_save_exactly_as_peft_alone_does(tmp_path, monkeypatch):
    neuroada = get_peft_model(tiny_llama(), NeuroAdaConfig(k=1))  # (first: the plugin routes peft's saving now)
    lora = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"]))
    assert recorded_save_targets(lora, tmp_path / "lora", monkeypatch) == ["adapter_model.safetensors"]
    (target,) = recorded_save_targets(neuroada, tmp_path / "neuroada", monkeypatch)
    assert target.endswith(".partial")  # written aside, then renamed into place


def test_other_methods_see_their_own_load_errors(tmp_path):
    get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"])).save_pretrained(tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SafetensorError):
        PeftModel.from_pretrained(tiny_llama(), tmp_path)


def module_name(path: Path) -> str:
    """`path`'s dotted name inside the package ("" for the package itself, "kernels" for kernels/__init__.py)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def local_imports(path: Path, modules: set[str]) -> set[str]:
    """The package's own modules (among `modules`) that the file at `path` imports: relative imports of any level,
    `from . import name` of a submodule, and absolute `peft_neuroada.*` imports."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" and name else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            dotted = [alias.name.split(".") for alias in node.names]
            targets = [parts[1:] for parts in dotted if parts[0] == "peft_neuroada"]
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "peft_neuroada"):
            base = package[: len(package) - node.level + 1] if node.level else []
            within = (node.module or "").split(".")[0 if node.level else 1 :]
            target = [*base, *(part for part in within if part)]
            submodules = [[*target, alias.name] for alias in node.names]
            targets = [target, *submodules] if node.module else submodules  # `from . import x`: x, not the package
        else:
            continue
        found |= {".".join(target) for target in targets} & modules
    return found - {name}


def test_the_package_modules_import_each_other_without_cycles_and_the_tuner_never_imports_train():
    paths = list(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): local_imports(path, modules) for path in paths}
    tuner = {name for name in graph if name.split(".")[0] == "tuner"}
    assert not [(name, m) for name in tuner for m in graph[name] if m not in tuner], "the tuner imports only itself"
    visiting, done = set(), set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in visiting, f"import cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        visiting.add(name)
        for imported in graph[name]:
            visit(imported, (*path, name))
        visiting.discard(name)
        done.add(name)

    for name in graph:
        visit(name, ())
    assert "registration" not in set().union(*(graph[m] for m in graph if m != ""))
    core = [name for name in graph if name.split(".")[0] != "train"]
    assert not [(name, m) for name in core for m in graph[name] if m.split(".")[0] == "train"]


def start_up_hook_installed() -> bool:
    return any((Path(directory) / "peft_neuroada.pth").exists() for directory in site.getsitepackages())


def python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -c code` started outside the checkout, so only the installed package is importable."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env={**os.environ, **env}, timeout=120
    )


needs_hook = pytest.mark.skipif(not start_up_hook_installed(), reason="peft-neuroada is not pip-installed")


@needs_hook
def test_the_installed_start_up_hook_is_this_checkouts():
    """An install copies `peft_neuroada_autoload.py` into site-packages (an editable one too): a copy left by an older
    install would keep its behaviour for every process until the package is installed again."""
    checkout = PACKAGE.parent / "peft_neuroada_autoload.py"
    installed = [Path(d) / checkout.name for d in site.getsitepackages() if (Path(d) / "peft_neuroada.pth").exists()]
    stale = [str(path) for path in installed if not path.exists() or path.read_bytes() != checkout.read_bytes()]
    assert not stale, f"{stale} differ from {checkout}: install the package again (pip install -e .)"


@needs_hook
def test_the_start_up_hook_imports_nothing_in_an_interpreter_that_never_imports_peft(tmp_path):
    modules = "('torch', 'peft', 'peft_neuroada')"
    done = python(f"import sys; print(sorted(m for m in {modules} if m in sys.modules))", tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "[]"


@needs_hook
def test_the_start_up_hook_can_be_switched_off(tmp_path):
    code = "import sys, peft; print('peft_neuroada' in sys.modules)"
    assert python(code, tmp_path).stdout.strip() == "True"
    done = python(code, tmp_path, PEFT_NEUROADA_NO_AUTOLOAD="1")
    assert done.stdout.strip() == "False"


@needs_hook
def test_a_broken_peft_neuroada_never_breaks_importing_peft(tmp_path):
    broken = tmp_path / "peft_neuroada"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('broken install')\n")
    done = python("import peft; print(peft.__version__)", tmp_path, PYTHONPATH=str(tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == peft.__version__
    assert "could not register the NEUROADA peft type" in done.stderr


def test_the_core_plugin_needs_none_of_the_training_extra(tmp_path):
    """datasets and gguf hidden (pyyaml always comes with huggingface_hub): inject, save, load and run an adapter."""
    code = f"""
import sys
sys.modules.update(datasets=None, gguf=None)
import torch
from peft import PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from peft_neuroada import NeuroAdaConfig

def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config).eval()

model = get_peft_model(tiny(), NeuroAdaConfig(k=1, init_weights=False))
model.save_pretrained({str(tmp_path)!r})
tokens = torch.arange(8)[None]
print(torch.equal(model(tokens).logits, PeftModel.from_pretrained(tiny(), {str(tmp_path)!r})(tokens).logits))
"""
    done = python(code, tmp_path, PYTHONPATH=str(PACKAGE.parent))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_registering_twice_changes_nothing():
    import peft_neuroada

    before = dict(peft.mapping.PEFT_TYPE_TO_TUNER_MAPPING)
    assert peft_neuroada.register() is peft_neuroada.NEUROADA
    assert dict(peft.mapping.PEFT_TYPE_TO_TUNER_MAPPING) == before
