"""On a CUDA GPU (skipped elsewhere): a whole model selects, trains, merges, saves and serves there as on the CPU, and
reads of the frozen weight stay exact when work is queued on several streams. The QLoRA-style quantized bases' GPU
checks are in test_quantized.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import indices_by_layer, logits, tiny_llama
from peft import PeftModel, get_peft_model
from torch import nn

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.layers import Linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def adapted(device: str) -> PeftModel:
    """The tiny Llama with a non-identity adapter, selected on `device`."""
    return get_peft_model(tiny_llama().to(device), NeuroAdaConfig(k=2, init_weights=False)).eval()


def trainable_grads(model: PeftModel) -> dict[str, torch.Tensor]:
    return {name: p.grad.cpu() for name, p in model.named_parameters() if p.requires_grad}


def test_selection_on_the_gpu_picks_the_cpus_inputs():
    on_gpu, on_cpu = indices_by_layer(adapted("cuda")), indices_by_layer(adapted("cpu"))
    assert on_gpu.keys() == on_cpu.keys()
    assert all(torch.equal(on_gpu[name].cpu(), cols) for name, cols in on_cpu.items())


def test_a_training_step_on_the_gpu_gives_the_cpus_loss_and_delta_gradients(token_batch):
    losses, grads = {}, {}
    for device in ("cpu", "cuda"):
        model = adapted("cpu").to(device).train()  # the same deltas (init_weights=False draws them on the device)
        tokens = token_batch.to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses[device], grads[device] = loss.item(), trainable_grads(model)
        assert not any(p.grad is not None for p in model.parameters() if not p.requires_grad)
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-5)
    assert grads["cuda"].keys() == grads["cpu"].keys()
    for name, grad in grads["cpu"].items():
        torch.testing.assert_close(grads["cuda"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_merging_on_the_gpu_gives_the_unmerged_output_bit_for_bit_and_unmerging_the_frozen_weights(token_batch):
    model = adapted("cuda")
    tokens = token_batch.cuda()
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    unmerged = logits(model, tokens)
    model.merge_adapter()
    assert torch.equal(logits(model, tokens), unmerged)
    model.unmerge_adapter()
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if not p.requires_grad)


def test_an_adapter_saved_on_the_gpu_loads_onto_a_cpu_base_with_the_same_outputs(token_batch, tmp_path):
    model = adapted("cuda")
    expected = logits(model, token_batch.cuda()).cpu()
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    assert indices_by_layer(reloaded).keys() == indices_by_layer(model).keys()
    torch.testing.assert_close(logits(reloaded, token_batch), expected, rtol=1e-4, atol=1e-5)


def test_a_mixed_batch_on_the_gpu_gives_each_row_its_adapters_output(token_batch):
    model = adapted("cuda")
    model.add_adapter("other", NeuroAdaConfig(k=3, init_weights=False))
    tokens = token_batch.cuda()
    with torch.no_grad():
        mixed = model(tokens, adapter_names=["default", "other"]).logits
    model.set_adapter("default")
    first = logits(model, tokens[:1])
    model.set_adapter("other")
    second = logits(model, tokens[1:])
    torch.testing.assert_close(mixed, torch.cat([first, second]), rtol=1e-5, atol=1e-5)


def test_a_read_queued_on_another_stream_beside_an_adapted_visit_reads_the_frozen_weight():
    """An adapted visit computes on a copy of the weight: a frozen read queued on a second stream, running beside the
    visit's long matmul, reads the untouched weight."""
    torch.manual_seed(0)
    base = nn.Linear(4096, 4096, device="cuda").requires_grad_(False)
    layer = Linear(base, "default", NeuroAdaConfig(k=20, init_weights=False))
    long_input, short_input = torch.randn(32768, 4096, device="cuda"), torch.randn(64, 4096, device="cuda")
    expected = F.linear(short_input, base.weight, base.bias)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    first.wait_stream(torch.cuda.current_stream())
    second.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(first):
            layer(long_input)  # a copy, then a matmul of ~20 ms
        layer.enable_adapters(False)
        with torch.cuda.stream(second):
            read = layer(short_input)
    torch.cuda.synchronize()
    assert torch.equal(read, expected)


def test_a_captured_cuda_graph_replays_the_eager_output(token_batch):
    model = adapted("cuda")
    static = token_batch.cuda()
    expected = logits(model, static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):  # warm-up on the capturing stream, as torch.cuda.graphs asks
            model(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        captured = model(static).logits
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, expected, rtol=1e-5, atol=1e-5)
