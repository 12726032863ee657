"""Deleting an adapter leaves nothing of it behind: no layer holds its deltas, indices, rows, settings, placements or
merge records, and adding and deleting adapters for as long as a session runs keeps memory flat, as with LoRA.
Unloading leaves no NeuroAda layer alive."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from peft_neuroada import NeuroAdaConfig
from tests.conftest import named_neuroada_layers, neuroada_layers, tiny_llama

DELETED = "deleted-adapter"


def reachable(root: object) -> Iterator[tuple[str, object]]:
    """Every object reachable from `root` through modules, peft_neuroada's own objects and the dicts, lists and
    tuples they hold, with the path that reaches it (tensors are not looked into)."""
    seen, stack = set(), [("", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield path, obj
        if isinstance(obj, dict):
            stack += [(f"{path}[{key!r}]", value) for key, value in obj.items()] + [(path, key) for key in obj]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(f"{path}[{i}]", item) for i, item in enumerate(obj)]
        elif isinstance(obj, nn.Module) or type(obj).__module__.startswith("peft_neuroada"):
            slots = [slot for cls in type(obj).__mro__ for slot in getattr(cls, "__slots__", ())]
            attributes = {slot: getattr(obj, slot, None) for slot in slots} | getattr(obj, "__dict__", {})
            stack += [(f"{path}.{name}", value) for name, value in attributes.items()]


def mentions(root: object, name: str) -> list[str]:
    """Where a string naming `name` is reachable from `root`."""
    return [path for path, obj in reachable(root) if isinstance(obj, str) and name in obj]


def tensor_bytes(root: object) -> int:
    """Bytes of the storages of every tensor reachable from `root`."""
    storages = {}
    for _, obj in reachable(root):
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(storages.values())


def live_tensor_bytes() -> int:
    """Bytes of the storages of every tensor the garbage collector tracks in this process."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            except RuntimeError:  # fake tensors an earlier torch.compile left behind hold no memory
                continue
    return sum(storages.values())


def train_step(model: nn.Module, adapter: str, tokens: torch.Tensor) -> None:
    model.base_model.set_adapter(adapter)
    model(input_ids=tokens, labels=tokens).loss.backward()


@pytest.fixture
def model_with_two_adapters(token_batch):
    """A tiny Llama with `default` and DELETED, half its neurons tuned (so rows are kept), after a training step and
    a merge and unmerge of each, so every per-adapter structure a layer keeps exists."""
    config = NeuroAdaConfig(k=2, neuron_fraction=0.5, init_weights=False)
    model = get_peft_model(tiny_llama(), config).train()
    model.add_adapter(DELETED, NeuroAdaConfig(k=3, neuron_fraction=0.5, init_weights=False))
    for adapter in ("default", DELETED):
        train_step(model, adapter, token_batch)
        model.merge_adapter([adapter])
        model.unmerge_adapter()
    model.base_model.set_adapter("default")
    assert all(mentions(layer, DELETED) for layer in neuroada_layers(model))
    return model


def test_a_deleted_adapter_is_mentioned_nowhere_in_any_layer(model_with_two_adapters, token_batch):
    model = model_with_two_adapters
    model.delete_adapter(DELETED)
    for name, layer in named_neuroada_layers(model).items():
        assert mentions(layer, DELETED) == [], name
        assert mentions(layer, "default"), name
    train_step(model, "default", token_batch)  # the adapter that is left still runs


def test_a_deleted_adapter_that_was_active_leaves_nothing_either(model_with_two_adapters):
    model = model_with_two_adapters
    model.base_model.set_adapter(DELETED)
    with pytest.warns(UserWarning, match=f"Adapter {DELETED} was active which is now deleted"):
        model.delete_adapter(DELETED)
    assert mentions(model, DELETED) == []


@pytest.mark.parametrize("config", [NeuroAdaConfig(k=2), LoraConfig(r=2)], ids=["neuroada", "lora"])
def test_fifty_add_train_delete_cycles_keep_memory_flat_as_with_lora(config):
    model = get_peft_model(tiny_llama(num_hidden_layers=1), config).train()
    tokens = torch.randint(0, 128, (2, 8))

    def cycle(i: int) -> None:
        model.add_adapter(f"cycle-{i}", config)
        train_step(model, f"cycle-{i}", tokens)
        model.base_model.set_adapter("default")
        model.delete_adapter(f"cycle-{i}")

    cycle(-1)  # warm-up: the first visit builds what every later one reuses
    held, live = tensor_bytes(model), live_tensor_bytes()
    for i in range(50):
        cycle(i)
    assert tensor_bytes(model) == held
    assert live_tensor_bytes() - live <= 4096  # a page at most, whatever else the process allocated meanwhile
    assert mentions(model, "cycle-") == []


@pytest.mark.parametrize("unload", ["unload", "merge_and_unload"])
def test_unloading_leaves_no_neuroada_layer_alive(model_with_two_adapters, unload):
    layers = [weakref.ref(layer) for layer in neuroada_layers(model_with_two_adapters)]
    with torch.no_grad():
        base = getattr(model_with_two_adapters, unload)()
    del model_with_two_adapters
    gc.collect()
    assert all(layer() is None for layer in layers)
    assert mentions(base, DELETED) == [] and mentions(base, "neuroada_") == []
