"""Saving over an adapter is atomic as a whole: a save interrupted at any step of its file-system work leaves a folder
that loads as exactly the previous adapter or exactly the new one, never a mix and never an error, and a completed
save leaves nothing of its bookkeeping behind."""

from __future__ import annotations

import builtins
import functools
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import pytest
import safetensors.torch
import torch
from peft import PeftModel, get_peft_model

from peft_neuroada import NeuroAdaConfig
from tests.conftest import logits, tiny_llama


class Interrupted(BaseException):
    """A crash or Ctrl-C in the middle of a save: a BaseException, like KeyboardInterrupt, so that no
    `except Exception` (or `except OSError`) on the way out can swallow it."""


# Every function through which a save changes the file system: Python's file operations and safetensors' writer.
WRITES = [
    *[(os, name) for name in ("link", "replace", "rename", "unlink", "remove", "mkdir", "rmdir")],
    *[(shutil, name) for name in ("copyfile", "copy", "copy2", "rmtree")],
    *[(Path, name) for name in ("unlink", "write_bytes", "write_text", "touch", "mkdir")],
    (safetensors.torch, "save_file"),
]


@contextmanager
def write_steps(fails: Callable[[int, str], bool] = lambda number, step: False) -> Iterator[list[str]]:
    """Record every file-system write as a step ("function file-name"); a step that `fails` (given its 1-based number
    and itself) raises Interrupted instead of running."""
    steps: list[str] = []

    def watched(function: Callable, name: str) -> Callable:
        @functools.wraps(function)
        def step(*args, **kwargs):
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            if name == "open" and not set("wax+") & set(str(mode)):
                return function(*args, **kwargs)
            paths = [arg for arg in args[: 1 if name == "open" else None] if isinstance(arg, (str, os.PathLike))]
            steps.append(f"{name} {Path(paths[-1]).name if paths else ''}")
            if fails(len(steps), steps[-1]):
                raise Interrupted(steps[-1])
            return function(*args, **kwargs)

        return step

    with ExitStack() as patches:
        for owner, name in [*WRITES, (builtins, "open")]:
            patches.enter_context(mock.patch.object(owner, name, watched(getattr(owner, name), name)))
        yield steps


def interrupted(at: int, how: str) -> Callable[[int, str], bool]:
    """`killed`: the process dies at step `at` (no later step runs, not even cleanups); `interrupted`: step `at`
    raises, and the cleanups on the way out run."""
    return (lambda number, step: number >= at) if how == "killed" else (lambda number, step: number == at)


def before_config_rename(number: int, step: str) -> bool:
    """The last moment of a save before its commit: the new weights are in place, the config is not yet."""
    return step == "replace adapter_config.json"


class Adapters(dict[str, PeftModel]):
    """Adapters by name, each with its outputs on `tokens`, to tell which of them a folder loads as."""

    def __init__(self, tokens: torch.Tensor, **adapters: PeftModel) -> None:
        super().__init__(adapters)
        self.tokens = tokens
        self.outputs = {name: logits(model, tokens) for name, model in adapters.items()}

    def loaded_from(self, folder: Path, *candidates: str) -> str:
        """Which of the `candidates` (all adapters when none are named) a fresh base model loads from `folder`, with
        bit-exact outputs; fails on anything else, a failing load included."""
        listing = sorted(path.name for path in folder.iterdir())
        loaded = logits(PeftModel.from_pretrained(tiny_llama(), folder), self.tokens)
        matches = [name for name in candidates or self if torch.equal(loaded, self.outputs[name])]
        assert len(matches) == 1, f"{folder} loads as none of {candidates or list(self)}: {listing}"
        return matches[0]


def adapter(k: int, scale: float = 1.0) -> PeftModel:
    """A tiny Llama adapter with non-zero deltas (multiplied by `scale`, to tell apart adapters of one config)."""
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=k, init_weights=False)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "neuroada_delta" in name:
                parameter.mul_(scale)
    return model


def bookkeeping(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.endswith(".previous"))


def sweep(folder: Path, old: str, new: str, adapters: Adapters, how: str) -> tuple[list[str], list[str]]:
    """Save adapter `new` over the folder (holding `old`) once per step of that save, interrupted at that step, each
    time from the folder as it was; returns the save's steps and, per step, which adapter the folder then loads.
    After each interruption, saving again completes and leaves no bookkeeping."""
    snapshot = folder.with_name(f"{folder.name}-snapshot")
    shutil.copytree(folder, snapshot)
    with write_steps() as steps:
        adapters[new].save_pretrained(folder)
    outcomes = []
    for at in range(1, len(steps) + 1):
        shutil.rmtree(folder)
        shutil.copytree(snapshot, folder)
        with write_steps(interrupted(at, how)), pytest.raises(Interrupted):
            adapters[new].save_pretrained(folder)
        outcomes.append(adapters.loaded_from(folder, old, new))
        adapters[new].save_pretrained(folder)
        assert adapters.loaded_from(folder) == new and bookkeeping(folder) == [], f"after step {at}"
    return steps, outcomes


def commit_step(steps: list[str], outcomes: list[str], old: str, new: str) -> str:
    """The step after which the folder loads as `new`: before it, every interruption leaves `old`; after it, `new`."""
    switch = outcomes.index(new)
    assert switch > 0 and outcomes == [old] * switch + [new] * (len(outcomes) - switch), outcomes
    return steps[switch - 1]


@pytest.mark.parametrize("how", ["killed", "interrupted"])
def test_a_save_over_an_adapter_interrupted_at_any_step_loads_as_the_old_or_the_new_adapter(
    tmp_path, token_batch, how
):
    """The config's rename commits the save: the weights (k=2 deltas over k=1 ones) are replaced before it, and
    the folder still loads the previous adapter whole until then."""
    adapters = Adapters(token_batch, A=adapter(k=1), B=adapter(k=2))
    folder = tmp_path / "adapter"
    adapters["A"].save_pretrained(folder)
    steps, outcomes = sweep(folder, "A", "B", adapters, how)
    assert any(step.startswith("save_file .adapter_model.safetensors.") for step in steps)
    assert steps.index("replace adapter_model.safetensors") < steps.index("replace adapter_config.json")
    assert commit_step(steps, outcomes, "A", "B") == "replace adapter_config.json"


@pytest.mark.parametrize("how", ["killed", "interrupted"])
def test_repeated_checkpoints_of_one_config_interrupted_at_any_step_load_as_one_of_them(tmp_path, token_batch, how):
    """Two saves in a row with byte-identical configs: the config's rename changes nothing a reader can see, so the
    save commits by dropping the kept copy of the previous pair instead."""
    adapters = Adapters(token_batch, first=adapter(k=2), second=adapter(k=2, scale=2.0))
    folder = tmp_path / "adapter"
    adapters["first"].save_pretrained(folder)
    config = (folder / "adapter_config.json").read_bytes()
    steps, outcomes = sweep(folder, "first", "second", adapters, how)
    assert (folder / "adapter_config.json").read_bytes() == config
    assert commit_step(steps, outcomes, "first", "second") == "unlink .adapter_config.json.previous"


def test_a_save_after_an_interrupted_one_keeps_the_pair_that_loads(tmp_path, token_batch):
    """A save interrupted just before its config's rename leaves the new weights beside the old config: the folder
    loads the previous adapter whole, with a warning, and the next save, interrupted anywhere, never pairs those
    orphaned weights with anything."""
    adapters = Adapters(token_batch, A=adapter(k=1), B=adapter(k=2), C=adapter(k=3))
    folder = tmp_path / "adapter"
    adapters["A"].save_pretrained(folder)
    saved_a = (folder / "adapter_model.safetensors").read_bytes()
    with write_steps(before_config_rename), pytest.raises(Interrupted):
        adapters["B"].save_pretrained(folder)
    assert (folder / "adapter_model.safetensors").read_bytes() != saved_a
    warning = rf"last save into '{re.escape(str(folder))}' was interrupted .* Save the adapter again"
    with pytest.warns(UserWarning, match=warning):
        assert adapters.loaded_from(folder) == "A"
    steps, outcomes = sweep(folder, "A", "C", adapters, "killed")
    assert commit_step(steps, outcomes, "A", "C") == "replace adapter_config.json"


def test_loading_after_an_interrupted_save_writes_nothing(tmp_path, token_batch):
    """Folders a reader cannot write (the Hugging Face cache, a read-only mount) load after an interrupted save just
    the same: picking the consistent pair only reads."""
    adapters = Adapters(token_batch, A=adapter(k=1), B=adapter(k=2))
    folder = tmp_path / "adapter"
    adapters["A"].save_pretrained(folder)
    with write_steps(before_config_rename), pytest.raises(Interrupted):
        adapters["B"].save_pretrained(folder)
    with write_steps(lambda number, step: True) as writes, pytest.warns(UserWarning, match="was interrupted"):
        assert adapters.loaded_from(folder) == "A"
    assert writes == []


def test_a_completed_save_over_an_adapter_leaves_only_the_adapter_files(tmp_path, token_batch):
    adapters = Adapters(token_batch, A=adapter(k=1), B=adapter(k=2))
    adapters["A"].save_pretrained(tmp_path)
    adapters["B"].save_pretrained(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert adapters.loaded_from(tmp_path) == "B"
