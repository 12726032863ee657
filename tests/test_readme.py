"""The README is a two-minute page for someone who knows LoRA, and what it states holds."""

from __future__ import annotations

import re
from pathlib import Path

from peft_neuroada import NeuroAdaConfig, k_for_budget

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
LINES = README.splitlines()


def test_the_readme_shows_get_peft_model_early():
    assert any("get_peft_model(" in line for line in LINES[:60])


def test_the_readme_has_the_sections_a_lora_user_needs():
    for heading in ("## Set-up: the two commands", "## Quickstart", "## Coming from LoRA", "### When not to use it"):
        assert heading in LINES, heading
    for topic in ("Learning rate", "k_for_budget", "Cost, NeuroAda over LoRA"):
        assert topic in README, topic


def test_the_readme_test_command_is_what_ci_runs():
    commands = re.findall(r"^pip install .*python -m pytest$", README, flags=re.MULTILINE)
    assert len(commands) == 1
    assert commands[0] in (REPO / ".ci" / "run").read_text().splitlines()


def test_the_rank_to_k_example_gives_the_k_the_readme_states(smollm2):
    stated = re.search(r"lora_rank=8\)` gives the k .*?: (\d+) on\s+SmolLM2-135M", README, flags=re.DOTALL)
    assert stated is not None
    assert k_for_budget(smollm2, NeuroAdaConfig(), lora_rank=8) == int(stated.group(1))
