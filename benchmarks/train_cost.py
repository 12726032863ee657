"""Training cost of NeuroAda against a frozen-model floor and the other ways to tune a sparse/low-rank budget.

    python benchmarks/train_cost.py --model smollm2
    python benchmarks/train_cost.py --model large-random --json outputs/large.json
    python benchmarks/train_cost.py --tiny            # smoke test, a few seconds per variant

Each variant runs in freshly forked processes (the coordinator imports the libraries, all of them before the first
fork so every variant runs the same code, but never runs a tensor op or touches CUDA), so allocator state, caches and
peak-memory counters of one variant never leak into the next: one process measures memory, another one time. Per
variant it reports:

* step time: median of fwd + bwd + AdamW step over the timed steps (after warmup, pooled over `--rounds` passes
  that interleave the variants), as wall-clock and as process CPU time;
* peak memory growth over the loaded model: CUDA `max_memory_allocated`, or on CPU the process's peak RSS (VmHWM,
  reset through /proc/self/clear_refs once the variant is set up) minus the RSS right after loading the model;
* a deterministic memory account: bytes saved for backward (each storage once, parameters and buffers excluded since
  they exist anyway) + gradient bytes + optimizer-state bytes;
* inference forward time (no_grad, adapters unmerged);

and every figure as a ratio to the floor measured in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, ShiraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

# Run from a checkout without installing the package.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from peft_neuroada import NeuroAdaConfig  # noqa: E402
from peft_neuroada.config import LLAMA_STYLE_TARGETS  # noqa: E402
from peft_neuroada.train.default_model import load_default_model  # noqa: E402

MIB = 2**20
# The issue's budget: NeuroAda with k=20 sets the parameter budget LoRA and SHiRA are matched to.
BUDGET_K = 20
TARGETS = list(LLAMA_STYLE_TARGETS)

RANDOM_CONFIGS = {
    # ~0.55B parameters: the weights (2.2 GB) dominate the activations of a 1 x 256 batch.
    "large-random": LlamaConfig(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    "tiny": LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
}


@dataclass(frozen=True)
class ModelDefaults:
    batch: int
    seq_len: int
    warmup: int
    steps: int
    infer_steps: int


MODEL_DEFAULTS = {
    "smollm2": ModelDefaults(batch=1, seq_len=512, warmup=3, steps=5, infer_steps=3),
    "large-random": ModelDefaults(batch=1, seq_len=256, warmup=2, steps=3, infer_steps=3),
    "tiny": ModelDefaults(batch=1, seq_len=32, warmup=1, steps=2, infer_steps=1),
}


@dataclass(frozen=True)
class RunSpec:
    """Everything a variant's process needs (picklable, sent to the child)."""

    model: str
    variant: str
    batch: int
    seq_len: int
    warmup: int
    steps: int
    infer_steps: int
    device: str
    dtype: str
    threads: int | None = None
    seed: int = 0


@dataclass
class Result:
    """One variant's figures; times in seconds, memory in bytes (growth over the loaded model)."""

    variant: str
    label: str = ""
    trainable_params: int = 0
    step_wall_s: float = float("nan")
    step_cpu_s: float = float("nan")
    infer_wall_s: float = float("nan")
    infer_cpu_s: float = float("nan")
    peak_growth_bytes: int = 0
    memory_source: str = ""
    saved_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    error: str | None = None
    # Every timed call, pooled over rounds: "step_wall", "step_cpu", "infer_wall", "infer_cpu" -> seconds.
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def accounted_bytes(self) -> int:
        return self.saved_bytes + self.grad_bytes + self.optimizer_bytes

    def add_samples(self, samples: dict[str, list[float]]) -> None:
        """Pool another round's timings and refresh the medians."""
        for key, values in samples.items():
            self.samples.setdefault(key, []).extend(values)
            if hasattr(self, f"{key}_s"):
                setattr(self, f"{key}_s", statistics.median(self.samples[key]))

    def paired_ratio(self, name: str, clock: str) -> float:
        """Median over adjacent pairs of this variant's `name` ("step"/"infer") time over the same process's floor
        (adapters disabled), timed alternately so both see the same machine load; NaN when not measured."""
        ours, floor = self.samples.get(f"{name}_{clock}", []), self.samples.get(f"floor_{name}_{clock}", [])
        if not floor:
            return float("nan")
        return statistics.median(a / b for a, b in zip(ours, floor, strict=True))


# --------------------------------------------------------------------------------------------------- models


def build_model(name: str, dtype: torch.dtype) -> PreTrainedModel:
    """The real SmolLM2-135M, or a seeded random Llama (weights need not be trained to cost the same)."""
    if name == "smollm2":
        model, _ = load_default_model(dtype=dtype)
        return model
    torch.manual_seed(0)
    return LlamaForCausalLM(RANDOM_CONFIGS[name]).to(dtype)


def targeted_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The layers every variant adapts: the same q/k/v/o/gate/up/down projections NeuroAda targets by default."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            yield name, module


def budget_rank(model: nn.Module, k: int = BUDGET_K) -> int:
    """LoRA/SHiRA rank whose r*(d_in+d_out) parameters per layer come closest to NeuroAda's k*d_out."""
    neuroada = sum(k * layer.out_features for _, layer in targeted_linears(model))
    per_rank = sum(layer.in_features + layer.out_features for _, layer in targeted_linears(model))
    return max(1, round(neuroada / per_rank))


def top_k_columns(weight: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the k largest-|w| input columns (as the paper code selects them), int64."""
    with torch.no_grad():
        return weight.abs().topk(k, dim=1).indices


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


# ------------------------------------------------------------------------------------------------- variants

# A variant prepares the model in place (or wraps it) and returns the model to run and the parameters to optimize.
Setup = tuple[nn.Module, list[nn.Parameter], str]


def frozen_floor(model: PreTrainedModel) -> Setup:
    """What any adapter must at least pay: forward plus backward of input gradients through a frozen model."""
    model.requires_grad_(False)
    model.enable_input_require_grads()
    return model, [], "floor (frozen, input grads)"


def peft_variant(model: PreTrainedModel, config, label: str) -> Setup:
    peft_model = get_peft_model(model, config)
    return peft_model, [p for p in peft_model.parameters() if p.requires_grad], label


def neuroada(k: int, inplace: bool = True) -> Callable[[PreTrainedModel], Setup]:
    """NeuroAda on its default in-place path, or (inplace False) on the non-mutating path that threads, shared
    weights and inference tensors fall back to."""
    config = NeuroAdaConfig(k=k, target_modules=TARGETS, inplace_forward=inplace)
    return lambda model: peft_variant(model, config, f"neuroada k={k}" + ("" if inplace else ", non-mutating"))


def neuroada_frozen(model: PreTrainedModel) -> Setup:
    """NeuroAda k=20 with its deltas frozen: the in-place path's own cost (forward and input gradient through
    W + P⊙Θ) without the delta gradient, so the step-time excess over the floor splits into its two parts."""
    peft_model, _, _ = neuroada(BUDGET_K)(model)
    return frozen_floor(peft_model)[0], [], f"neuroada k={BUDGET_K}, deltas frozen"


def lora(rank: int | None) -> Callable[[PreTrainedModel], Setup]:
    """LoRA at a fixed rank, or (rank None) at the rank matching NeuroAda k=20's parameter count."""

    def setup(model: PreTrainedModel) -> Setup:
        r = rank or budget_rank(model)
        config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS)
        return peft_variant(model, config, f"lora r={r}" + ("" if rank else " (budget)"))

    return setup


def shira(model: PreTrainedModel) -> Setup:
    r = budget_rank(model)
    config = ShiraConfig(r=r, random_seed=0, target_modules=TARGETS)
    return peft_variant(model, config, f"shira r={r} (budget)")


class ScatterAddLinear(nn.Module):
    """The NeuroAda paper code's forward: rebuild W + scatter(delta) as a new dense tensor at every call."""

    def __init__(self, base: nn.Linear, k: int) -> None:
        super().__init__()
        self.base = base
        rows = torch.arange(base.out_features, device=base.weight.device).unsqueeze(1) * base.in_features
        self.register_buffer("positions", (rows + top_k_columns(base.weight, k)).flatten())
        self.delta = nn.Parameter(torch.zeros(base.out_features * k, device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.base.weight
        merged = weight.flatten().scatter_add(0, self.positions, self.delta.to(weight.dtype)).view_as(weight)
        return F.linear(x, merged, self.base.bias)


def paper_scatter_add(model: PreTrainedModel, k: int = BUDGET_K) -> Setup:
    model.requires_grad_(False)
    for name, layer in list(targeted_linears(model)):
        replace_module(model, name, ScatterAddLinear(layer, k))
    return model, [p for p in model.parameters() if p.requires_grad], f"paper scatter_add k={k}"


def mask_based(model: PreTrainedModel, k: int = BUDGET_K) -> Setup:
    """Sparse tuning the usual way: dense trainable weights whose gradients are masked to the top-k entries."""
    model.requires_grad_(False)
    params = []
    for _, layer in targeted_linears(model):
        weight = layer.weight
        mask = torch.zeros_like(weight, dtype=torch.bool).scatter_(1, top_k_columns(weight, k), True)
        weight.requires_grad_(True)
        weight.register_hook(lambda grad, mask=mask: grad * mask)
        params.append(weight)
    return model, params, f"mask-based k={k} (dense grads)"


def full_finetune(model: PreTrainedModel) -> Setup:
    model.requires_grad_(True)
    return model, list(model.parameters()), "full fine-tuning"


VARIANTS: dict[str, Callable[[PreTrainedModel], Setup]] = {
    "floor": frozen_floor,
    "neuroada-k1": neuroada(1),
    "neuroada-k20": neuroada(BUDGET_K),
    "neuroada-k20-frozen": neuroada_frozen,
    "neuroada-k20-nonmutating": neuroada(BUDGET_K, inplace=False),
    "lora-budget": lora(None),
    "lora-r8": lora(8),
    "shira-budget": shira,
    "paper-scatter-k20": paper_scatter_add,
    "mask-k20": mask_based,
    "full": full_finetune,
}


# -------------------------------------------------------------------------------------------------- memory


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_bytes() -> int:
    return _proc_status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _proc_status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS (Linux >= 4.0) so the peak covers training only, not loading."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def return_freed_memory_to_os() -> None:
    """Make glibc mmap blocks >= 64 KiB and trim the heap on free, so RSS follows live tensors (not glibc caches)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 0)


def _storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    if tensor.layout == torch.sparse_coo:
        yield from (t.untyped_storage() for t in (tensor._indices(), tensor._values()))
    elif tensor.layout == torch.sparse_csr:
        yield from (t.untyped_storage() for t in (tensor.crow_indices(), tensor.col_indices(), tensor.values()))
    elif tensor.layout == torch.strided:
        yield tensor.untyped_storage()


class SavedTensorMeter:
    """Bytes autograd keeps for backward: each storage counted once; the model's own parameters/buffers excluded."""

    def __init__(self, model: nn.Module) -> None:
        self.exclude = {s.data_ptr() for t in [*model.parameters(), *model.buffers()] for s in _storages(t)}
        self.sizes: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for storage in _storages(tensor):
            if storage.data_ptr() not in self.exclude:
                self.sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ----------------------------------------------------------------------------------------------- measuring


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextmanager
def adapters_disabled(model: PeftModel) -> Iterator[None]:
    """peft's `disable_adapter`, keeping which parameters train: leaving it makes the active adapters trainable again,
    which would turn a frozen-adapter variant into a trained one after its first paired floor step."""
    trainable = [p.requires_grad for p in model.parameters()]
    try:
        with model.disable_adapter():
            yield
    finally:
        for param, flag in zip(model.parameters(), trainable, strict=True):
            param.requires_grad_(flag)


@contextmanager
def as_floor(model: PeftModel) -> Iterator[None]:
    """Run a peft model as the floor: adapters disabled, input-embedding output requiring grad."""
    embeddings = model.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    try:
        with adapters_disabled(model):
            yield
    finally:
        handle.remove()


class Session:
    """A variant set up on a freshly loaded model, with its batch and optimizer, ready to take training steps.

    For peft variants the same model, adapters disabled, also serves as an in-process floor whose steps alternate
    with the variant's: the paired ratio is far less sensitive to other jobs than one across processes.
    """

    def __init__(self, spec: RunSpec) -> None:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.device = resolve_device(spec.device)
        self.on_cuda = self.device.type == "cuda"
        model = build_model(spec.model, getattr(torch, spec.dtype)).to(self.device)
        generator = torch.Generator().manual_seed(spec.seed)
        ids = torch.randint(0, model.config.vocab_size, (spec.batch, spec.seq_len), generator=generator)
        self.input_ids = ids.to(self.device)
        gc.collect()
        self.baseline = torch.cuda.memory_allocated() if self.on_cuda else rss_bytes()
        self.model, self.params, label = VARIANTS[spec.variant](model)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.0) if self.params else None
        self.result = Result(spec.variant, label, trainable_params=sum(p.numel() for p in self.params))
        self.paired = isinstance(self.model, PeftModel)

    def step(self) -> None:
        """fwd + bwd + AdamW step; the floor has nothing to optimize and stops after backward."""
        self.model(input_ids=self.input_ids, labels=self.input_ids).loss.backward()
        if self.optimizer is not None:
            grads = tensor_bytes(p.grad for p in self.params if p.grad is not None)
            self.result.grad_bytes = max(self.result.grad_bytes, grads)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def floor_step(self) -> None:
        with as_floor(self.model):
            self.model(input_ids=self.input_ids, labels=self.input_ids).loss.backward()

    def infer(self) -> None:
        with torch.no_grad():
            self.model(input_ids=self.input_ids)

    def floor_infer(self) -> None:
        with adapters_disabled(self.model):
            self.infer()

    def calls(self, name: str) -> dict[str, Callable[[], None]]:
        """The calls to time for `name` ("step" or "infer"): the variant's, plus the in-process floor's if any."""
        calls = {name: getattr(self, name)}
        if self.paired:
            calls[f"floor_{name}"] = getattr(self, f"floor_{name}")
        return calls

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize()

    def timed(self, calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
        """Wall and process-CPU seconds of each call, the calls alternating; CPU time is far less disturbed by other
        jobs on the cores than wall time."""
        samples: dict[str, list[float]] = {f"{name}_{clock}": [] for name in calls for clock in ("wall", "cpu")}
        for _ in range(repeats):
            for name, fn in calls.items():
                self.sync()
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                fn()
                self.sync()
                samples[f"{name}_wall"].append(time.perf_counter() - start_wall)
                samples[f"{name}_cpu"].append(time.process_time() - start_cpu)
        return samples


def measure_memory(spec: RunSpec) -> Result:
    """Peak growth and the saved/grad/optimizer account over two steps (the first creates the optimizer state).

    Runs apart from the timing so that glibc can be told to hand freed memory back (RSS then follows live tensors)
    without its extra page faults slowing the timed steps.
    """
    return_freed_memory_to_os()
    session = Session(spec)
    gc.collect()
    if session.on_cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    meter = SavedTensorMeter(session.model)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda tensor: tensor):
        session.step()
    session.step()
    peak = torch.cuda.max_memory_allocated() if session.on_cuda else peak_rss_bytes()
    result = session.result
    result.peak_growth_bytes = peak - session.baseline
    result.memory_source = "cuda max_memory_allocated" if session.on_cuda else "peak RSS (VmHWM)"
    result.saved_bytes = meter.total
    if session.optimizer is not None:
        states = session.optimizer.state.values()
        result.optimizer_bytes = tensor_bytes(t for state in states for t in state.values())
    return result


def measure_time(spec: RunSpec) -> Result:
    """Training-step and no-grad forward times, after warmup, with the default allocator."""
    session = Session(spec)
    for _ in range(spec.warmup):
        for fn in session.calls("step").values():
            fn()
    result = session.result
    result.add_samples(session.timed(session.calls("step"), spec.steps))
    if spec.infer_steps:
        session.model.eval()
        for fn in session.calls("infer").values():
            fn()
        result.add_samples(session.timed(session.calls("infer"), spec.infer_steps))
    return result


def run_isolated(measure: Callable[[RunSpec], Result], spec: RunSpec) -> Result:
    """Run `measure(spec)` in a new forked process; a crash (or OOM kill) becomes that variant's error."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            return pool.submit(measure, spec).result()
        except Exception as error:  # any failure belongs in the table, not in a traceback that hides the rest
            return Result(spec.variant, spec.variant, error=f"{type(error).__name__}: {error}")


def run_all(specs: list[RunSpec], rounds: int) -> list[Result]:
    """Memory of each variant once, then `rounds` timing passes over all variants, in a rotated order each round.

    Spreading each variant's timed steps over the whole run (instead of one burst) gives every variant the same
    share of whatever else the machine is doing, which keeps the ratios to the floor fair on a shared CPU.
    """
    results = []
    for spec in specs:
        results.append(run_isolated(measure_memory, spec))
        _progress(results[-1], "memory")
    for round_index in range(rounds):
        pairs = list(zip(specs, results, strict=True))
        shift = round_index % len(pairs)
        for spec, result in pairs[shift:] + pairs[:shift]:
            if result.error:
                continue
            timing = run_isolated(measure_time, spec)
            if timing.error:
                result.error = timing.error
            else:
                result.add_samples(timing.samples)
            _progress(result, f"timing round {round_index + 1}/{rounds}")
    return results


def _progress(result: Result, stage: str) -> None:
    if result.error:
        status = f"error: {result.error}"
    else:
        status = f"+{result.peak_growth_bytes / MIB:,.1f} MiB peak, {result.step_cpu_s * 1e3:,.0f} ms CPU/step"
    print(f"[{result.variant}] {stage}: {status}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ reporting


def _ratio(value: float, floor: float) -> str:
    return f"{value / floor:.2f}x" if floor and value == value else "-"


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds == seconds else "-"


def format_table(results: list[Result], clock: str) -> str:
    """One row per variant; `clock` ("cpu" or "wall") is the time the ratios to the floor are taken on."""
    floor = next(r for r in results if r.variant == "floor")
    step, infer = f"step_{clock}_s", f"infer_{clock}_s"
    header = [
        "variant",
        "trainable params",
        "step wall (ms)",
        "step CPU (ms)",
        f"step / floor ({clock})",
        "step / paired floor",
        "peak growth (MiB)",
        "peak / floor",
        "saved for bwd (MiB)",
        "grads + optim (MiB)",
        "accounted / floor",
        f"infer fwd {clock} (ms)",
        "infer / floor",
        "infer / paired base",
    ]
    rows = []
    for r in results:
        if r.error:
            rows.append([r.label or r.variant, f"error: {r.error}"] + [""] * (len(header) - 2))
            continue
        rows.append(
            [
                r.label,
                f"{r.trainable_params:,}",
                _ms(r.step_wall_s),
                _ms(r.step_cpu_s),
                _ratio(getattr(r, step), getattr(floor, step)),
                _ratio(r.paired_ratio("step", clock), 1.0),
                _mib(r.peak_growth_bytes),
                _ratio(r.peak_growth_bytes, floor.peak_growth_bytes),
                _mib(r.saved_bytes),
                _mib(r.grad_bytes + r.optimizer_bytes),
                _ratio(r.accounted_bytes, floor.accounted_bytes),
                _ms(getattr(r, infer)),
                _ratio(getattr(r, infer), getattr(floor, infer)),
                _ratio(r.paired_ratio("infer", clock), 1.0),
            ]
        )
    return markdown_table(header, rows)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """One of the issue's acceptance targets: `metric` of variant `a` over that of `b` must be <= `limit`."""

    description: str
    metric: str  # a Result attribute; "step" and "infer" mean the chosen clock's time
    a: str
    b: str
    limit: float

    def ratio(self, results: dict[str, Result], clock: str) -> float:
        """The ratio across the two variants' processes."""
        metric = f"{self.metric}_{clock}_s" if self.metric in ("step", "infer") else self.metric
        return getattr(results[self.a], metric) / getattr(results[self.b], metric)

    def paired_ratio(self, results: dict[str, Result], clock: str) -> float:
        """The in-process paired ratio, for time targets against the floor (NaN where there is none)."""
        if self.b != "floor" or self.metric not in ("step", "infer"):
            return float("nan")
        return results[self.a].paired_ratio(self.metric, clock)


ISSUE_TARGETS = [
    Target("neuroada k=1 step <= 1.05x floor", "step", "neuroada-k1", "floor", 1.05),
    Target("neuroada k=20 step <= 1.10x floor", "step", "neuroada-k20", "floor", 1.10),
    Target("neuroada k=20 step <= LoRA at equal budget", "step", "neuroada-k20", "lora-budget", 1.0),
    Target(
        "neuroada k=20 non-mutating step <= 1.10x in place", "step", "neuroada-k20-nonmutating", "neuroada-k20", 1.1
    ),
    Target("neuroada k=1 peak growth <= 1.05x floor", "peak_growth_bytes", "neuroada-k1", "floor", 1.05),
    Target("neuroada k=20 peak growth <= 1.05x floor", "peak_growth_bytes", "neuroada-k20", "floor", 1.05),
    Target("neuroada k=20 peak growth <= LoRA at equal budget", "peak_growth_bytes", "neuroada-k20", "lora-budget", 1),
    Target("neuroada k=20 peak growth <= 0.6x mask-based", "peak_growth_bytes", "neuroada-k20", "mask-k20", 0.6),
    Target("neuroada k=20 >= 1.3x faster than SHiRA", "step", "neuroada-k20", "shira-budget", 1 / 1.3),
    Target(
        "neuroada k=20 >= 1.3x faster than paper scatter_add", "step", "neuroada-k20", "paper-scatter-k20", 1 / 1.3
    ),
    Target("neuroada k=1 unmerged inference fwd <= 1.05x base", "infer", "neuroada-k1", "floor", 1.05),
]


def check_targets(results: list[Result], clock: str) -> list[dict[str, object]]:
    """Each issue target with its measured ratio(s); targets whose variants were not run or failed, or whose metric
    was not measured (inference with `--infer-steps 0`), are left out.

    A target against the floor is judged on the paired in-process ratio when there is one (it is the robust one).
    """
    by_name = {r.variant: r for r in results if not r.error}
    checks = []
    for target in ISSUE_TARGETS:
        if target.a in by_name and target.b in by_name:
            ratio, paired = target.ratio(by_name, clock), target.paired_ratio(by_name, clock)
            if math.isnan(ratio):
                continue
            judged = ratio if math.isnan(paired) else paired
            checks.append(
                {
                    "target": target.description,
                    "ratio": ratio,
                    "paired_ratio": paired,
                    "limit": target.limit,
                    "holds": judged <= target.limit,
                }
            )
    return checks


def format_checks(checks: list[dict[str, object]]) -> str:
    rows = [
        [
            c["target"],
            f"{c['ratio']:.3f}",
            "-" if math.isnan(c["paired_ratio"]) else f"{c['paired_ratio']:.3f}",
            f"{c['limit']:.3f}",
            "yes" if c["holds"] else "NO",
        ]
        for c in checks
    ]
    return markdown_table(["target", "ratio (separate processes)", "paired ratio", "limit", "holds"], rows)


# ------------------------------------------------------------------------------------------------------ CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", choices=sorted(MODEL_DEFAULTS), default="smollm2")
    parser.add_argument("--tiny", action="store_true", help="Smoke mode: same as --model tiny.")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--batch", type=int, help="Sequences per step (model default when omitted).")
    parser.add_argument("--seq-len", type=int, help="Tokens per sequence (model default when omitted).")
    parser.add_argument("--warmup", type=int, help="Untimed training steps before the timed ones.")
    parser.add_argument("--steps", type=int, help="Timed training steps; the median is reported.")
    parser.add_argument("--infer-steps", type=int, help="Timed no-grad forwards (0 skips inference timing).")
    parser.add_argument(
        "--rounds", type=int, default=1, help="Timing passes over all variants; each pass uses new processes."
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available).")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads per variant; 1 keeps timings sane on a shared CPU."
    )
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        help="Time the ratios use: process CPU time (default on CPU: robust to other jobs) or wall (default on GPU).",
    )
    parser.add_argument("--json", type=Path, help="Also write the results (and target checks) to this file.")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
    for key, default in asdict(MODEL_DEFAULTS[args.model]).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.warmup < 0 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup must be >= 0, --steps and --rounds >= 1")
    if args.clock is None:
        gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
        args.clock = "wall" if gpu else "cpu"
    if "floor" not in args.variants:
        args.variants.insert(0, "floor")  # every ratio is to the floor
    return args


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
        )
        for variant in args.variants
    ]
    results = run_all(specs, args.rounds)
    checks = check_targets(results, args.clock)
    print(
        f"\nmodel={args.model} batch={args.batch}x{args.seq_len} dtype={args.dtype} device={args.device} "
        f"threads={args.threads or torch.get_num_threads()} rounds={args.rounds} warmup={args.warmup} "
        f"steps={args.steps} infer_steps={args.infer_steps} torch={torch.__version__} machine={platform.machine()} "
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
            "results": [asdict(r) | {"accounted_bytes": r.accounted_bytes} for r in results],
            "targets": checks,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return results


if __name__ == "__main__":
    main()
