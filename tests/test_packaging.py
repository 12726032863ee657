"""The built wheel is what an installed package needs and declares what it imports: the C kernels' source (built at
first use), the start-up hook (`.pth` and its module), the license, and a torch new enough for every import."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), str(ROOT)],
        check=True,
        capture_output=True,
    )
    return zipfile.ZipFile(next(folder.glob("peft_neuroada-*.whl")))


def test_the_wheel_carries_the_kernel_source_the_start_up_hook_and_the_license(wheel):
    names = set(wheel.namelist())
    assert {"peft_neuroada/tuner/forward.py", "peft_neuroada.pth", "peft_neuroada_autoload.py"} <= names
    assert any(re.fullmatch(r"peft_neuroada-[^/]+\.dist-info/licenses/LICENSE", name) for name in names)
    assert wheel.read("peft_neuroada.pth").decode().strip() == "import peft_neuroada_autoload"


def test_the_wheel_requires_the_torch_that_its_imports_need(wheel):
    """`torch.distributed.fsdp.FSDPModule` (model.py) is public from torch 2.6 on."""
    metadata = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
    lines = wheel.read(metadata).decode().splitlines()
    requires = [line for line in lines if re.match(r"Requires-Dist: torch\b(?!ao)", line)]
    assert requires == ["Requires-Dist: torch>=2.6"]
    model_source = wheel.read("peft_neuroada/model.py").decode()
    assert "from torch.distributed.fsdp import FSDPModule" in model_source
