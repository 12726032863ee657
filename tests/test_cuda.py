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

from peft_neuroada import Linear, NeuroAdaConfig

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_delta_gradient_on_cuda_is_one_gemm_in_the_operands_dtype_gathered_at_the_placement(dtype):
    """CUDA's default, `gathered_grad` (the out_dtype GEMM for half precision): the dense reference's values at the
    placement, the same bits on two runs, and what `sampled_grad` returns there."""
    from peft_neuroada.tuner import forward

    generator = torch.Generator().manual_seed(0)
    x, grad = torch.randn(300, 70, generator=generator), torch.randn(300, 90, generator=generator)
    cols = torch.stack([torch.randperm(70, generator=generator)[:20] for _ in range(45)]).int()
    rows = torch.arange(0, 90, 2, dtype=torch.int32)
    x, grad, cols, rows = x.to("cuda", dtype), grad.to("cuda", dtype), cols.cuda(), rows.cuda()
    got = forward.sampled_grad(x, grad, cols, rows)
    expected = (grad[:, rows.long()].double().T @ x.double()).gather(1, cols.long())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-4)
    assert torch.equal(got, forward.sampled_grad(x, grad, cols, rows))


def test_the_merged_copy_on_cuda_is_the_accumulating_writes_bits():
    from peft_neuroada.tuner.forward import Placement, entry_index, merged_copy

    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 48, generator=generator).to("cuda", torch.bfloat16)
    cols = torch.stack([torch.randperm(48, generator=generator)[:6] for _ in range(64)]).int().cuda()
    placements = [Placement(cols).prepared(), Placement(cols[::2, :2].clone(), torch.arange(0, 64, 2).int().cuda())]
    deltas = [torch.randn(64, 6, device="cuda") * 1e-2, torch.randn(32, 2, device="cuda").bfloat16()]
    expected = weight.clone()
    for placement, delta in zip(placements, deltas, strict=True):
        expected.index_put_(entry_index(expected, placement), delta.to(expected.dtype), accumulate=True)
    assert torch.equal(merged_copy(weight, placements, deltas), expected)


@pytest.mark.parametrize("k", [1, 20])
def test_a_training_step_of_neuroada_layers_never_waits_for_the_gpu(k):
    """Under torch's sync debug mode set to "error", forward and backward of adapted layers (after the first call,
    which prepares the placements) raise on any device-to-host synchronisation."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.SiLU(), nn.Linear(256, 64)).to("cuda", torch.bfloat16)
    model = get_peft_model(base, NeuroAdaConfig(k=k, target_modules=["0", "2"]))
    x = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_compiled_decoder_block_with_neuroada_layers_trains_like_eager_on_cuda(dtype):
    """torch.compile in its default mode (inductor) of a Llama decoder block with every projection adapted (in bf16
    the deltas' gradient is the out_dtype GEMM, which inductor lowers)."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama().to("cuda", dtype), NeuroAdaConfig(k=3, init_weights=False))
    block = model.base_model.model.model.layers[0]
    hidden = torch.randn(2, 12, model.config.hidden_size, device="cuda", dtype=dtype)
    position_ids = torch.arange(12, device="cuda")[None].expand(2, -1)
    rotary = model.base_model.model.model.rotary_emb(hidden, position_ids)

    def run(call):
        model.zero_grad()
        out = call(hidden, position_embeddings=rotary)
        out = out[0] if isinstance(out, tuple) else out
        out.square().mean().backward()
        return out.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None
        }

    eager_out, eager_grads = run(block)
    compiled_out, compiled_grads = run(torch.compile(block))
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(compiled_out, eager_out, **tolerance)
    assert compiled_grads.keys() == eager_grads.keys() and compiled_grads
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, **tolerance, msg=name)
