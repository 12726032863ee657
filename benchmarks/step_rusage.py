"""Page faults and CPU by kind (user, system) of a variant's training step and of its paired floor's, alternating as
train_cost.py alternates them: tells paging apart from compute when the paired and separate ratios disagree.

    python benchmarks/step_rusage.py neuroada-k20 neuroada-k1 --threads 2
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from contextlib import nullcontext

import common  # noqa: F401  (this checkout's peft_neuroada first)
from cost.measurement import MODEL_DEFAULTS, RunSpec, Session, as_floor


def usage() -> tuple[float, float, float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_minflt, own.ru_utime, own.ru_stime, time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="Timed steps per side, after one untimed pair.")
    args = parser.parse_args()
    defaults = MODEL_DEFAULTS[args.model]
    for variant in args.variants:
        spec = RunSpec(
            model=args.model,
            variant=variant,
            batch=defaults.batch,
            seq_len=defaults.seq_len,
            warmup=1,
            steps=args.steps,
            infer_steps=0,
            device="cpu",
            dtype="float32",
            threads=args.threads,
        )
        session = Session(spec)
        samples: dict[str, list[list[float]]] = {"variant": [], "paired floor": []}
        for step in range(args.steps + 1):
            for side, call in (("variant", session.step), ("paired floor", session.floor_step)):
                with as_floor(session.model) if side == "paired floor" else nullcontext():
                    before = usage()
                    call()
                    after = usage()
                if step:
                    samples[side].append([b - a for a, b in zip(before, after, strict=True)])
        for side, rows in samples.items():
            faults, user, system, wall = (statistics.median(column) for column in zip(*rows, strict=True))
            print(
                f"{variant} {side}: {faults:.0f} minor faults, "
                f"user {user:.2f} s, system {system:.2f} s, wall {wall:.2f} s"
            )


if __name__ == "__main__":
    main()
