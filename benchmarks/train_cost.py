"""Training cost of NeuroAda against a frozen-model floor and the other ways to tune a sparse/low-rank budget.

    python benchmarks/train_cost.py --model smollm2
    python benchmarks/train_cost.py --model large-random --json outputs/large.json
    python benchmarks/train_cost.py --model qwen3-moe # a random 0.39B Qwen3-MoE: experts through target_parameters
    python benchmarks/train_cost.py --tiny            # smoke test, a few seconds per variant (--model tiny-moe: MoE)

Each variant runs in fresh processes (forked on the CPU: the coordinator imports the libraries, all of them before the
first fork so every variant runs the same code, but never runs a tensor op; spawned for CUDA), so allocator state,
caches and peak-memory counters of one variant never leak into the next: one process measures memory, another one
time. Per variant it reports:

* step time: median of fwd + bwd + AdamW step over the timed steps (after warmup, pooled over `--rounds` passes
  that interleave the variants), as wall-clock and as process CPU time;
* peak memory growth over the loaded model: CUDA `max_memory_allocated`, or on CPU the process's peak RSS (VmHWM,
  reset through /proc/self/clear_refs once the variant is set up) minus the RSS right after loading the model;
* a deterministic memory account: bytes saved for backward (each storage once, parameters and buffers excluded since
  they exist anyway) + gradient bytes + optimizer-state bytes;
* inference forward time (no_grad, adapters unmerged);
* greedy generation, batch 1, adapters unmerged: `--gen-prompt` random prompt tokens, then `--gen-tokens` new ones,
  one forward each with the KV cache (transformers' `generate`), as new tokens per second (the prompt's forward
  included) and as a rate relative to the floor's;

and every figure as a ratio to the floor measured in the same run. Timing processes run glibc's default allocator,
which hands freed memory back to the OS so that every step faults its activations in again (~100k page faults per
SmolLM2 step), or with `--allocator keep` one that reuses it (as jemalloc, tcmalloc or CUDA's caching allocator do).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

import common  # this checkout's peft_neuroada first
import torch
from cost.measurement import MODEL_DEFAULTS, OPTIMIZERS, Result, RunSpec, run_all
from cost.report import check_targets, format_checks, format_table
from cost.variants import DENSE_ONLY, MOE_MODELS, QUANTIZATIONS, VARIANTS

from peft_neuroada.tuner.config import DTYPES


def add_step_options(parser: argparse.ArgumentParser) -> None:
    """The options that shape a training step (model, batch, precision, quantization, device, threads, optimizer):
    shared with step_profile.py, which profiles the same step."""
    parser.add_argument("--model", choices=sorted(MODEL_DEFAULTS), default="smollm2")
    parser.add_argument("--batch", type=int, help="Sequences per step (model default when omitted).")
    parser.add_argument("--seq-len", type=int, help="Tokens per sequence (model default when omitted).")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available).")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument(
        "--quantize", choices=sorted(QUANTIZATIONS), help="Load the base quantized (nf4: QLoRA's) for every variant."
    )
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads per variant; 1 keeps timings sane on a shared CPU."
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adamw",
        help="AdamW as torch defaults it (a Python loop on CPU; `neuroada train`'s) or fused (the Trainer's default).",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_step_options(parser)
    parser.add_argument("--tiny", action="store_true", help="Smoke mode: same as --model tiny.")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        help="Default: all (on a MoE model all but those that reach nn.Linear layers only: "
        f"{', '.join(sorted(DENSE_ONLY))}).",
    )
    parser.add_argument("--warmup", type=int, help="Untimed training steps before the timed ones.")
    parser.add_argument("--steps", type=int, help="Timed training steps; the median is reported.")
    parser.add_argument("--infer-steps", type=int, help="Timed no-grad forwards (0 skips inference timing).")
    parser.add_argument("--gen-steps", type=int, help="Timed greedy generations (0 skips generation timing).")
    parser.add_argument("--gen-prompt", type=int, default=8, help="Prompt tokens of each generation (batch 1).")
    parser.add_argument("--gen-tokens", type=int, default=32, help="New tokens of each generation.")
    parser.add_argument(
        "--rounds", type=int, default=1, help="Timing passes over all variants; each pass uses new processes."
    )
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        help="Time the ratios use: process CPU time (default on CPU: robust to other jobs) or wall (default on GPU).",
    )
    parser.add_argument(
        "--allocator",
        choices=["default", "keep"],
        default="default",
        help="glibc in the timing processes: its default (hands freed memory back to the OS, so every step faults "
        "pages in again) or keep (freed memory is reused, as with jemalloc/tcmalloc or CUDA's caching allocator).",
    )
    parser.add_argument("--json", type=Path, help="Also write the results (and target checks) to this file.")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
    moe = args.model in MOE_MODELS
    if args.variants is None:
        args.variants = [name for name in VARIANTS if not (moe and name in DENSE_ONLY)]
    elif moe and (refused := [name for name in args.variants if name in DENSE_ONLY]):
        parser.error(
            f"--model {args.model} keeps its experts as 3-D parameters, which {', '.join(refused)} cannot adapt (they "
            "reach nn.Linear layers only, so they would tune attention alone): leave them out"
        )
    for key, default in asdict(MODEL_DEFAULTS[args.model]).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.warmup < 0 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup must be >= 0, --steps and --rounds >= 1")
    if args.gen_steps < 0 or args.gen_prompt < 1 or args.gen_tokens < 1:
        parser.error("--gen-steps must be >= 0, --gen-prompt and --gen-tokens >= 1")
    if args.clock is None:
        args.clock = "wall" if on_gpu(args.device) else "cpu"
    if "floor" not in args.variants:
        args.variants.insert(0, "floor")  # every ratio is to the floor
    return args


def on_gpu(device: str) -> bool:
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    specs = [
        RunSpec(
            model=args.model,
            variant=variant,
            batch=args.batch,
            seq_len=args.seq_len,
            warmup=args.warmup,
            steps=args.steps,
            infer_steps=args.infer_steps,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            quantize=args.quantize,
            allocator=args.allocator,
            optimizer=args.optimizer,
            gen_steps=args.gen_steps,
            gen_prompt=args.gen_prompt,
            gen_tokens=args.gen_tokens,
        )
        for variant in args.variants
    ]
    results = run_all(specs, args.rounds)
    checks = check_targets(results, args.clock)
    print(
        f"\nmodel={args.model} quantize={args.quantize} allocator={args.allocator} optimizer={args.optimizer} "
        f"batch={args.batch}x{args.seq_len} "
        f"dtype={args.dtype} "
        f"device={args.device} "
        f"threads={args.threads or torch.get_num_threads()} rounds={args.rounds} warmup={args.warmup} "
        f"steps={args.steps} infer_steps={args.infer_steps} "
        f"gen_steps={args.gen_steps} gen={args.gen_prompt}+{args.gen_tokens} tokens "
        f"torch={torch.__version__} machine={platform.machine()} "
        f"cpus={os.cpu_count()}\n"
    )
    print(format_table(results, args.clock))
    print()
    print(format_checks(checks))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "torch": torch.__version__,
            "machine": common.machine(torch.cuda.get_device_name() if on_gpu(args.device) else None),
            "results": [
                asdict(r) | {"accounted_bytes": r.accounted_bytes, "gen_tokens_per_s": r.tokens_per_s("wall")}
                for r in results
            ],
            "targets": checks,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return results


if __name__ == "__main__":
    main()
