"""The GPU training path against LoRA, measured on one device in a few minutes: JSON lines into docs/gpu/step.jsonl.

    python3 benchmarks/gpu_step.py --out OUT/step.jsonl            # on a CUDA machine (gpu.sh's `step`)
    python3 benchmarks/gpu_step.py --dry-run --out /tmp/step.jsonl  # on the CPU at toy sizes (the suite runs this)
    python3 benchmarks/gpu_step.py --write-docs                     # arithmetic, time on paper, tables into docs

Each figure is one line, appended and flushed as it is measured: a run stopped by its time limit or an exception
keeps every figure before it, and the report (`read_report`) is built from the lines. The sections, in this order,
the most decisive first:

`versions`: the machine and the software. `layers`: one linear layer's forward and backward in bf16 at the 8B and 1B
shapes (`gpu_arithmetic.SHAPES`), k=20 then k=1: the frozen layer, NeuroAda with each delta-gradient candidate
(`gathered`, CUDA's default; `triton`, the opt-in kernel; on the CPU `sparse`, its own), peft's LoRA at the rank of
equal budget as users run it (float32 adapters, peft's default on a bf16 base) and LoRA with bf16 adapters. `steps`: a
whole training step (forward, backward, fused AdamW) of a random Llama-3.2-1B-shaped model, 8 x 1024 tokens (16 x 1024
on a card of 100 GiB or more), with its peak memory, how many times it made the host wait for the device
(`torch.cuda.set_sync_debug_mode`) and how many layers kept only the input columns they read. `parts`: each GEMM and
copy of a step on its own, and the sampled kernel at three spreads of the weights' columns. `decoding`: a call without
gradients at 1-128 tokens on the merged copy and on the bypass (the bypass's threshold, `BYPASS_MAX_TOKENS`).

Every time is the median of the timed calls (CUDA events on a GPU) and, beside it, the host's time to issue one call:
where the two are close, the call is bound by launches, not by the device. The weights are normal(0, 0.02) with a
log-normal gain per input column (`weights`), as trained models' columns spread: nn.Linear's uniform init, cast to
bf16, ties at the k-th value in most rows and piles the selection onto low columns.
"""

from __future__ import annotations

import argparse
import functools
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
import gpu_arithmetic as arithmetic
import gpu_versions
import torch
import torch.nn.functional as F
from cost.variants import RANDOM_CONFIGS, budget_shapes, module_targets
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaForCausalLM

from peft_neuroada import NeuroAdaConfig, merged_copy
from peft_neuroada.accel import sparse_products
from peft_neuroada.budget import lora_rank_for_k
from peft_neuroada.tuner import forward
from peft_neuroada.tuner.forward import Placement
from peft_neuroada.tuner.layer import NeuroAdaLayer
from peft_neuroada.tuner.selection import select_inputs

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE_DOC, STEP_FILE = ROOT / "docs" / "performance.md", ROOT / "docs" / "gpu" / "step.jsonl"
SHAPES, KS, TOKENS = arithmetic.SHAPES, arithmetic.KS, arithmetic.TOKENS
SPREAD, SPREADS = 0.1, (0.0, 0.1, 0.3)  # σ of the columns' log gain: SmolLM2's, and plain normal to heavy outliers
WARMUP, REPEATS = 3, 10
# Calls without gradients (decoding: one token per sequence) that decide the bypass's threshold on the device.
DECODE_SHAPES, DECODE_TOKENS = ("1b-up", "8b-up"), (1, 8, 32, 128)
STEP_MODEL, STEP_SEQ = "llama-1b-random", 1024
STEP_VARIANTS = ("frozen", "neuroada-k1", "neuroada-k20", "lora-budget-k1", "lora-budget-k20")
LARGE_CARD_GIB = 100  # an H200's 139 GiB takes 16 x 1024 tokens; an H100's 78 GiB, 8 x 1024


class Lines:
    """The run's JSON lines file: one line per figure, flushed as it is written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("w")

    def __call__(self, section: str, **record) -> None:
        self.file.write(json.dumps({"section": section, **record}) + "\n")
        self.file.flush()


def read_report(path: Path) -> dict:
    """The lines as one report: `versions` (the first line's) and each section's records, in the order measured."""
    report = {"versions": {}, "layers": [], "steps": [], "parts": [], "decoding": []}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        section = record.pop("section")
        if section == "versions":
            report["versions"] = record
        else:
            report[section].append(record)
    return report


def weights(d_out: int, d_in: int, spread: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """normal(0, 0.02), each input column scaled by exp(spread * normal): 0.1 spreads as SmolLM2's weights do, 0.3 is
    a heavy-outlier case. Drawn on the device (a billion normals take seconds on a CPU)."""
    generator = torch.Generator(device).manual_seed(0)
    gain = (spread * torch.randn(d_in, generator=generator, device=device)).exp()
    return (0.02 * torch.randn(d_out, d_in, generator=generator, device=device) * gain).to(dtype)


def activations(tokens: int, width: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator(device).manual_seed(seed)
    return torch.randn(tokens, width, generator=generator, device=device).to(dtype)


def timed(call: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> dict:
    """Median milliseconds of `call` after `warmup` untimed calls (CUDA events on a GPU), and the host's time to issue
    it: at small shapes a GPU call is bound by its launches."""
    for _ in range(warmup):
        call()
    times, issued = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        call()
        issued.append((time.perf_counter() - began) * 1e3)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append(issued[-1])
    return {"ms": round(statistics.median(times), 4), "issue_ms": round(statistics.median(issued), 4)}


class OneLayer(nn.Module):
    """A model of one frozen linear layer named like a Llama MLP projection, holding `weight`."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.up_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.up_proj.weight = nn.Parameter(weight.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up_proj(x)


def delta_grad_candidates(device: torch.device) -> dict[str, Callable]:
    """The deltas' gradient products to time: the tuner's, and the Triton kernel on CUDA (where the plugin's sparse
    products would take the tuner's path again) or the plugin's sparse products on the CPU."""
    candidates = {"gathered": forward.sampled_grad}
    if device.type != "cuda":
        candidates["sparse"] = sparse_products.sampled_grad
    else:
        from peft_neuroada.accel import triton_sampled_grad

        if triton_sampled_grad.available():
            candidates["triton"] = triton_sampled_grad.sampled_grad
    return candidates


def layer_variants(weight: torch.Tensor, k: int, device: torch.device) -> dict:
    """Each variant of one layer: its record fields, and what builds it (the frozen layer with its adapter added as a
    user adds it: peft's own choice of the adapter's dtype)."""
    rank = lora_rank_for_k([tuple(weight.shape)], k)

    def neuroada(product: Callable) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            model = get_peft_model(OneLayer(weight), NeuroAdaConfig(k=k, target_modules=["up_proj"]))
            for module in model.modules():
                if isinstance(module, NeuroAdaLayer):
                    module.kernels = module.kernels._replace(sampled_grad=product)
            return model

        return build

    def lora(bf16: bool) -> Callable[[], nn.Module]:
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["up_proj"])
        return lambda: get_peft_model(OneLayer(weight), config, autocast_adapter_dtype=not bf16)

    variants = {"frozen": ({"variant": "frozen"}, lambda: OneLayer(weight))}
    for name, product in delta_grad_candidates(device).items():
        variants[f"neuroada-{name}"] = ({"variant": "neuroada", "delta_grad": name}, neuroada(product))
    for name, bf16 in (("lora-peft", False), ("lora-bf16", True)):
        variants[name] = ({"variant": name, "budget_of_k": k, "rank": rank}, lora(bf16))
    return variants


def compacted_layers(model: nn.Module) -> int:
    """How many NeuroAda layers keep only the input columns their deltas read (the plugin's placement cache)."""
    kept = [getattr(m.placements, "kept", {}).values() for m in model.modules() if isinstance(m, NeuroAdaLayer)]
    return sum(any(entry[3].read is not None for entry in entries) for entries in kept)


def time_layers(shapes: dict, tokens: int, device: torch.device, dtype: torch.dtype, timing: tuple, lines) -> None:
    for k in KS:
        for shape, (d_in, d_out) in shapes.items():
            weight = weights(d_out, d_in, SPREAD, device, dtype)
            x = activations(tokens, d_in, 1, device, dtype).requires_grad_(True)
            grad_y = activations(tokens, d_out, 2, device, dtype)
            for fields, build in layer_variants(weight, k, device).values():
                model = build().train()

                def fwd_bwd(model: nn.Module = model, x: torch.Tensor = x, grad_y: torch.Tensor = grad_y) -> None:
                    x.grad = None
                    model.zero_grad(set_to_none=True)
                    model(x).backward(grad_y)

                record = {"shape": shape, "d_in": d_in, "d_out": d_out, "tokens": tokens, "k": k, "spread": SPREAD}
                record.update(fields, **timed(fwd_bwd, device, *timing))
                if fields["variant"] == "neuroada":
                    record["compacted"] = compacted_layers(model) == 1
                lines("layers", **record)
                del model
                _release(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_parts(shapes: dict, tokens: int, device: torch.device, dtype: torch.dtype, timing: tuple, lines) -> None:
    """Each GEMM and copy of one NeuroAda layer's step on its own, and the deltas' gradient candidates other than the
    gathered GEMM on token-major inputs at each spread of the weights (selection, and so L2's reuse, follows it)."""
    kernels = {name: kernel for name, kernel in delta_grad_candidates(device).items() if name != "gathered"}
    for k in KS:
        for shape, (d_in, d_out) in shapes.items():
            weight = weights(d_out, d_in, SPREAD, device, dtype)
            x, grad = activations(tokens, d_in, 1, device, dtype), activations(tokens, d_out, 2, device, dtype)
            placement = Placement(select_inputs(weight, k)).prepared()
            record = {"shape": shape, "d_in": d_in, "d_out": d_out, "tokens": tokens, "k": k}
            for part, call in _part_calls(weight, placement, x, grad).items():
                lines("parts", **record, part=part, spread=SPREAD, **timed(call, device, *timing))
            x_major, grad_major = sparse_products.token_major(x), sparse_products.token_major(grad)
            for spread in SPREADS:
                cols = select_inputs(weights(d_out, d_in, spread, device, dtype), k)
                share = round(cols.unique().numel() / d_in, 4)
                for name, kernel in kernels.items():
                    call = functools.partial(kernel, x_major, grad_major, cols, None)
                    figures = timed(call, device, *timing)
                    lines("parts", **record, part=f"{name} kernel", spread=spread, read_share=share, **figures)
            _release(device)


def _part_calls(weight: torch.Tensor, placement: Placement, x: torch.Tensor, grad: torch.Tensor) -> dict:
    deltas = torch.zeros(placement.cols.shape, device=weight.device)
    return {
        "forward GEMM": lambda: F.linear(x, weight),
        "input-gradient GEMM": lambda: grad @ weight,
        "merged copy": lambda: forward.merged_copy(weight, [placement], [deltas]),
        "gathered deltas' gradient": lambda: forward.sampled_grad(x, grad, placement.cols, None),
        "token-major x": lambda: sparse_products.token_major(x),
        "token-major gradient": lambda: sparse_products.token_major(grad),
    }


def time_decoding(shapes: dict, device: torch.device, dtype: torch.dtype, timing: tuple, lines) -> None:
    """A no-grad call of one adapted layer at few tokens, on the merged copy and on the bypass (the tuner's threshold,
    `merged_copy.BYPASS_MAX_TOKENS`, measured on the CPU, set to send every call one way): where the two cross."""
    threshold = merged_copy.BYPASS_MAX_TOKENS
    for shape, (d_in, d_out) in shapes.items():
        weight = weights(d_out, d_in, SPREAD, device, dtype)
        for k in KS:
            model = layer_variants(weight, k, device)["neuroada-gathered"][1]().eval()
            for tokens in DECODE_TOKENS:
                x = activations(tokens, d_in, 1, device, dtype)
                for path, bypass_below in (("copy", 0), ("bypass", tokens)):
                    merged_copy.BYPASS_MAX_TOKENS = bypass_below
                    try:
                        with torch.no_grad():
                            figures = timed(lambda model=model, x=x: model(x), device, *timing)
                    finally:
                        merged_copy.BYPASS_MAX_TOKENS = threshold
                    record = {"shape": shape, "d_in": d_in, "d_out": d_out, "k": k, "tokens": tokens, "path": path}
                    lines("decoding", **record, **figures)
            del model
            _release(device)


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


def step_batch(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return 16 if torch.cuda.get_device_properties(device).total_memory >= LARGE_CARD_GIB * 2**30 else 8


def time_steps(name: str, seq: int, device: torch.device, dtype: torch.dtype, timing: tuple, lines) -> None:
    batch, cuda = step_batch(device), device.type == "cuda"
    for variant in STEP_VARIANTS:
        model = step_setup(variant, step_model(name, device, dtype)).train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=cuda) if params else None
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)

        def step(model: nn.Module = model, optimizer: torch.optim.Optimizer | None = optimizer, ids=ids) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        figures = timed(step, device, *timing)
        record = {"model": name, "batch": batch, "seq": seq, "variant": variant, **figures}
        record["trainable"] = sum(p.numel() for p in params)
        # the timed steps' peak, the model's weights included
        record["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None
        record["syncs"] = syncs_in(step) if cuda else None
        record["compacted_layers"] = compacted_layers(model)
        lines("steps", **record)
        del model, optimizer, params
        _release(device)


def commit() -> str:
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        return run.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"


# ------------------------------------------------------------------------------------------------ tables


def summary(report: dict) -> str:
    """The figures the targets read, as markdown: each layer variant over the frozen layer and over both LoRAs."""
    lines = ["| shape | k | variant | ms | issue ms | / frozen | / peft's LoRA | / bf16 LoRA |", "|" + "---|" * 8]
    for k in KS:
        for shape in dict.fromkeys(r["shape"] for r in report["layers"]):
            rows = [r for r in report["layers"] if r["shape"] == shape and r["k"] == k]
            base = {r["variant"]: r["ms"] for r in rows}
            for r in rows:
                name = r["variant"] + (f" ({r['delta_grad']})" if "delta_grad" in r else "")
                ratios = [
                    f"{r['ms'] / base[of]:.2f}" if of in base else "-" for of in ("frozen", "lora-peft", "lora-bf16")
                ]
                lines.append(
                    f"| {shape} | {k} | {name} | {r['ms']:.3f} | {r['issue_ms']:.3f} | {' | '.join(ratios)} |"
                )
    lines += ["", "| model | batch | variant | trainable | step s | issue s | peak MiB | syncs | compacted |"]
    lines.append("|" + "---|" * 9)
    for r in report["steps"]:
        lines.append(f"| {r['model']} | {r['batch']} x {r['seq']} | {r['variant']} | {r['trainable']:,} | "
                     f"{r['ms'] / 1e3:.4f} | {r['issue_ms'] / 1e3:.4f} | {r['peak_mib']} | {r['syncs']} | "
                     f"{r['compacted_layers']} |")  # fmt: skip
    lines += ["", "| shape | k | part | spread (read share) | ms | issue ms |", "|" + "---|" * 6]
    for r in report["parts"]:
        share = f" ({r['read_share']:.2f})" if "read_share" in r else ""
        lines.append(f"| {r['shape']} | {r['k']} | {r['part']} | {r['spread']}{share} | {r['ms']:.3f} | "
                     f"{r['issue_ms']:.3f} |")  # fmt: skip
    lines += ["", "| shape | k | tokens | copy ms | bypass ms |", "|" + "---|" * 5]
    decoding = {(r["shape"], r["k"], r["tokens"], r["path"]): r["ms"] for r in report["decoding"]}
    for shape, k, tokens, path in decoding:
        if path == "copy" and (bypass := decoding.get((shape, k, tokens, "bypass"))) is not None:
            lines.append(f"| {shape} | {k} | {tokens} | {decoding[(shape, k, tokens, path)]:.3f} | {bypass:.3f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ time on paper

# What the arithmetic does not price, each an assumption: installing the carried peft wheel, gpu.sh's versions and
# the plugin's import (two interpreters), gpu_step.py's start and imports, building one adapted layer (selection on the
# device, peft's injection), drawing a shape's weights and activations, building a random 1B model on the device,
# Triton compiling its kernel, a 1B step at this share of the GEMM rate, and the two CUDA spec files (torch.compile's
# and a CUDA graph's specs among them).
INSTALL_S, PROBE_S, START_S, BUILD_S, DRAW_S, MODEL_S, JIT_S, STEP_EFFICIENCY, SPECS_S = (
    5,
    15,
    15,
    0.5,
    0.5,
    8,
    10,
    0.4,
    90,
)


def run_seconds(batch: int = 8) -> dict[str, float]:
    """The device run's seconds on paper, per part: each timed call at its arithmetic time, plus the fixed costs."""
    calls = WARMUP + REPEATS
    paths = {"frozen": "frozen", "neuroada-gathered": "gathered", "neuroada-triton": "triton"}
    paths |= {"lora-peft": "lora-peft", "lora-bf16": "lora-bf16"}
    pairs = [(shape, k) for k in KS for shape in SHAPES]
    layers = sum(calls * arithmetic.path_us(path, s, k) / 1e6 + BUILD_S for s, k in pairs for path in paths.values())
    config = RANDOM_CONFIGS[STEP_MODEL]
    parameters = config.vocab_size * config.hidden_size + config.num_hidden_layers * (
        2 * config.hidden_size**2 * (1 + config.num_key_value_heads / config.num_attention_heads)
        + 3 * config.hidden_size * config.intermediate_size
    )
    step_s = 6 * parameters * batch * STEP_SEQ / (arithmetic.TENSOR_FLOPS * STEP_EFFICIENCY)
    steps = len(STEP_VARIANTS) * ((calls + 1) * step_s + MODEL_S)  # the timed steps and the one counting syncs
    parts = sum(calls * _parts_s(*pair) + 4 * DRAW_S for pair in pairs)  # a shape's data, and 3 spreads' weights
    decoding = len(DECODE_SHAPES) * len(KS) * (BUILD_S + len(DECODE_TOKENS) * 2 * calls * 1e-3)
    return {
        "peft wheel, versions and the plugin's import": INSTALL_S + PROBE_S,
        "gpu_step.py's start and imports": START_S,
        f"layers ({len(pairs) * len(paths)} variants)": layers + len(SHAPES) * len(KS) * DRAW_S + JIT_S,
        f"steps ({len(STEP_VARIANTS)} variants, {batch} x {STEP_SEQ})": steps,
        "parts": parts,
        "decoding": decoding,
        "CUDA spec files": SPECS_S,
    }


def _parts_s(shape: str, k: int) -> float:
    """One call of each part, at its ops' arithmetic: the kernel once per spread."""
    us = {op.name: op.us for path in ("gathered", "triton") for op in arithmetic.path_ops(path, shape, k)}
    once = ("forward GEMM", "input-gradient GEMM", "merged copy", "deltas' gradient GEMM", "gather", "token-major x")
    return (sum(us[name] for name in once + ("token-major gradient",)) + len(SPREADS) * us["sampled kernel"]) / 1e6


def budget_table() -> str:
    parts = run_seconds()
    lines = ["| part of the run | seconds |", "|---|---|"]
    lines += [f"| {part} | {seconds:.0f} |" for part, seconds in parts.items()]
    lines.append(f"| **total** | **{sum(parts.values()):.0f}** |")
    return "\n".join(lines)


def with_generated(doc: str, report: dict | None) -> str:
    """`doc` with its blocks marked `<!-- gpu_step:NAME -->` replaced: the arithmetic, the run's time on paper, and
    `report`'s tables (docs/gpu/step.jsonl's; None: not measured yet)."""
    tables = "No device has run `gpu_step.py` yet: docs/gpu/step.jsonl is not there; its figures wait for a device."
    if report:
        v = report["versions"]
        machine = f"{v['device']}, torch {v['torch']}, peft {v['peft']}, {v['dtype']}, commit {v['commit'][:7]}"
        tables = f"{machine}:\n\n{summary(report)}"
    blocks = {"arithmetic": arithmetic.table(), "budget": budget_table(), "tables": tables}
    for name, text in blocks.items():
        pattern = re.compile(rf"(<!-- gpu_step:{name} -->\n).*?(<!-- /gpu_step:{name} -->)", re.DOTALL)
        if len(pattern.findall(doc)) != 1:
            raise ValueError(f"{PERFORMANCE_DOC.name} has no single block marked gpu_step:{name}")
        doc = pattern.sub(lambda m, text=text: f"{m[1]}{text}\n{m[2]}", doc)
    return doc


def committed_report() -> dict | None:
    return read_report(STEP_FILE) if STEP_FILE.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, help="The JSON lines file (docs/gpu/step.jsonl's content on a GPU).")
    parser.add_argument("--dry-run", action="store_true", help="On the CPU at toy sizes: the suite's check.")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="Timed calls per figure.")
    parser.add_argument("--commit", default=None, help="The commit measured (default: the checkout's HEAD).")
    parser.add_argument(
        "--write-docs", action="store_true", help="Write the arithmetic and docs/gpu/step.jsonl's tables into docs."
    )
    args = parser.parse_args()
    if args.write_docs:
        PERFORMANCE_DOC.write_text(with_generated(PERFORMANCE_DOC.read_text(), committed_report()))
        return
    if args.out is None:
        parser.error("--out is required (or --write-docs)")
    if args.dry_run:
        device, dtype, timing = torch.device("cpu"), torch.float32, (1, 1)
        shapes = {name: (d_in // 64, d_out // 64) for name, (d_in, d_out) in SHAPES.items()}
        tokens, model, seq = 24, "tiny", 16
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run with --dry-run on the CPU")
        device, dtype, timing = torch.device("cuda"), torch.bfloat16, (WARMUP, args.repeats)
        shapes, tokens, model, seq = SHAPES, TOKENS, STEP_MODEL, STEP_SEQ
    lines = Lines(args.out)
    run = {"dtype": str(dtype).removeprefix("torch."), "commit": args.commit or commit()}
    lines("versions", **gpu_versions.versions(), **run)
    time_layers(shapes, tokens, device, dtype, timing, lines)
    time_steps(model, seq, device, dtype, timing, lines)
    time_parts(shapes, tokens, device, dtype, timing, lines)
    time_decoding({name: shapes[name] for name in DECODE_SHAPES}, device, dtype, timing, lines)
    print(summary(read_report(args.out)))


if __name__ == "__main__":
    main()
