"""One rank of the two-process CPU (gloo) runs that tests/test_distributed.py specifies.

Launched as `python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.distributed_worker SCENARIO OUT`.
Every rank writes what the tests compare to OUT/rank{rank}.pt; rank 0 also saves the trained adapter to OUT/adapter.
The shared constants and `rank_batch` are imported by the tests too, so both sides train on exactly the same data.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from peft import PeftModel, get_peft_model
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.tuner.selection import select_inputs
from tests.conftest import tiny_llama, train_on_batch

WORLD_SIZE = 2
STEPS = 5
LEARNING_RATE = 1e-2
BATCH_SHAPE = (2, 12)
# A collective that hangs (e.g. one rank failed) errors out instead of blocking the test run.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def neuroada_config() -> NeuroAdaConfig:
    return NeuroAdaConfig(k=2)


def rank_batch(rank: int) -> torch.Tensor:
    """Each rank's own token batch: data-parallel ranks see different data."""
    return torch.randint(0, 128, BATCH_SHAPE, generator=torch.Generator().manual_seed(100 + rank))


def adapter_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in state_dict.items() if "neuroada_" in name}


def shard_layers_fsdp2(model: nn.Module) -> nn.Module:
    """FSDP2 as recommended for transformers: one unit per decoder layer plus the root."""
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for layer in model.modules():
        if isinstance(layer, LlamaDecoderLayer):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def wrap_fsdp1(model: nn.Module) -> FullyShardedDataParallel:
    # use_orig_params=True lets one FSDP unit hold both frozen weights and trainable deltas.
    policy = ModuleWrapPolicy({LlamaDecoderLayer})
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu")
    )


def full_state(wrapped: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, unsharded, on every rank (fine for a tiny model)."""
    return get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))


def adapter_state_fsdp2(wrapped: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter, unsharded: FSDP2 keeps the deltas as DTensor shards, the index buffers as plain tensors."""
    state = {name: t for name, t in wrapped.state_dict().items() if ".neuroada_" in name}
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in state.items()}


def train_wrapped(
    wrap: Callable[[PeftModel], nn.Module], gather: Callable[[nn.Module], dict], rank: int, out: Path
) -> None:
    """NeuroAda first, then the parallel wrapper; train, gather the adapter on every rank, save it on rank 0."""
    peft_model = get_peft_model(tiny_llama(), neuroada_config())
    wrapped = wrap(peft_model)
    losses = train_on_batch(wrapped, rank_batch(rank), STEPS, LEARNING_RATE)
    state = gather(wrapped)
    if rank == 0:
        peft_model.save_pretrained(out / "adapter", state_dict=state)
    torch.save({"losses": losses, "adapter": adapter_tensors(state)}, out / f"rank{rank}.pt")


def train_with_accelerate(rank: int, out: Path) -> None:
    """docs/distributed.md's Accelerate recipe: NeuroAda first, then `accelerator.prepare(model, optimizer)`.

    Under torchrun, `cpu=True` makes Accelerate join this launch's gloo group and wrap the model in DDP (its gradient
    averaging is what lets the tests compare with one process on both batches). Rank 0 saves with the plain
    `save_pretrained`, no state dict passed.
    """
    accelerator = Accelerator(cpu=True)
    model = get_peft_model(tiny_llama(), neuroada_config())
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokens = rank_batch(accelerator.process_index)
    model.train()
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(out / "adapter")
    state = accelerator.get_state_dict(model)
    torch.save({"losses": losses, "adapter": adapter_tensors(state)}, out / f"rank{rank}.pt")


def outcome(action: Callable[[], object]) -> object:
    """The action's result, or its exception as 'Type: message' (the tests state which one they expect)."""
    try:
        return action()
    except Exception as error:
        traceback.print_exc()
        return f"{type(error).__name__}: {error}"


def shard_then_inject(rank: int, out: Path) -> None:
    """The wrong order and its building block: what NeuroAda does with weights that are already sharded."""
    weight = tiny_llama().model.layers[0].mlp.up_proj.weight.detach()
    sharded = distribute_tensor(weight, init_device_mesh("cpu", (WORLD_SIZE,)), [Shard(0)])

    def inject_after_fsdp2() -> str:
        model = tiny_llama()
        shard_layers_fsdp2(model)
        get_peft_model(model, neuroada_config())
        return "injected"

    def inject_after_fsdp1() -> str:
        get_peft_model(wrap_fsdp1(tiny_llama()), neuroada_config())
        return "injected"

    results = {
        "full_selection": select_inputs(weight, 3),
        "sharded_selection": outcome(lambda: select_inputs(sharded, 3)),
        "inject_after_fsdp2": outcome(inject_after_fsdp2),
        "inject_after_fsdp1": outcome(inject_after_fsdp1),
    }
    torch.save(results, out / f"rank{rank}.pt")


SCENARIOS: dict[str, Callable[[int, Path], None]] = {
    "ddp": lambda rank, out: train_wrapped(DistributedDataParallel, full_state, rank, out),
    # DDP without buffer broadcasting (a common setting): every rank must still select the same indices itself.
    "ddp-no-buffer-broadcast": lambda rank, out: train_wrapped(
        lambda model: DistributedDataParallel(model, broadcast_buffers=False), full_state, rank, out
    ),
    "fsdp2": lambda rank, out: train_wrapped(shard_layers_fsdp2, adapter_state_fsdp2, rank, out),
    "fsdp1": lambda rank, out: train_wrapped(wrap_fsdp1, full_state, rank, out),
    "accelerate": train_with_accelerate,
    "shard-then-inject": shard_then_inject,
}


def main(scenario: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        SCENARIOS[scenario](dist.get_rank(), Path(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
