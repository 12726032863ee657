"""Measuring one variant in a fresh process: memory in one, time in another (training steps, no-grad forwards, greedy
generation), the paired floor alongside."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import statistics
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch
from common import interleaved_samples
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer

from peft_neuroada.tuner.config import DTYPES

from .meters import (
    MIB,
    SavedTensorMeter,
    fault_in,
    keep_freed_memory,
    peak_rss_bytes,
    reset_peak_rss,
    return_freed_memory_to_os,
    rss_bytes,
    tensor_bytes,
)
from .variants import VARIANTS, build_model


@dataclass(frozen=True)
class ModelDefaults:
    batch: int
    seq_len: int
    warmup: int
    steps: int
    infer_steps: int
    gen_steps: int


MODEL_DEFAULTS = {
    "smollm2": ModelDefaults(batch=1, seq_len=512, warmup=3, steps=5, infer_steps=3, gen_steps=3),
    "smollm2-random": ModelDefaults(batch=1, seq_len=512, warmup=3, steps=5, infer_steps=3, gen_steps=3),
    "large-random": ModelDefaults(batch=1, seq_len=256, warmup=2, steps=3, infer_steps=3, gen_steps=1),
    "llama-1b-random": ModelDefaults(batch=4, seq_len=512, warmup=3, steps=5, infer_steps=3, gen_steps=3),
    "tiny": ModelDefaults(batch=1, seq_len=32, warmup=1, steps=2, infer_steps=1, gen_steps=1),
    "qwen3-moe": ModelDefaults(batch=1, seq_len=256, warmup=1, steps=3, infer_steps=2, gen_steps=1),
    "tiny-moe": ModelDefaults(batch=1, seq_len=32, warmup=1, steps=2, infer_steps=1, gen_steps=1),
}


OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    # torch's default implementation (on CPU a Python loop over the tensors), as `neuroada train` and the paper use
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0),
    # one fused kernel for all tensors: the Trainer's default (`adamw_torch_fused`) in transformers 5
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True),
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
    quantize: str | None = None  # a key of variants.QUANTIZATIONS: every variant on the same quantized base
    allocator: str = "default"  # "keep": glibc keeps freed memory in the timing process (`meters.keep_freed_memory`)
    optimizer: str = "adamw"  # a key of OPTIMIZERS
    gen_steps: int = 0  # timed greedy generations (0: none)
    gen_prompt: int = 8  # prompt tokens of each generation (batch 1)
    gen_tokens: int = 32  # new tokens of each generation, one per forward with the KV cache


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
    gen_wall_s: float = float("nan")  # one whole generation: the prompt's forward and `gen_tokens` decoding steps
    gen_cpu_s: float = float("nan")
    gen_tokens: int = 0
    peak_growth_bytes: int = 0
    memory_source: str = ""
    saved_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    error: str | None = None
    # Every timed call, pooled over rounds: "step_wall", "step_cpu", "infer_wall", "infer_cpu", "gen_wall", "gen_cpu"
    # (and the paired floor's as "floor_step_wall", ...) -> seconds.
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def accounted_bytes(self) -> int:
        return self.saved_bytes + self.grad_bytes + self.optimizer_bytes

    def tokens_per_s(self, clock: str = "wall") -> float:
        """New tokens per second of greedy generation on `clock` (NaN when not measured)."""
        seconds = getattr(self, f"gen_{clock}_s")
        return self.gen_tokens / seconds if self.gen_tokens and seconds == seconds else float("nan")

    def add_samples(self, samples: dict[str, list[float]]) -> None:
        """Pool another round's timings and refresh the medians."""
        for key, values in samples.items():
            self.samples.setdefault(key, []).extend(values)
            if hasattr(self, f"{key}_s"):
                setattr(self, f"{key}_s", statistics.median(self.samples[key]))

    def paired_ratio(self, name: str, clock: str) -> float:
        """Median over adjacent pairs of this variant's `name` ("step"/"infer"/"gen") time over the same process's
        floor (adapters disabled), timed alternately so both see the same machine load; NaN when not measured."""
        ours, floor = self.samples.get(f"{name}_{clock}", []), self.samples.get(f"floor_{name}_{clock}", [])
        if not floor:
            return float("nan")
        return statistics.median(a / b for a, b in zip(ours, floor, strict=True))


# ----------------------------------------------------------------------------------------------- measuring


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextmanager
def adapters_disabled(model: PeftModel) -> Iterator[None]:
    """The frozen model inside a peft model: peft's `disable_adapter`, with every tuner layer's forward replaced by its
    base layer's, so the floor pays none of an adapter layer's own work (a disabled adapter layer still runs its own
    forward's checks and dispatch before the base layer's, which is not the frozen model's cost).

    Keeps which parameters train: leaving `disable_adapter` makes the active adapters trainable again, which would
    turn a frozen-adapter variant into a trained one after its first paired floor step."""
    trainable = [p.requires_grad for p in model.parameters()]
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    try:
        for layer in layers:
            layer.forward = layer.get_base_layer().forward
        with model.disable_adapter():
            yield
    finally:
        for layer in layers:
            vars(layer).pop("forward", None)
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
        model = build_model(spec.model, DTYPES[spec.dtype], spec.quantize)
        if spec.quantize is None:
            model = model.to(self.device)
        generator = torch.Generator().manual_seed(spec.seed)
        ids = torch.randint(0, model.config.vocab_size, (spec.batch, spec.seq_len), generator=generator)
        self.input_ids = ids.to(self.device)
        prompt = torch.randint(0, model.config.vocab_size, (1, spec.gen_prompt), generator=generator)
        self.prompt_ids = prompt.to(self.device)
        self.gen_tokens = spec.gen_tokens
        fault_in(model)
        gc.collect()
        self.baseline = torch.cuda.memory_allocated() if self.on_cuda else rss_bytes()
        self.model, self.params, label = VARIANTS[spec.variant](model)
        self.model.train()
        self.optimizer = OPTIMIZERS[spec.optimizer](self.params) if self.params else None
        self.result = Result(spec.variant, label, trainable_params=sum(p.numel() for p in self.params))
        self.paired = isinstance(self.model, PeftModel)

    def backward(self) -> None:
        self.model(input_ids=self.input_ids, labels=self.input_ids).loss.backward()

    def step(self) -> None:
        """fwd + bwd + AdamW step; the floor has nothing to optimize and stops after backward."""
        self.backward()
        self.optimize()

    def optimize(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def floor_step(self) -> None:
        """The floor's step: run with the model set up as the floor (`setups`)."""
        self.backward()

    def infer(self) -> None:
        with torch.no_grad():
            self.model(input_ids=self.input_ids)

    def floor_infer(self) -> None:
        """The base model's forward: run with the adapters disabled (`setups`)."""
        self.infer()

    def gen(self) -> None:
        """Greedy generation, batch 1, adapters unmerged: transformers' `generate` runs the prompt, then one forward
        per new token with the KV cache, exactly `gen_tokens` of them (no stop at an end-of-sequence token)."""
        self.model.generate(
            input_ids=self.prompt_ids,
            attention_mask=torch.ones_like(self.prompt_ids),
            max_new_tokens=self.gen_tokens,
            min_new_tokens=self.gen_tokens,
            do_sample=False,
            pad_token_id=0,
        )

    def floor_gen(self) -> None:
        """The base model's generation: run with the adapters disabled (`setups`)."""
        self.gen()

    def calls(self, name: str) -> dict[str, Callable[[], None]]:
        """The calls to time for `name` ("step", "infer" or "gen"): the variant's, plus the in-process floor's if
        any."""
        calls = {name: getattr(self, name)}
        if self.paired:
            calls[f"floor_{name}"] = getattr(self, f"floor_{name}")
        return calls

    def setups(self, name: str) -> dict[str, Callable[[], AbstractContextManager]]:
        """The mode each floor call runs in, entered and left outside its timing: peft's `disable_adapter` reads every
        layer's status on entry (~17 ms on SmolLM2), which is not the floor's work."""
        if not self.paired:
            return {}
        mode = as_floor if name == "step" else adapters_disabled
        return {f"floor_{name}": functools.partial(mode, self.model)}

    def warm_up(self, name: str) -> None:
        """One untimed call of each of `calls(name)`, in its mode."""
        interleaved_samples(self.calls(name), 1, self.sync, setups=self.setups(name))

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize()

    def timed(self, name: str, repeats: int) -> dict[str, list[float]]:
        """Wall and process-CPU seconds of each of `calls(name)`, interleaved, as `{call}_wall` / `{call}_cpu`."""
        samples = interleaved_samples(self.calls(name), repeats, self.sync, setups=self.setups(name))
        return {
            f"{call}_{clock}": times
            for call, (wall, cpu) in samples.items()
            for clock, times in (("wall", wall), ("cpu", cpu))
        }


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
        session.backward()
    result = session.result
    result.grad_bytes = tensor_bytes(p.grad for p in session.params if p.grad is not None)
    session.optimize()
    session.step()
    peak = torch.cuda.max_memory_allocated() if session.on_cuda else peak_rss_bytes()
    result.peak_growth_bytes = peak - session.baseline
    result.memory_source = "cuda max_memory_allocated" if session.on_cuda else "peak RSS (VmHWM)"
    result.saved_bytes = meter.total
    if session.optimizer is not None:
        states = session.optimizer.state.values()
        result.optimizer_bytes = tensor_bytes(t for state in states for t in state.values())
    return result


def measure_time(spec: RunSpec) -> Result:
    """Training-step, no-grad forward and greedy generation times, after warmup, with glibc's default allocator or one
    that keeps freed memory (`spec.allocator`)."""
    if spec.allocator == "keep":
        keep_freed_memory()
    session = Session(spec)
    for _ in range(spec.warmup):
        session.warm_up("step")
    result = session.result
    result.add_samples(session.timed("step", spec.steps))
    if spec.infer_steps:
        session.model.eval()
        session.warm_up("infer")
        result.add_samples(session.timed("infer", spec.infer_steps))
    if spec.gen_steps:
        session.model.eval()
        session.warm_up("gen")
        result.gen_tokens = spec.gen_tokens
        result.add_samples(session.timed("gen", spec.gen_steps))
    return result


def failed(spec: RunSpec, error: Exception) -> Result:
    """A variant's failure as its row of the table, not a traceback that hides the other rows."""
    return Result(spec.variant, spec.variant, error=f"{type(error).__name__}: {error}")


def run_isolated(measure: Callable[[RunSpec], Result], spec: RunSpec) -> Result:
    """Run `measure(spec)` in a new (forked) process; a crash (or OOM kill) becomes that variant's error."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            return pool.submit(measure, spec).result()
        except Exception as error:
            return failed(spec, error)


def run_here(measure: Callable[[RunSpec], Result], spec: RunSpec) -> Result:
    """Run `measure(spec)` in this process, an exception becoming that variant's error, its tensors freed after."""
    try:
        return measure(spec)
    except Exception as error:
        return failed(spec, error)
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def run_all(specs: list[RunSpec], rounds: int) -> list[Result]:
    """Memory of each variant once, then `rounds` timing passes over all variants, in a rotated order each round.

    Spreading each variant's timed steps over the whole run (instead of one burst) gives every variant the same
    share of whatever else the machine is doing, which keeps the ratios to the floor fair on a shared CPU.

    On the CPU each measurement runs in a process of its own (peak RSS cannot be reset below what a process has
    held). On CUDA, whose `max_memory_allocated` counts live tensors and resets, one spawned process measures them
    all: a GPU machine spends more on starting a process and loading the model than on the steps measured.
    """
    if resolve_device(specs[0].device).type == "cuda":
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(measure_all, specs, rounds, run_here).result()
    return measure_all(specs, rounds, run_isolated)


def measure_all(
    specs: list[RunSpec], rounds: int, run: Callable[[Callable[[RunSpec], Result], RunSpec], Result]
) -> list[Result]:
    """`run_all`'s passes, each measurement through `run`."""
    results = []
    for spec in specs:
        results.append(run(measure_memory, spec))
        _progress(results[-1], "memory")
    for round_index in range(rounds):
        pairs = list(zip(specs, results, strict=True))
        shift = round_index % len(pairs)
        for spec, result in pairs[shift:] + pairs[:shift]:
            if result.error:
                continue
            timing = run(measure_time, spec)
            if timing.error:
                result.error = timing.error
            else:
                result.gen_tokens = timing.gen_tokens
                result.add_samples(timing.samples)
            _progress(result, f"timing round {round_index + 1}/{rounds}")
    return results


def _progress(result: Result, stage: str) -> None:
    if result.error:
        status = f"error: {result.error}"
    else:
        status = f"+{result.peak_growth_bytes / MIB:,.1f} MiB peak, {result.step_cpu_s * 1e3:,.0f} ms CPU/step"
    print(f"[{result.variant}] {stage}: {status}", file=sys.stderr, flush=True)
