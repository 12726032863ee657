"""The GPU arithmetic of one adapted layer's training step (forward and backward) in bf16, op by op, at an H100's
rates: each op takes the longest of its FLOPs at its unit's rate, its bytes at HBM's and its gathers at L2's. Bounds,
not predictions; docs/performance.md carries the tables (`python benchmarks/gpu_step.py --write-docs`, a spec checks
they are fresh), and gpu_step.py prices its own run with them.

The paths, as the code runs them:
* frozen: the forward GEMM and the input-gradient GEMM.
* NeuroAda (every path): the merged copy `W + Σ P ⊙ Θ` made in forward and again in backward; where k=1 reads at most
  `COMPACT_INPUT_MAX_SHARE` of the input (the plugin's placement cache), forward keeps only those columns.
* `gathered` (CUDA's default): the dense weight gradient as a bf16 GEMM with a float32 output, then the gather.
* `triton` (opt-in): token-major copies of x and the output gradient, then a kernel that multiplies on CUDA cores
  (not tensor cores) and reads, per entry, its input column and, per neuron, its gradient column through L2.
* LoRA as peft runs it: x cast to the adapters' dtype, A, B, the scaling, the sum with the base output and the cast
  back, and each one's backward, plus the two input gradients' sum. `lora-peft` has float32 adapters (peft's default on
  a bf16 base: autocast_adapter_dtype), `lora-bf16` bf16 adapters (no casts, GEMMs on tensor cores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import common  # noqa: F401  (this checkout's peft_neuroada first)

from peft_neuroada.budget import lora_rank_for_k
from peft_neuroada.layers import COMPACT_INPUT_MAX_SHARE

# An H100's, as read on this workplace's machine (the device's KINDS.md): a bf16 GEMM's rate and a device copy's
# bytes (read and written).
TENSOR_FLOPS, HBM_BYTES = 798e12, 3.0e12
# Not read there: CUDA cores' float32 FMA rate (the H100 SXM datasheet's) and L2's bandwidth (an assumption).
CUDA_FLOPS, L2_BYTES = 67e12, 5.5e12
BF16, FP32, INDEX, SECTOR = 2, 4, 4, 32
TOKENS = 16384  # a batch of 16 x 1024
# (d_in, d_out) of the projections people train, the most decisive first: Llama-3-8B's and Llama-3.2-1B's MLP up and
# down, and Llama-3-8B's query projection.
SHAPES = {
    "8b-up": (4096, 14336),
    "1b-up": (2048, 8192),
    "8b-down": (14336, 4096),
    "1b-down": (8192, 2048),
    "8b-q": (4096, 4096),
}
KS = (20, 1)
PATHS = ("frozen", "gathered", "triton", "lora-peft", "lora-bf16")


@dataclass(frozen=True)
class Op:
    name: str
    flops: float = 0.0
    moved: float = 0.0  # bytes read and written in HBM
    through_l2: float = 0.0  # bytes gathered through L2
    tensor_cores: bool = True

    @property
    def us(self) -> float:
        rate = TENSOR_FLOPS if self.tensor_cores else CUDA_FLOPS
        return max(self.flops / rate, self.moved / HBM_BYTES, self.through_l2 / L2_BYTES) * 1e6


def gemm(name: str, m: int, inner: int, n: int, operand: int = BF16, out: int = BF16) -> Op:
    """(m, inner) @ (inner, n): float32 operands run on CUDA cores (torch leaves TF32 off)."""
    moved = operand * (m * inner + inner * n) + out * m * n
    return Op(name, 2 * m * inner * n, moved, tensor_cores=operand == BF16)


def elementwise(name: str, elements: int, read: int, written: int) -> Op:
    return Op(name, moved=elements * (read + written))


def read_share(d_in: int, d_out: int, k: int) -> float:
    """The expected share of the input columns a placement reads, its columns drawn uniformly at random (normal
    weights come close)."""
    return 1 - math.exp(-d_out * k / d_in)


def kept_columns(d_in: int, d_out: int, k: int) -> int:
    """The input columns backward keeps: the read ones where the plugin's placement cache compacts them
    (`layers.with_read_columns`), else all."""
    share = read_share(d_in, d_out, k)
    return round(share * d_in) if d_out * k <= 2 * d_in and share <= COMPACT_INPUT_MAX_SHARE else d_in


def frozen_ops(tokens: int, d_in: int, d_out: int) -> list[Op]:
    return [gemm("forward GEMM", tokens, d_in, d_out), gemm("input-gradient GEMM", tokens, d_out, d_in)]


def neuroada_ops(tokens: int, d_in: int, d_out: int, k: int, path: str) -> list[Op]:
    entries, kept = d_out * k, kept_columns(d_in, d_out, k)
    # clone the weight; read, add to and write each entry, reading its float32 delta, its column and its neuron
    copy = Op("merged copy", moved=2 * BF16 * d_in * d_out + entries * (2 * BF16 + FP32 + 2 * INDEX))
    ops = frozen_ops(tokens, d_in, d_out) + [copy, copy]
    if kept < d_in:  # x's read columns, gathered row by row: every sector of x is read
        ops.append(Op("keep the read columns", moved=BF16 * tokens * (d_in + kept)))
    if path == "gathered":
        ops.append(gemm("deltas' gradient GEMM", d_out, tokens, kept, out=FP32))
        ops.append(Op("gather", moved=entries * (SECTOR + INDEX + FP32)))
    elif path == "triton":
        ops.append(elementwise("token-major x", tokens * kept, BF16, BF16))
        ops.append(elementwise("token-major gradient", tokens * d_out, BF16, BF16))
        gathered = BF16 * tokens * d_out * (k + 1)  # per entry its input column, per neuron its gradient column
        kernel = Op("sampled kernel", 2 * tokens * entries, BF16 * tokens * (kept + d_out), gathered, False)
        ops.append(kernel)
    else:
        raise ValueError(f"unknown NeuroAda path {path!r}")
    return ops


def lora_ops(tokens: int, d_in: int, d_out: int, rank: int, adapter: int) -> list[Op]:
    ops = frozen_ops(tokens, d_in, d_out)
    cast = adapter != BF16
    if cast:
        ops.append(elementwise("x to the adapters' dtype", tokens * d_in, BF16, adapter))
    ops += [
        gemm("A", tokens, d_in, rank, adapter, adapter),
        gemm("B", tokens, rank, d_out, adapter, adapter),
        elementwise("scaling", tokens * d_out, adapter, adapter),
    ]
    if cast:  # bf16 + float32 gives float32, then cast back
        ops += [Op("sum with the base", moved=tokens * d_out * (BF16 + 2 * adapter)),
                elementwise("sum to bf16", tokens * d_out, adapter, BF16),
                elementwise("backward: gradient to the adapters' dtype", tokens * d_out, BF16, adapter),
                elementwise("backward: gradient to the base's dtype", tokens * d_out, adapter, BF16)]  # fmt: skip
    else:
        ops.append(Op("sum with the base", moved=tokens * d_out * 3 * BF16))
    ops += [
        elementwise("backward: scaling", tokens * d_out, adapter, adapter),
        gemm("backward: B's input gradient", tokens, d_out, rank, adapter, adapter),
        gemm("backward: B's gradient", rank, tokens, d_out, adapter, adapter),
        gemm("backward: A's input gradient", tokens, rank, d_in, adapter, adapter),
        gemm("backward: A's gradient", rank, tokens, d_in, adapter, adapter),
    ]
    if cast:
        ops.append(elementwise("backward: x's gradient to bf16", tokens * d_in, adapter, BF16))
    ops.append(Op("backward: the two input gradients summed", moved=tokens * d_in * 3 * BF16))
    return ops


def path_ops(path: str, shape: str, k: int, tokens: int = TOKENS) -> list[Op]:
    d_in, d_out = SHAPES[shape]
    if path == "frozen":
        return frozen_ops(tokens, d_in, d_out)
    if path.startswith("lora"):
        rank = lora_rank_for_k([(d_out, d_in)], k)
        return lora_ops(tokens, d_in, d_out, rank, FP32 if path == "lora-peft" else BF16)
    return neuroada_ops(tokens, d_in, d_out, k, path)


def path_us(path: str, shape: str, k: int, tokens: int = TOKENS) -> float:
    return sum(op.us for op in path_ops(path, shape, k, tokens))


def unfused_floor_us(shape: str, k: int, tokens: int = TOKENS) -> float:
    """The least a step can cost that keeps the merged copy and computes the deltas' gradient in a pass of its own:
    the frozen layer, both copies, and one read of the kept input and of the output gradient."""
    d_in, d_out = SHAPES[shape]
    ops = [
        op
        for op in neuroada_ops(tokens, d_in, d_out, k, "gathered")
        if op.name not in ("deltas' gradient GEMM", "gather")
    ]
    return sum(op.us for op in ops) + BF16 * tokens * (kept_columns(d_in, d_out, k) + d_out) / HBM_BYTES * 1e6


def _span(values: list[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def summary(tokens: int = TOKENS) -> str:
    """What the table says of the targets, per path: the ranges over the shapes, and where NeuroAda is under LoRA."""
    ratio = {
        (path, shape, k): path_us(path, shape, k, tokens) / path_us("frozen", shape, k, tokens)
        for path in PATHS
        for shape in SHAPES
        for k in KS
    }

    def span(path: str, k: int | None = None) -> str:
        return _span([value for (p, _, kk), value in ratio.items() if p == path and k in (None, kk)])

    def under(path: str, lora: str) -> str:
        shapes = [shape for shape in SHAPES if ratio[(path, shape, 20)] <= ratio[(lora, shape, 20)]]
        return ", ".join(shapes) or "no shape"

    moved = [sum(op.moved for op in path_ops("lora-peft", shape, k, tokens)) / 1e9 for shape in SHAPES for k in KS]
    floor = [unfused_floor_us(shape, 1, tokens) / path_us("frozen", shape, 1, tokens) for shape in SHAPES]
    verdict = "reachable without fusing" if min(floor) <= 1.05 else "out of reach without a fused kernel"
    return (
        f"Over the frozen layer: gathered {span('gathered', 20)} at k=20 and {span('gathered', 1)} at k=1; Triton "
        f"{span('triton', 20)} at k=20 and {span('triton', 1)} at k=1; peft's LoRA as users run it "
        f"{span('lora-peft')} ({min(moved):.1f}-{max(moved):.1f} GB moved per call); LoRA with bf16 adapters "
        f"{span('lora-bf16')}. At k=20, "
        f"under peft's LoRA: gathered at {under('gathered', 'lora-peft')}, Triton at {under('triton', 'lora-peft')}; "
        f"under bf16-adapter LoRA: gathered at {under('gathered', 'lora-bf16')}, Triton at "
        f"{under('triton', 'lora-bf16')}. k=1's unfused floor is {_span(floor)}: 1.05x is {verdict}."
    )


def table(tokens: int = TOKENS) -> str:
    lines = [
        f"An H100's rates: {TENSOR_FLOPS / 1e12:.0f} TFLOP/s (bf16 GEMM) and {HBM_BYTES / 1e12:.1f} TB/s (device "
        f"copy), both read on this workplace's machine; {CUDA_FLOPS / 1e12:.0f} TFLOP/s on CUDA cores (float32, the "
        f"datasheet's) and {L2_BYTES / 1e12:.1f} TB/s from L2 (assumed). {tokens:,} tokens. Each path's step over the "
        "frozen layer's; `read` is the share of the input k=1's placement reads (columns at random), `kept` whether "
        "backward keeps only those; the unfused floor is the frozen layer, both merged copies and one read of the "
        "kept input and the output gradient, which any design pays that does not fuse the deltas' gradient into a "
        "GEMM.",
        "",
        summary(tokens),
        "",
        "| shape | k | frozen | read (kept) | gathered | Triton | peft's LoRA (rank, GB moved) | LoRA, bf16 "
        "adapters | unfused floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in KS:
        for shape, (d_in, d_out) in SHAPES.items():
            frozen = path_us("frozen", shape, k, tokens)
            ratio = {path: path_us(path, shape, k, tokens) / frozen for path in PATHS}
            peft_gb = sum(op.moved for op in path_ops("lora-peft", shape, k, tokens)) / 1e9
            rank = lora_rank_for_k([(d_out, d_in)], k)
            kept = "yes" if kept_columns(d_in, d_out, k) < d_in else "no"
            lines.append(
                f"| {shape} | {k} | {frozen:,.0f} us | {read_share(d_in, d_out, k):.2f} ({kept}) | "
                f"{ratio['gathered']:.2f} | {ratio['triton']:.2f} | {ratio['lora-peft']:.2f} ({rank}, "
                f"{peft_gb:.1f} GB) | {ratio['lora-bf16']:.2f} | {unfused_floor_us(shape, k, tokens) / frozen:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
