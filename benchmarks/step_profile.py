"""Where one variant's training step spends its time, op by op: torch.profiler's table of one step of train_cost.

    python benchmarks/step_profile.py --model smollm2 --variant neuroada-k1 --dtype bfloat16 --quantize nf4

The step is train_cost's (same model, batch, variant and optimizer), profiled after warmup. NeuroAda's own work shows
as `MergedCopyLinear` / `MergedCopyLinearBackward` on float bases (the merged copy: one matmul on W + P⊙Θ) and as
`SparseBypass` / `SparseBypassBackward` on quantized ones (the bypass beside the base layer's own forward, its sparse
products inside them); compare a variant's table with the floor's to see what it adds.
"""

from __future__ import annotations

import argparse
import dataclasses

import common  # noqa: F401  (this checkout's peft_neuroada first)
import torch
from cost.measurement import MODEL_DEFAULTS, RunSpec, Session
from cost.variants import VARIANTS
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.profiler import ProfilerActivity, profile
from train_cost import add_step_options


def profiled_step(spec: RunSpec) -> tuple[Session, profile]:
    """One training step after `spec.warmup` steps, under the profiler."""
    session = Session(spec)
    for _ in range(spec.warmup):
        session.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if session.on_cuda else [])
    with profile(activities=activities) as profiler:
        session.step()
        session.sync()
    return session, profiler


def operators_called(profiler: profile) -> int:
    """How many ATen operators a profiled step called from Python or autograd, not counting those called by others:
    each a dispatch, and on a GPU a kernel launch or more (what a host-bound step pays for)."""
    return sum(
        event.name.startswith("aten::")
        and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))
        for event in profiler.events()
    )


def operators_per_layer(spec: RunSpec) -> float:
    """ATen operators a step of `spec.variant` calls per adapted layer beyond the frozen floor's step."""
    session, profiler = profiled_step(spec)
    layers = sum(isinstance(module, BaseTunerLayer) for module in session.model.modules())
    _, floor = profiled_step(dataclasses.replace(spec, variant="floor"))
    return (operators_called(profiler) - operators_called(floor)) / layers


def profile_step(spec: RunSpec, rows: int) -> str:
    """The profiler's table of one training step after `spec.warmup` steps, sorted by self time, and how many ATen
    operators the step called (`operators_called`)."""
    session, profiler = profiled_step(spec)
    calls = operators_called(profiler)
    sort_by = "self_cuda_time_total" if session.on_cuda else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)
    return f"ATen operators called (not counting those called by others): {calls:,}\n{table}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_step_options(parser)
    parser.add_argument("--variant", choices=list(VARIANTS), default="neuroada-k1")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed training steps before the profiled one.")
    parser.add_argument("--rows", type=int, default=25, help="Ops listed.")
    parser.add_argument(
        "--per-layer",
        nargs="+",
        metavar="VARIANT",
        help="Instead of the table: ATen operators per adapted layer beyond the floor's, for each variant named.",
    )
    args = parser.parse_args()
    defaults = MODEL_DEFAULTS[args.model]
    spec = RunSpec(
        model=args.model,
        variant=args.variant,
        batch=args.batch or defaults.batch,
        seq_len=args.seq_len or defaults.seq_len,
        warmup=args.warmup,
        steps=1,
        infer_steps=0,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        quantize=args.quantize,
        optimizer=args.optimizer,
    )
    print(f"{spec}\ntorch {torch.__version__}\n")
    if args.per_layer:
        for variant in args.per_layer:
            count = operators_per_layer(dataclasses.replace(spec, variant=variant))
            print(f"ATen operators per adapted layer beyond the floor, {variant}: {count:.1f}")
        return
    print(profile_step(spec, args.rows))


if __name__ == "__main__":
    main()
