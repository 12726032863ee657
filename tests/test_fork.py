"""A process forked while other threads run NeuroAda forwards (a server forking workers, DataLoader workers started
mid-inference) starts with every weight lock free and every weight restored: its own forwards neither hang nor see a
patched weight."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from peft import get_peft_model

from peft_neuroada import NeuroAdaConfig
from tests.conftest import neuroada_layers, tiny_llama

CHILDREN = 8
CHILD_SECONDS = 20  # a child still running then is hung on a lock


def wait_for(pid: int, seconds: float) -> int | None:
    """The child's exit status, or None (after killing it) if it has not ended within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("adapters", [1, 2], ids=["c-entry-patch", "torch-scatter"])
def test_children_forked_during_other_threads_forwards_run_exactly(adapters):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    if adapters == 2:
        model.add_adapter("other", NeuroAdaConfig(k=2, init_weights=False))
        model.base_model.set_adapter(["default", "other"])
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    weights = [layer.get_base_layer().weight.detach().clone() for layer in neuroada_layers(model)]
    # On the children's thread count (one, below): their outputs are compared bit for bit, and another count may split
    # a matmul's sums differently (MKL promises the same bits only for the same number of threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            expected = model(tokens).logits
    finally:
        torch.set_num_threads(threads)

    stop = threading.Event()

    def serve() -> None:
        with torch.no_grad():
            while not stop.is_set():
                model(tokens)

    servers = [threading.Thread(target=serve) for _ in range(2)]
    for server in servers:
        server.start()
    statuses = []
    try:
        for child in range(CHILDREN):
            time.sleep(0.003 * child)  # fork at different points of the servers' visits
            pid = os.fork()
            if pid == 0:  # the child: exit status 0 only if its weights and its forward are exact
                code = 1
                try:
                    torch.set_num_threads(1)  # as DataLoader workers do: torch's thread pool does not survive a fork
                    restored = all(
                        torch.equal(layer.get_base_layer().weight, weight)
                        for layer, weight in zip(neuroada_layers(model), weights, strict=True)
                    )
                    with torch.no_grad():
                        exact = torch.equal(model(tokens).logits, expected)
                    code = 0 if restored and exact else 2
                finally:
                    os._exit(code)
            statuses.append(wait_for(pid, CHILD_SECONDS))
    finally:
        stop.set()
        for server in servers:
            server.join()
    assert statuses == [0] * CHILDREN, "exit statuses (None: hung, 2: patched weight or wrong output)"
