"""The GPU training step against LoRA, decided on one device in a few minutes: writes docs/gpu/step.json.

    python benchmarks/gpu_step.py --out docs/gpu/step.json        # on a CUDA machine (gpu.sh's first step)
    python benchmarks/gpu_step.py --dry-run --out /tmp/step.json  # on the CPU at toy sizes (the suite runs this)
    python benchmarks/gpu_step.py --write-docs                    # its arithmetic and step.json's tables into docs

`layers`: one linear layer's forward and backward (its input gradient and the adapter's) in bf16 at the shapes people
train, at k=1 and k=20: the frozen layer, NeuroAda with each delta-gradient candidate (`gathered`, CUDA's default;
`sparse`, torch's sampled product, the CPU's; `triton`, the opt-in kernel), peft's LoRA at the rank of equal budget
(its adapters in float32, peft's default on a bf16 base) and LoRA with bf16 adapters. `steps`: a whole training step
(forward, backward, fused AdamW) of a random Llama-3.2-1B-shaped model in bf16, with its peak memory and how many
times it made the host wait for the device (`torch.cuda.set_sync_debug_mode`). `decoding`: a call without gradients
at 1-128 tokens on the merged copy and on the bypass, which decides the bypass's threshold (`BYPASS_MAX_TOKENS`,
measured on the CPU) on the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import common  # noqa: F401  (this checkout's peft_neuroada first)
import torch
from cost.variants import RANDOM_CONFIGS, budget_shapes, module_targets
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaForCausalLM

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.accel import sparse_products
from peft_neuroada.budget import lora_rank_for_k
from peft_neuroada.tuner import forward, merged_copy
from peft_neuroada.tuner.layer import NeuroAdaLayer

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE_DOC, STEP_FILE = ROOT / "docs" / "performance.md", ROOT / "docs" / "gpu" / "step.json"
# (d_in, d_out) of the projections people train: SmolLM2-135M's MLP up, Llama-3.2-1B's MLP up and down, Llama-3-8B's
# MLP up and down and its query projection.
SHAPES = {
    "135m-up": (576, 1536),
    "1b-up": (2048, 8192),
    "1b-down": (8192, 2048),
    "8b-up": (4096, 14336),
    "8b-down": (14336, 4096),
    "8b-q": (4096, 4096),
}
TOKENS = 16384  # a batch of 8 x 2048 or 16 x 1024
KS = (1, 20)
# Calls without gradients (decoding: one token per sequence) that decide the bypass's threshold on the device.
DECODE_SHAPES, DECODE_TOKENS = ("1b-up", "8b-up"), (1, 8, 32, 128)
STEP_MODEL, STEP_BATCH, STEP_SEQ = "llama-1b-random", 8, 1024
# Nominal H200 rates for the arithmetic (dense bf16 tensor-core FLOP/s, HBM and L2 bytes/s): bounds, not predictions.
PEAK_FLOPS, PEAK_BYTES, L2_BYTES = 989e12, 4.8e12, 10e12


class OneLayer(nn.Module):
    """A model of one linear layer named like a Llama MLP projection."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up_proj(x)


def delta_grad_candidates(device: torch.device) -> dict[str, Callable]:
    """The deltas' gradient products to time: both of the tuner's, and the Triton kernel where it runs."""
    candidates = {"gathered": forward.sampled_grad, "sparse": sparse_products.sampled_grad}
    if device.type == "cuda":
        from peft_neuroada.accel import triton_sampled_grad

        if triton_sampled_grad.available():
            candidates["triton"] = triton_sampled_grad.sampled_grad
    return candidates


def timed_ms(call: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of `call` after `warmup` untimed calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def layer_variants(d_in: int, d_out: int, k: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Each variant of one layer: its record fields, and what builds it (a model of one frozen layer in `dtype`, made
    on the device, with its adapter added as a user adds it: peft's own choice of the adapter's dtype)."""
    rank = lora_rank_for_k([(d_out, d_in)], k)

    def frozen() -> nn.Module:
        torch.manual_seed(0)
        with torch.device(device):
            return OneLayer(d_in, d_out).to(dtype).requires_grad_(False)

    def neuroada(product: Callable) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            model = get_peft_model(frozen(), NeuroAdaConfig(k=k, target_modules=["up_proj"]))
            for module in model.modules():
                if isinstance(module, NeuroAdaLayer):
                    module.kernels = module.kernels._replace(sampled_grad=product)
            return model

        return build

    def lora(bf16: bool) -> Callable[[], nn.Module]:
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["up_proj"])
        return lambda: get_peft_model(frozen(), config, autocast_adapter_dtype=not bf16)

    variants = {"frozen": ({"variant": "frozen"}, frozen)}
    for name, product in delta_grad_candidates(device).items():
        variants[f"neuroada-{name}"] = ({"variant": "neuroada", "delta_grad": name}, neuroada(product))
    for name, bf16 in (("lora-peft", False), ("lora-bf16", True)):
        variants[name] = ({"variant": name, "budget_of_k": k, "rank": rank}, lora(bf16))
    return variants


def time_layers(shapes: dict, tokens: int, device: torch.device, dtype: torch.dtype, repeats: int) -> list[dict]:
    records = []
    for shape, (d_in, d_out) in shapes.items():
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, d_in, generator=generator).to(device, dtype).requires_grad_(True)
        grad_y = torch.randn(tokens, d_out, generator=generator).to(device, dtype)
        for k in KS:
            for fields, build in layer_variants(d_in, d_out, k, device, dtype).values():
                model = build().train()

                def fwd_bwd(model: nn.Module = model, x: torch.Tensor = x, grad_y: torch.Tensor = grad_y) -> None:
                    x.grad = None
                    model.zero_grad(set_to_none=True)
                    model(x).backward(grad_y)

                record = {"shape": shape, "d_in": d_in, "d_out": d_out, "tokens": tokens, "k": k, **fields}
                record["fwd_bwd_ms"] = round(timed_ms(fwd_bwd, device, 3, repeats), 4)
                records.append(record)
                del model
                _release(device)
    return records


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_decoding(shapes: dict, device: torch.device, dtype: torch.dtype, repeats: int) -> list[dict]:
    """A no-grad call of one adapted layer at few tokens, on the merged copy and on the bypass (the tuner's threshold,
    `merged_copy.BYPASS_MAX_TOKENS`, measured on the CPU, set to send every call one way): where the two cross."""
    records, threshold = [], merged_copy.BYPASS_MAX_TOKENS
    for shape, (d_in, d_out) in shapes.items():
        for k in KS:
            model = layer_variants(d_in, d_out, k, device, dtype)["neuroada-gathered"][1]().eval()
            for tokens in DECODE_TOKENS:
                x = torch.randn(tokens, d_in, generator=torch.Generator().manual_seed(0)).to(device, dtype)
                for path, bypass_below in (("copy", 0), ("bypass", tokens)):
                    merged_copy.BYPASS_MAX_TOKENS = bypass_below
                    try:
                        with torch.no_grad():
                            ms = timed_ms(lambda model=model, x=x: model(x), device, 3, repeats)
                    finally:
                        merged_copy.BYPASS_MAX_TOKENS = threshold
                    record = {"shape": shape, "d_in": d_in, "d_out": d_out, "k": k, "tokens": tokens, "path": path}
                    records.append({**record, "ms": round(ms, 4)})
            del model
            _release(device)
    return records


def step_model(name: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A random model of `name`'s config, made on the device (seconds, where the CPU would take a minute)."""
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(RANDOM_CONFIGS[name]).to(dtype)


def step_setup(variant: str, model: nn.Module) -> nn.Module:
    if variant == "frozen":
        model.requires_grad_(False)
        model.enable_input_require_grads()
        return model
    family, k = re.fullmatch(r"(neuroada|lora-budget)-k(\d+)", variant).groups()
    targets = module_targets(model)
    if family == "neuroada":
        return get_peft_model(model, NeuroAdaConfig(k=int(k), target_modules=targets))
    rank = lora_rank_for_k(budget_shapes(model, int(k)), int(k))
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets))


def syncs_in(call: Callable[[], None]) -> int:
    """How many times `call` made the host wait for the GPU (torch's sync debug mode, set to warn)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def time_steps(name: str, batch: int, seq: int, device: torch.device, dtype: torch.dtype, repeats: int) -> list:
    records = []
    for variant in ("frozen", "neuroada-k1", "neuroada-k20", "lora-budget-k1", "lora-budget-k20"):
        model = step_setup(variant, step_model(name, device, dtype)).train()
        params = [p for p in model.parameters() if p.requires_grad]
        fused = device.type == "cuda"
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=fused) if params else None
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)

        def step(model: nn.Module = model, optimizer: torch.optim.Optimizer | None = optimizer, ids=ids) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step_s = timed_ms(step, device, 2, repeats) / 1e3
        record = {"model": name, "batch": batch, "seq": seq, "variant": variant}
        record["trainable"] = sum(p.numel() for p in params)
        record["step_s"] = round(step_s, 5)
        # the timed steps' peak, the model's weights included
        record["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20) if device.type == "cuda" else None
        record["syncs"] = syncs_in(step) if device.type == "cuda" else None
        records.append(record)
        del model, optimizer, params
        _release(device)
    return records


def commit() -> str:
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        return run.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"


def summary(report: dict) -> str:
    """The figures the targets read, as markdown: each layer variant over the frozen layer and over peft's LoRA."""
    lines = ["| shape | k | variant | ms | / frozen | / lora-peft |", "|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in report["layers"]):
        for k in KS:
            rows = [r for r in report["layers"] if r["shape"] == shape and r["k"] == k]
            base = {r["variant"]: r["fwd_bwd_ms"] for r in rows if r["variant"] in ("frozen", "lora-peft")}
            for r in rows:
                name = r["variant"] + (f" ({r['delta_grad']})" if "delta_grad" in r else "")
                ms = r["fwd_bwd_ms"]
                lines.append(f"| {shape} | {k} | {name} | {ms:.3f} | {ms / base['frozen']:.2f} | "
                             f"{ms / base['lora-peft']:.2f} |")  # fmt: skip
    lines += ["", "| shape | k | tokens | copy ms | bypass ms |", "|---|---|---|---|---|"]
    decoding = {(r["shape"], r["k"], r["tokens"], r["path"]): r["ms"] for r in report.get("decoding", [])}
    for shape, k, tokens, path in decoding:
        if path == "copy":
            bypass = decoding[(shape, k, tokens, "bypass")]
            lines.append(f"| {shape} | {k} | {tokens} | {decoding[(shape, k, tokens, path)]:.3f} | {bypass:.3f} |")
    lines += ["", "| model | variant | trainable | step s | peak MiB | syncs |", "|---|---|---|---|---|---|"]
    for r in report["steps"]:
        lines.append(f"| {r['model']} | {r['variant']} | {r['trainable']:,} | {r['step_s']:.4f} | {r['peak_mib']} | "
                     f"{r['syncs']} |")  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ arithmetic


def arithmetic_table(tokens: int = TOKENS) -> str:
    """Per op of one adapted layer's training step in bf16, the time its FLOPs or its bytes take at nominal H200 rates
    (the larger), for each shape at k=20 and k=1; then each path's step over the frozen layer's (two GEMMs)."""
    lines = [
        f"Nominal rates: {PEAK_FLOPS / 1e12:.0f} TFLOP/s (dense bf16), {PEAK_BYTES / 1e12:.1f} TB/s from HBM, and "
        f"an assumed {L2_BYTES / 1e12:.0f} TB/s from L2 (no published figure); {tokens:,} tokens. The sampled product "
        "is given twice: reading x and the output gradient once from HBM (its floor), and gathering, per entry, its "
        "input column and, per neuron, its gradient column through L2 (what a kernel without reuse between entries "
        "pays).",
        "",
        "| shape | k | one GEMM | merged copy | gathered grad | sampled grad, floor - L2 | LoRA (rank) | "
        "gathered / frozen | sampled / frozen | LoRA / frozen |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, (d_in, d_out) in SHAPES.items():
        for k in KS[::-1]:
            rank = lora_rank_for_k([(d_out, d_in)], k)
            gemm = _op_us(2 * tokens * d_in * d_out, 2 * (tokens * (d_in + d_out) + d_in * d_out))
            # read the weight, write the copy; read and write the entries, read the deltas and their positions
            copy = _op_us(d_out * k, 2 * 2 * d_in * d_out + d_out * k * (2 + 2 + 4 + 4))
            gathered = gemm + _op_us(0, 2 * 4 * d_in * d_out)  # then its float32 result written and read
            floor = _op_us(2 * tokens * d_out * k, 2 * tokens * (d_in + d_out))
            through_l2 = max(floor, 2 * tokens * d_out * (k + 1) * 2 / L2_BYTES * 1e6)
            # LoRA: per factor a GEMM in forward, input and weight gradient, each reading x or the output gradient
            lora = _op_us(6 * tokens * rank * (d_in + d_out), 2 * 3 * tokens * (d_in + d_out) + 2 * 6 * tokens * rank)
            frozen, copies = 2 * gemm, 2 * copy
            lines.append(
                f"| {shape} | {k} | {gemm:,.0f} us | {copy:,.0f} us | {gathered:,.0f} us | "
                f"{floor:,.0f} - {through_l2:,.0f} us | {lora:,.0f} us ({rank}) | "
                f"{(frozen + copies + gathered) / frozen:.2f} | {(frozen + copies + floor) / frozen:.2f} - "
                f"{(frozen + copies + through_l2) / frozen:.2f} | {(frozen + lora) / frozen:.2f} |"
            )
    return "\n".join(lines)


def _op_us(flops: float, moved: float) -> float:
    return max(flops / PEAK_FLOPS, moved / PEAK_BYTES) * 1e6


def with_generated(doc: str, report: dict | None) -> str:
    """`doc` with its blocks marked `<!-- gpu_step:arithmetic -->` and `<!-- gpu_step:tables -->` replaced by today's
    arithmetic and by `report`'s tables (docs/gpu/step.json; None: not measured yet)."""
    tables = "No device has run `gpu_step.py` yet: docs/gpu/step.json is not there."
    if report:
        machine = f"{report['device']}, torch {report['torch']}, {report['dtype']}, commit {report['commit'][:7]}"
        tables = f"{machine}:\n\n{summary(report)}"
    for name, text in (("arithmetic", arithmetic_table()), ("tables", tables)):
        pattern = re.compile(rf"(<!-- gpu_step:{name} -->\n).*?(<!-- /gpu_step:{name} -->)", re.DOTALL)
        if len(pattern.findall(doc)) != 1:
            raise ValueError(f"{PERFORMANCE_DOC.name} has no single block marked gpu_step:{name}")
        doc = pattern.sub(lambda m, text=text: f"{m[1]}{text}\n{m[2]}", doc)
    return doc


def committed_report() -> dict | None:
    return json.loads(STEP_FILE.read_text()) if STEP_FILE.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, help="Where the JSON goes (docs/gpu/step.json on a GPU).")
    parser.add_argument("--dry-run", action="store_true", help="On the CPU at toy sizes: the suite's check.")
    parser.add_argument("--repeats", type=int, default=10, help="Timed calls per layer variant (steps: half).")
    parser.add_argument("--commit", default=None, help="The commit measured (default: the checkout's HEAD).")
    parser.add_argument("--arithmetic", action="store_true", help="Print the bytes-and-FLOPs table instead.")
    parser.add_argument(
        "--write-docs", action="store_true", help="Write the arithmetic and docs/gpu/step.json's tables into docs."
    )
    args = parser.parse_args()
    if args.arithmetic or args.write_docs:
        if args.write_docs:
            PERFORMANCE_DOC.write_text(with_generated(PERFORMANCE_DOC.read_text(), committed_report()))
        print(arithmetic_table())
        return
    if args.out is None:
        parser.error("--out is required (or --arithmetic)")
    if args.dry_run:
        device, dtype, repeats = torch.device("cpu"), torch.float32, 1
        shapes = {name: (max(1, d_in // 128), d_out // 128) for name, (d_in, d_out) in SHAPES.items()}
        layers = time_layers(shapes, 24, device, dtype, repeats)
        decoding = time_decoding({name: shapes[name] for name in DECODE_SHAPES}, device, dtype, repeats)
        steps = time_steps("tiny", 1, 16, device, dtype, repeats)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run with --dry-run on the CPU")
        device, dtype, repeats = torch.device("cuda"), torch.bfloat16, args.repeats
        layers = time_layers(SHAPES, TOKENS, device, dtype, repeats)
        decoding = time_decoding({name: SHAPES[name] for name in DECODE_SHAPES}, device, dtype, repeats)
        steps = time_steps(STEP_MODEL, STEP_BATCH, STEP_SEQ, device, dtype, max(2, repeats // 2))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    report = {"device": name, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
              "commit": args.commit or commit(), "layers": layers, "steps": steps, "decoding": decoding}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(summary(report))


if __name__ == "__main__":
    main()
