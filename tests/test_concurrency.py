"""Any number of threads may run one unmerged NeuroAda model at once (forward, backward, generate): every call gives
the single-threaded result bit for bit, and the frozen weights are bit-identical afterwards."""

from __future__ import annotations

import copy
import pickle
import threading
from collections.abc import Callable

import pytest
import torch
from peft import get_peft_model

from peft_neuroada import NeuroAdaConfig
from tests.conftest import neuroada_layers, tiny_llama

THREADS = 4
ITERATIONS = 20


def run_in_threads(work: Callable[[int], list], threads: int = THREADS) -> list[list]:
    """Run `work(thread_index)` in that many threads started together; re-raise the first failure."""
    barrier = threading.Barrier(threads)
    results: list = [None] * threads
    errors: list[BaseException] = []

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = work(index)
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return results


def frozen_weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "base_layer" in name}


def assert_weights_unchanged(model, before: dict[str, torch.Tensor]) -> None:
    changed = [name for name, p in model.named_parameters() if name in before and not torch.equal(p, before[name])]
    assert not changed, f"frozen weights changed: {changed[:5]}"


def batches(count: int, batch: int = 2, tokens: int = 12) -> list[torch.Tensor]:
    return [torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(i)) for i in range(count)]


@pytest.fixture
def model():
    """An unmerged tiny Llama with the default config and non-zero deltas."""
    return get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False)).eval()


def test_threaded_inference_equals_single_threaded_bit_for_bit(model):
    inputs = batches(THREADS)
    with torch.no_grad():
        expected = [model(x).logits for x in inputs]
    before = frozen_weights(model)

    def work(i: int) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(inputs[i]).logits for _ in range(ITERATIONS)]

    for i, outputs in enumerate(run_in_threads(work)):
        assert all(torch.equal(out, expected[i]) for out in outputs)
    assert_weights_unchanged(model, before)


def test_threaded_training_steps_give_single_threaded_outputs_and_delta_gradients(model):
    inputs = batches(THREADS)
    deltas = [p for name, p in model.named_parameters() if p.requires_grad]

    def loss_and_grads(x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        loss = model(input_ids=x, labels=x).loss
        return loss.detach(), torch.autograd.grad(loss, deltas)

    expected = [loss_and_grads(x) for x in inputs]
    before = frozen_weights(model)

    for i, runs in enumerate(run_in_threads(lambda i: [loss_and_grads(inputs[i]) for _ in range(ITERATIONS // 2)])):
        for loss, grads in runs:
            assert torch.equal(loss, expected[i][0])
            assert all(torch.equal(g, e) for g, e in zip(grads, expected[i][1], strict=True))
    assert_weights_unchanged(model, before)


def test_threaded_generate_equals_single_threaded_generate(model):
    inputs = batches(THREADS, batch=1, tokens=6)

    def generate(x: torch.Tensor) -> torch.Tensor:
        return model.generate(input_ids=x, max_new_tokens=6, do_sample=False, pad_token_id=0)

    expected = [generate(x) for x in inputs]
    before = frozen_weights(model)
    for i, outputs in enumerate(run_in_threads(lambda i: [generate(inputs[i]) for _ in range(ITERATIONS // 4)])):
        assert all(torch.equal(out, expected[i]) for out in outputs)
    assert_weights_unchanged(model, before)


def test_a_mixed_batch_call_in_one_thread_leaves_plain_calls_in_others_untouched(model):
    model.add_adapter("other", NeuroAdaConfig(k=1, init_weights=False))
    inputs = batches(THREADS)
    with torch.no_grad():
        expected = [model(x).logits for x in inputs]
        expected_mixed = model(inputs[0], adapter_names=["other", "__base__"]).logits

    def work(i: int) -> list[bool]:
        with torch.no_grad():
            if i == 0:
                return [torch.equal(model(inputs[0], adapter_names=["other", "__base__"]).logits, expected_mixed)]
            return [torch.equal(model(inputs[i]).logits, expected[i]) for _ in range(ITERATIONS)]

    assert all(all(matches) for matches in run_in_threads(work))


def test_threaded_inference_on_smollm2_equals_single_threaded(smollm2, smollm2_tokenizer):
    model = get_peft_model(smollm2, NeuroAdaConfig(k=1, init_weights=False))
    prompts = ["The capital of France is", "Two plus two equals", "Water boils at"]
    inputs = [smollm2_tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    with torch.no_grad():
        expected = [model(x).logits for x in inputs]
    before = frozen_weights(model)

    def work(i: int) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(inputs[i]).logits for _ in range(3)]

    for i, outputs in enumerate(run_in_threads(work, threads=len(prompts))):
        assert all(torch.equal(out, expected[i]) for out in outputs)
    assert_weights_unchanged(model, before)


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))])
def test_a_copy_of_a_model_keeps_nothing_of_the_originals_visits(duplicate):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=1, init_weights=False))
    tokens = torch.randint(0, 128, (2, 5))
    model(tokens).logits.sum().backward()  # the layers now hold placements
    copied = duplicate(model)
    assert all(twin.placements.kept == {} for twin in neuroada_layers(copied))
    torch.testing.assert_close(copied(tokens).logits, model(tokens).logits, rtol=0, atol=0)
