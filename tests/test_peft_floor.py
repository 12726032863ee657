"""pyproject admits only the peft versions the suite has passed on: from `registration.MINIMUM_PEFT`, which the plugin
refuses to import below, up to the newest release the upstream patches target (`TARGET_PEFT`), without the next minor
release. The suite itself runs on the newest; here the specs of the seams with peft (the plugin's overrides of peft's
methods, saving and loading through peft, what a LoRA user does with a PeftModel, peft's refusals) run again on the
floor, in a virtual environment that sees this one's packages but peft, installed there at the floor release."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from peft_neuroada.cache import cache_root
from peft_neuroada.registration import MINIMUM_PEFT

ROOT = Path(__file__).resolve().parents[1]
SEAMS = [
    "tests/test_peft_compat.py",
    "tests/test_save_load.py",
    "tests/test_peft_behaviour.py",
    "tests/test_peft_refusals.py",
]
# Those specs on tiny models: the ones on real models (SmolLM2, MiniLM), through transformers' Trainer or in a fresh
# process take most of the time and test transformers and the models more than peft.
ON_TINY_MODELS = "not (smollm2 or minilm or real or trainer or fresh_process or gradient_checkpointing or low_cpu_mem)"


def peft_requirement() -> Requirement:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(Requirement(line) for line in dependencies if Requirement(line).name == "peft")


def test_pyproject_and_the_readme_admit_peft_from_the_floor_to_the_targeted_release_without_the_next_minor(
    upstream_patch,
):
    ceiling = f"0.{Version(upstream_patch.TARGET_PEFT).minor + 1}"
    assert str(peft_requirement().specifier) == f"<{ceiling},>={MINIMUM_PEFT}"
    assert f"peft >={MINIMUM_PEFT},<{ceiling} " in " ".join((ROOT / "README.md").read_text().split())


@pytest.fixture(scope="module")
def floor_python(tmp_path_factory) -> Path:
    """A virtual environment with this one's packages (the plugin, installed editable, among them) but peft at the
    floor, installed from a wheel downloaded once into the project cache."""
    if version("peft") == MINIMUM_PEFT:
        pytest.skip(f"the installed peft is the floor, {MINIMUM_PEFT}: the whole suite runs on it")
    wheels = cache_root() / "peft-wheels"
    if not list(wheels.glob(f"peft-{MINIMUM_PEFT}-*.whl")):
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
        fetched = subprocess.run([*command, f"peft=={MINIMUM_PEFT}"], capture_output=True, text=True)
        if fetched.returncode != 0:
            pytest.skip(f"no wheel of peft {MINIMUM_PEFT}: {fetched.stderr[-500:]}")
    venv = tmp_path_factory.mktemp("peft-floor") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    command = [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--find-links", str(wheels)]
    subprocess.run([*command, f"peft=={MINIMUM_PEFT}", "-q"], check=True, capture_output=True)
    found = subprocess.run([python, "-c", "import peft; print(peft.__version__)"], capture_output=True, text=True)
    assert found.stdout.strip() == MINIMUM_PEFT, found.stderr[-2000:]
    return python


def test_the_seams_with_peft_hold_on_the_floor_release(floor_python):
    command = [str(floor_python), "-m", "pytest", *SEAMS, "-k", ON_TINY_MODELS]
    command += ["-q", "-n", "0", "-p", "no:cacheprovider"]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert int(re.search(r"(\d+) passed", run.stdout)[1]) >= 60
