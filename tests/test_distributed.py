"""Data-parallel and sharded training with NeuroAda: two CPU processes over gloo (raw DDP, FSDP2, FSDP1, and DDP
through Accelerate), and DeepSpeed ZeRO-3's contract.

Each scenario of tests/distributed_worker.py runs once per module (about 15 s for two processes on two cores;
torchrun's --standalone rendezvous picks a free port) and the tests below read its per-rank results. The reference is
one process trained on the union of the ranks' batches: with the gradient averaged over equal-sized batches,
data-parallel training must reach the same deltas.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import transformers.integrations.deepspeed as hf_deepspeed
from peft import get_peft_model
from safetensors.torch import load_file
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from peft_neuroada import NeuroAdaConfig
from tests.conftest import neuroada_layers, tiny_llama, train_on_batch
from tests.distributed_worker import LEARNING_RATE, STEPS, WORLD_SIZE, neuroada_config, rank_batch

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 120
ADAPTER_FILE = "adapter_model.safetensors"

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")


def launch(scenario: str, out: Path) -> list[dict]:
    """Run one worker scenario on two processes; kill the whole process group if it overruns."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD_SIZE}"]
    command += ["-m", "tests.distributed_worker", scenario, str(out)]
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{scenario} did not finish within {LAUNCH_TIMEOUT_S} s:\n{output[-4000:]}")
    assert process.returncode == 0, f"{scenario} failed:\n{output[-6000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def single_process() -> dict:
    """The reference: one process, the same config, trained on all ranks' batches at once."""
    model = get_peft_model(tiny_llama(), neuroada_config())
    indices = {n: b.clone() for n, b in model.named_buffers() if "neuroada_indices" in n}
    train_on_batch(model, torch.cat([rank_batch(rank) for rank in range(WORLD_SIZE)]), STEPS, LEARNING_RATE)
    deltas = {n: p.detach().clone() for n, p in model.named_parameters() if "neuroada_delta" in n}
    return {"indices": indices, "deltas": deltas}


@pytest.fixture(scope="module")
def single_process_save(tmp_path_factory) -> dict[str, torch.Tensor]:
    directory = tmp_path_factory.mktemp("single")
    get_peft_model(tiny_llama(), neuroada_config()).save_pretrained(directory)
    return load_file(directory / ADAPTER_FILE)


@pytest.fixture(scope="module", params=["ddp-no-buffer-broadcast", "fsdp2", "fsdp1", "accelerate"])
def parallel_run(request, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(request.param)
    return {"ranks": launch(request.param, out), "saved": load_file(out / "adapter" / ADAPTER_FILE)}


def signature(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def test_every_rank_lowers_the_loss(parallel_run):
    for rank in parallel_run["ranks"]:
        assert rank["losses"][-1] < rank["losses"][0]


def test_every_rank_selects_the_single_process_indices(parallel_run, single_process):
    for rank in parallel_run["ranks"]:
        indices = {n: t for n, t in rank["adapter"].items() if "neuroada_indices" in n}
        assert indices.keys() == single_process["indices"].keys()
        for name, expected in single_process["indices"].items():
            assert torch.equal(indices[name], expected), name


def test_training_equals_one_process_on_the_union_of_the_batches(parallel_run, single_process):
    """Gradients averaged over equal batches are the full-batch gradient, so every rank ends at the same deltas."""
    for rank in parallel_run["ranks"]:
        for name, expected in single_process["deltas"].items():
            torch.testing.assert_close(rank["adapter"][name], expected, atol=1e-5, rtol=1e-4, msg=name)


def test_rank0_saves_the_same_adapter_files_as_a_single_process(parallel_run, single_process_save):
    """fsdp1 included: NeuroAda finds its layers under FSDP1's auto-wrapping, where peft alone saves nothing."""
    assert signature(parallel_run["saved"]) == signature(single_process_save)
    for name in (name for name in single_process_save if "neuroada_indices" in name):
        assert torch.equal(parallel_run["saved"][name], single_process_save[name]), name
    for name, tensor in parallel_run["saved"].items():
        assert torch.equal(tensor, parallel_run["ranks"][0]["adapter"][f"{name}.default"]), name


def test_layers_inside_activation_checkpointing_wrappers_are_saved(tmp_path, single_process_save):
    """The wrapper that FSDP1 auto-wrapping puts mid-name is dropped from state-dict keys, and so is the one of
    activation checkpointing (Accelerate's and Trainer's `activation_checkpointing` for FSDP): the same mechanism,
    checked here in one process."""
    model = get_peft_model(tiny_llama(), neuroada_config())
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, LlamaDecoderLayer))
    assert any("._checkpoint_wrapped_module." in name for name, _ in model.named_modules())
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / ADAPTER_FILE)
    assert signature(saved) == signature(single_process_save)
    for name, tensor in saved.items():
        assert torch.equal(tensor, single_process_save[name]), name


def test_ddp_with_default_settings_trains(tmp_path, single_process):
    for rank in launch("ddp", tmp_path):
        for name, expected in single_process["deltas"].items():
            torch.testing.assert_close(rank["adapter"][name], expected, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def shard_then_inject(tmp_path_factory) -> list[dict]:
    return launch("shard-then-inject", tmp_path_factory.mktemp("shard-then-inject"))


def test_selection_on_a_row_sharded_dtensor_equals_selection_on_the_full_weight(shard_then_inject):
    for rank in shard_then_inject:
        selected = rank["sharded_selection"]
        assert isinstance(selected, torch.Tensor), selected
        assert torch.equal(selected, rank["full_selection"])


def test_get_peft_model_after_fully_shard_asks_for_the_right_order(shard_then_inject):
    for rank in shard_then_inject:
        assert rank["inject_after_fsdp2"].startswith("ValueError")
        assert "before" in rank["inject_after_fsdp2"]


def test_get_peft_model_after_fsdp1_wrapping_asks_for_the_right_order(shard_then_inject):
    for rank in shard_then_inject:
        assert rank["inject_after_fsdp1"].startswith("ValueError")
        assert "before" in rank["inject_after_fsdp1"]


# DeepSpeed is not installed: these tests stand in for ZeRO-3 with its documented contract. A partitioned parameter
# is an nn.Parameter with ds_* attributes whose data is empty; `deepspeed.zero.GatheredParameters` makes it whole for
# a block of code, and during training DeepSpeed's hooks on every module gather the module's own parameters around
# its forward.


def partition_(param: nn.Parameter, ds_id: int) -> None:
    param.ds_id, param.ds_shape, param.ds_tensor = ds_id, param.shape, param.data
    param.data = torch.empty(0, dtype=param.dtype)


def gather_(param: nn.Parameter) -> None:
    param.data = param.ds_tensor


def release_(param: nn.Parameter) -> None:
    param.data = torch.empty(0, dtype=param.dtype)


def partition_linear_weights_(model: nn.Module) -> None:
    """ZeRO-3 after `deepspeed.initialize`: each base linear weight is gathered only around its module's forward."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for ds_id, linear in enumerate(linears):
        partition_(linear.weight, ds_id)
        linear.register_forward_pre_hook(lambda module, args: gather_(module.weight))
        linear.register_forward_hook(lambda module, args, output: release_(module.weight))


@contextmanager
def gathered_parameters(params, modifier_rank=None, fwd_module=None) -> Iterator[None]:
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    for param in partitioned:
        gather_(param)
    try:
        yield
    finally:
        for param in partitioned:
            release_(param)


class Zero3Config:
    """Stands in for transformers' HfDeepSpeedConfig of a ZeRO-3 run."""

    def is_zero3(self) -> bool:
        return True


@pytest.fixture
def zero3_enabled(monkeypatch) -> Iterator[None]:
    """What transformers sees while a ZeRO-3 HfDeepSpeedConfig is alive, and `deepspeed.zero.GatheredParameters`."""
    config = Zero3Config()  # transformers holds it by weak reference: keep it alive for the test
    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", weakref.ref(config))
    deepspeed = ModuleType("deepspeed")
    deepspeed.zero = SimpleNamespace(GatheredParameters=gathered_parameters)
    monkeypatch.setitem(sys.modules, "deepspeed", deepspeed)
    yield


def test_injected_before_zero3_partitioning_the_model_computes_the_same_outputs(token_batch):
    """DeepSpeed's hooks on the base layer send NeuroAda down the bypass, which reads the weight only inside
    the base layer's own forward, where ZeRO-3 has gathered it. (Deltas stay whole: docs/distributed.md sets the
    persistence threshold above their size.)"""
    config = NeuroAdaConfig(k=2, init_weights=False)
    reference = get_peft_model(tiny_llama(), config)
    model = get_peft_model(tiny_llama(), config)
    partition_linear_weights_(model)
    with torch.no_grad():
        torch.testing.assert_close(model(token_batch).logits, reference(token_batch).logits)
    layers = neuroada_layers(model)
    assert all(layer.get_base_layer().weight.numel() == 0 for layer in layers), "weights are partitioned again"


@pytest.mark.usefixtures("zero3_enabled")
def test_weights_partitioned_at_load_by_zero3_are_gathered_for_selection():
    """With HF's ZeRO-3 config, from_pretrained loads under zero.Init, so weights are partitioned before injection."""
    expected = get_peft_model(tiny_llama(), neuroada_config()).state_dict()
    model = tiny_llama()
    for ds_id, linear in enumerate(m for m in model.modules() if type(m) is nn.Linear):
        partition_(linear.weight, ds_id)
    model = get_peft_model(model, neuroada_config())
    indices = {n: b for n, b in model.named_buffers() if "neuroada_indices" in n}
    assert indices.keys() == {n for n in expected if "neuroada_indices" in n}
    for name, selected in indices.items():
        assert torch.equal(selected, expected[name]), name
