"""Threaded inference throughput: many Python threads serving one unmerged model, as a web server's pool does.

    python benchmarks/threaded_inference.py --model smollm2
    python benchmarks/threaded_inference.py --tiny          # smoke test

NeuroAda's linear layers never write the frozen weight (a merged copy per call, or the sparse bypass for few tokens),
so threads share an unmerged model without a lock, as with LoRA. This measures requests per second of NeuroAda, LoRA
and the bare base model with 1, 2 and 4 threads calling the same model (one torch intra-op thread, so the threads are
the only parallelism), for a forward over a prompt and for greedy generation.
"""

from __future__ import annotations

import argparse
import platform
import sys
import threading
import time
from collections.abc import Callable

import torch
from common import markdown_table
from cost.variants import TARGETS, build_model
from peft import LoraConfig, get_peft_model
from torch import nn

from peft_neuroada import NeuroAdaConfig

VARIANTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "base": lambda model: model,
    "neuroada k=1": lambda model: get_peft_model(model, NeuroAdaConfig(k=1, target_modules=TARGETS)),
    "lora r=1": lambda model: get_peft_model(model, LoraConfig(r=1, target_modules=TARGETS)),
}


def requests_per_second(call: Callable[[int], None], threads: int, per_thread: int) -> float:
    """Wall-clock throughput of `threads` threads, started together, each making `per_thread` calls."""
    barrier = threading.Barrier(threads + 1)

    def work(index: int) -> None:
        barrier.wait()
        for _ in range(per_thread):
            call(index)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    barrier.wait()
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    return threads * per_thread / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", choices=["smollm2", "tiny", "large-random"], default="smollm2")
    parser.add_argument("--tiny", action="store_true", help="Smoke mode: same as --model tiny.")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--calls", type=int, default=8, help="Calls per thread per measurement.")
    parser.add_argument("--rounds", type=int, default=3, help="Measurements per cell; the median is reported.")
    args = parser.parse_args(argv)
    model_name = "tiny" if args.tiny else args.model
    torch.set_num_threads(1)

    prompts = [
        torch.randint(0, 100, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(i))
        for i in range(max(args.threads))
    ]
    workloads: dict[str, Callable[[nn.Module], Callable[[int], None]]] = {
        "forward": lambda model: lambda i: model(input_ids=prompts[i]),
        "generate": lambda model: lambda i: model.generate(
            input_ids=prompts[i], max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
            pad_token_id=0,
        ),
    }  # fmt: skip

    results: dict[tuple[str, str, int], float] = {}
    for label, setup in VARIANTS.items():
        model = setup(build_model(model_name, torch.float32)).eval()
        with torch.no_grad():
            for workload, make_call in workloads.items():
                call = make_call(model)
                call(0)  # warm-up
                for threads in args.threads:
                    rates = sorted(requests_per_second(call, threads, args.calls) for _ in range(args.rounds))
                    results[label, workload, threads] = rates[len(rates) // 2]
                    print(
                        f"[{label}] {workload} x{threads}: {results[label, workload, threads]:.2f}/s", file=sys.stderr
                    )

    print(
        f"\nmodel={model_name} prompt={args.prompt_tokens} new_tokens={args.new_tokens} calls={args.calls} "
        f"rounds={args.rounds} intra-op threads=1 torch={torch.__version__} machine={platform.machine()}\n"
    )
    header = (
        ["variant", "workload"]
        + [f"{t} thr (req/s)" for t in args.threads]
        + [f"{t} thr / LoRA" for t in args.threads]
    )
    rows = [
        [label, workload]
        + [f"{results[label, workload, t]:.2f}" for t in args.threads]
        + [f"{results[label, workload, t] / results['lora r=1', workload, t]:.2f}x" for t in args.threads]
        for workload in workloads
        for label in VARIANTS
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
