"""`neuroada estimate`: the memory a training run takes, per method, before any weight is loaded or downloaded.

The model is built from its config on the meta device (shapes and dtypes, no storage). Weights, gradients and AdamW's
state are counted from them; what backward keeps is traced: one forward pass on meta tensors records each tensor
autograd saves (each storage once, weights excluded), so the count follows the architecture's own code. Attention is
traced as the memory-efficient kernels run it (PyTorch's flash kernel on the CPU, FlashAttention or memory-efficient
SDPA on CUDA: query, key, value, output and log-sum-exp), where SDPA on meta tensors would take the math kernel and
keep every seq x seq attention matrix. What the estimate cannot know is said with the table: the allocator's caching
and fragmentation, library workspaces and the CUDA context, and temporaries inside one op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from ..budget import lora_rank_for_k, neuroada_parameter_count, targeted_shapes
from ..targets import targeted_modules
from ..tuner.config import DTYPES, NeuroAdaConfig
from ..tuner.index_storage import to_buffer

METHODS = ("neuroada", "lora", "mask", "full", "frozen")  # cli.ESTIMATE_METHODS spells them out too
DEVICES = ("cuda", "cpu")  # where AdamW steps: torch's default implementation differs (Estimator.adamw)
# torch's AdamW implementations, by the temporaries their step allocates (Estimator._estimate): "foreach" (CUDA's
# default) one square root of every second moment at once; "for-loop" (the CPU's) a square root and its quotient of
# one tensor at a time; "fused" (`fused=True`) none.
ADAMW_IMPLEMENTATIONS = ("foreach", "for-loop", "fused")
# Bytes per entry of a targeted weight for mask-based tuning's mask: a torch.bool tensor; packed bits; a tensor in
# the weight's own dtype, 2 bytes in bf16, as the paper code builds it (`torch.ones_like(weight)`, select_para.py).
MASK_BYTES = {"bool": 1.0, "bit": 1 / 8, "bfloat16": 2.0}
ADAPTER_DTYPE = torch.float32  # peft keeps an adapter of a 16-bit model in float32 (`autocast_adapter_dtype`)
ADAMW_STATES = 2  # exp_avg and exp_avg_sq, each the size and dtype of its parameter
# bitsandbytes' NF4 with double quantization: 4 bits a weight, an 8-bit absmax per block of 64 and a float32 absmax
# per 256 of those.
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)
UNKNOWN = (
    "Not counted: the allocator's caching and fragmentation (CUDA's caching allocator rounds and keeps blocks; "
    "PyTorch's reserved memory can exceed this by 10-30%), the CUDA context and library workspaces (cuBLAS, oneDNN: "
    "several hundred MiB), and temporaries inside one op (the optimizer step's are counted for torch's AdamW). "
    "Activations are traced with the memory-efficient attention kernels and without gradient checkpointing."
)


@dataclass(frozen=True)
class Estimate:
    """One method at one budget, in bytes."""

    method: str
    trainable: int
    weights: int  # the base model's weights and the adapter's own tensors (NeuroAda: values and column indices)
    gradients: int
    optimizer: int
    activations: int  # what backward keeps
    loss_gradient: int  # the largest temporary: the loss's float32 gradient over the vocabulary, at backward's start
    step_temporaries: int  # AdamW's own temporaries during its step

    @property
    def total(self) -> int:
        """The peak: over the weights and optimizer state, either the start of backward (what it keeps and the loss's
        gradient) or the optimizer step (every gradient and the step's temporaries), whichever is larger; in between,
        activations are freed as gradients come."""
        at_step = self.gradients + self.step_temporaries
        return self.weights + self.optimizer + max(self.activations + self.loss_gradient, at_step)


def load_config(model: str) -> PretrainedConfig:
    """A config.json file, a folder holding one, or a hub id (only its config.json is downloaded)."""
    path = Path(model)
    if path.is_file():
        return AutoConfig.from_pretrained(path.parent if path.name == "config.json" else path)
    return AutoConfig.from_pretrained(model)


def meta_model(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of `config` on the meta device. An encoder (BERT, RoBERTa: transformers maps them to a causal LM
    head too) is refused: its step, a classifier's or a masked LM's, is not that model's."""
    named = config.architectures or []
    causal = any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in named)
    if not causal and (named or config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        raise ValueError(
            f"neuroada estimate covers causal language models; this {config.model_type} config describes "
            f"{', '.join(named) or 'an encoder'}"
        )
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as error:
        raise ValueError(f"neuroada estimate covers causal language models: {error}") from None
    return model.requires_grad_(False)


class MemoryEfficientAttention(TorchFunctionMode):
    """Within the trace, scaled_dot_product_attention runs as PyTorch's flash kernel, whose meta function keeps what
    the memory-efficient kernels keep (see the module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        options = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), rest, strict=False)) | kwargs
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return kernel(
            query,
            key,
            value,
            options.get("dropout_p", 0.0),
            options.get("is_causal", False),
            attn_mask=options.get("attn_mask"),
            scale=options.get("scale"),
        )[0]


def saved_bytes(model: nn.Module, batch: int, seq: int) -> int:
    """Bytes autograd keeps for backward over one forward pass of `batch` x `seq` tokens on meta tensors."""
    weights = {tensor.untyped_storage()._cdata for tensor in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:
            kept[storage._cdata] = storage.nbytes()
        return tensor

    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), MemoryEfficientAttention():
        loss = model(input_ids=ids, labels=ids).loss  # held, so no kept storage is freed and its address reused
    del loss
    return sum(kept.values())


@contextlib.contextmanager
def trained(parameters: list[nn.Parameter]) -> Iterator[None]:
    for parameter in parameters:
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter in parameters:
            parameter.requires_grad_(False)


def weight_bytes(model: nn.Module, quantize: str | None) -> int:
    """The base model's weights: NF4 for the decoder's linear layers when quantized (the LM head stays unquantized,
    as transformers loads it), the model's dtype for the rest."""
    total = 0
    for name, parameter in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        if quantize and isinstance(owner, nn.Linear) and owner is not model.get_output_embeddings():
            total += round(parameter.numel() * NF4_BYTES_PER_WEIGHT)
        else:
            total += parameter.numel() * parameter.element_size()
    return total


def index_bytes(shapes: list[tuple[int, int]], k: int) -> int:
    """NeuroAda's column indices, as its layers store them (index_storage.to_buffer, on meta tensors)."""
    total = 0
    for d_out, d_in in shapes:
        buffer = to_buffer(torch.empty(d_out, min(k, d_in), dtype=torch.long, device="meta"), d_in)
        total += buffer.numel() * buffer.element_size()
    return total


class Estimator:
    """Every method's estimate on one meta model, for one batch shape."""

    def __init__(
        self,
        config: PretrainedConfig,
        dtype: torch.dtype,
        batch: int,
        seq: int,
        quantize: str | None = None,
        device: str = "cuda",
        adamw: str | None = None,
    ) -> None:
        self.model, self.batch, self.seq, self.quantize = meta_model(config, dtype), batch, seq, quantize
        if device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
        if adamw is not None and adamw not in ADAMW_IMPLEMENTATIONS:
            raise ValueError(f"adamw must be one of {', '.join(ADAMW_IMPLEMENTATIONS)}, not {adamw!r}")
        self.device = device
        self.adamw = adamw or ("foreach" if device == "cuda" else "for-loop")  # torch's default on that device
        self.weights = weight_bytes(self.model, quantize)
        self.targets = [module.weight for _, module in targeted_modules(self.model, NeuroAdaConfig())]
        self.shapes = targeted_shapes(self.model, NeuroAdaConfig())
        if not self.shapes:
            raise ValueError("No layer of this model is one of NeuroAda's default targets; nothing to estimate.")
        vocabulary = self.model.get_output_embeddings().weight.shape[0]
        self.loss_gradient = 2 * batch * seq * vocabulary * 4  # float32: the gradient at the loss and at its input

    def _saved(self, parameters: list[nn.Parameter]) -> int:
        with trained(parameters):
            return saved_bytes(self.model, self.batch, self.seq)

    def _estimate(
        self, method: str, trainable: int, own: int, trained: list[int], saved: int, moments: list[int] | None = None
    ) -> Estimate:
        """`own`: the adapter's tensors; `trained`: the bytes of each tensor AdamW updates (the size of its gradient);
        `moments`: the bytes of each of AdamW's two states for it (by default, as its gradient)."""
        moments = trained if moments is None else moments
        temporaries = {
            "foreach": sum(moments),  # one square-root copy of every second moment at once
            "for-loop": 2 * max(moments, default=0),  # a square root and its quotient of the largest tensor
            "fused": 0,
        }[self.adamw]
        return Estimate(
            method,
            trainable,
            self.weights + own,
            sum(trained),
            ADAMW_STATES * sum(moments),
            saved,
            self.loss_gradient,
            temporaries,
        )

    def frozen(self) -> Estimate:
        """The floor: no parameter trains, the input gradients still flow (what any adapter pays at least)."""
        embeddings = self.model.get_input_embeddings()
        handle = embeddings.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
        try:
            saved = self._saved([])
        finally:
            handle.remove()
        return Estimate("frozen", 0, self.weights, 0, 0, saved, self.loss_gradient, 0)

    def neuroada(self, k: int) -> Estimate:
        """NeuroAda keeps exactly what the targeted weights' own gradients would (each layer's input); its deltas and
        their gradients never take a dense shape."""
        trainable = neuroada_parameter_count(self.shapes, k)
        deltas = [d_out * min(k, d_in) * ADAPTER_DTYPE.itemsize for d_out, d_in in self.shapes]
        own = sum(deltas) + index_bytes(self.shapes, k)
        return self._estimate(f"NeuroAda k={k}", trainable, own, deltas, self._saved(self.targets))

    def lora(self, k: int) -> Estimate:
        """LoRA at the rank whose parameter count is closest to NeuroAda's with this k, traced with peft's LoRA."""
        rank = lora_rank_for_k(self.shapes, k)
        targets = sorted({name.rsplit(".", 1)[-1] for name, _ in targeted_modules(self.model, NeuroAdaConfig())})
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
        peft_model = get_peft_model(self.model, config)
        try:
            parameters = [parameter for parameter in peft_model.parameters() if parameter.requires_grad]
            saved = saved_bytes(peft_model, self.batch, self.seq)
        finally:
            self.model = peft_model.unload()
        trainable = sum(parameter.numel() for parameter in parameters)
        factors = [parameter.numel() * parameter.element_size() for parameter in parameters]
        return self._estimate(f"LoRA r={rank} (k={k}'s budget)", trainable, sum(factors), factors, saved)

    def mask(self, k: int, storage: str = "bool", moments: torch.dtype | None = None) -> Estimate:
        """Mask-based sparse tuning of NeuroAda's k entries: the targeted weights train whole, their gradients dense
        in the model's dtype, the mask (`storage`, a key of MASK_BYTES) applied to the gradient; AdamW's state dense
        in `moments` (by default the model's dtype, as torch's AdamW keeps it; float32 as mixed-precision optimizers
        keep it, their float32 master weights not counted)."""
        self._refuse_quantized("mask-based tuning")
        dense = [weight.numel() * weight.element_size() for weight in self.targets]
        state = dense if moments is None else [weight.numel() * moments.itemsize for weight in self.targets]
        masks = round(MASK_BYTES[storage] * sum(weight.numel() for weight in self.targets))
        trainable = neuroada_parameter_count(self.shapes, k)
        return self._estimate(f"mask-based k={k}", trainable, masks, dense, self._saved(self.targets), state)

    def full(self) -> Estimate:
        self._refuse_quantized("full fine-tuning")
        parameters = list(self.model.parameters())
        dense = [parameter.numel() * parameter.element_size() for parameter in parameters]
        trainable = sum(parameter.numel() for parameter in parameters)
        return self._estimate("full fine-tuning", trainable, 0, dense, self._saved(parameters))

    def _refuse_quantized(self, method: str) -> None:
        if self.quantize:
            raise ValueError(f"{method} trains the base weights, which a {self.quantize} model keeps frozen")


def estimate(
    model: str | PretrainedConfig,
    ks: list[int],
    methods: list[str],
    dtype: str = "bfloat16",
    batch: int = 1,
    seq: int = 512,
    quantize: str | None = None,
    device: str = "cuda",
) -> list[Estimate | tuple[str, str]]:
    """Each method at each k (LoRA at k's budget; mask-based with k's entries); a method that cannot run on this
    set-up is a (method, reason) pair instead."""
    config = model if isinstance(model, PretrainedConfig) else load_config(model)
    estimator = Estimator(config, DTYPES[dtype], batch, seq, quantize, device)
    rows: list[Estimate | tuple[str, str]] = []
    per_method: dict[str, Callable[[], list[Estimate]]] = {
        "frozen": lambda: [estimator.frozen()],
        "neuroada": lambda: [estimator.neuroada(k) for k in ks],
        "lora": lambda: [estimator.lora(k) for k in ks],
        "mask": lambda: [estimator.mask(k) for k in ks],
        "full": lambda: [estimator.full()],
    }
    for method in methods:
        try:
            rows += per_method[method]()
        except ValueError as error:
            rows.append((method, str(error)))
    return rows


def gib(count: int) -> str:
    return f"{count / 2**30:,.2f}"


def format_table(rows: list[Estimate | tuple[str, str]]) -> str:
    lines = [
        "| method | trainable | weights (GiB) | gradients | optimizer | activations | loss gradient "
        "| step temporaries | total (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if isinstance(row, tuple):
            lines.append(f"| {row[0]} | cannot run: {row[1]} | | | | | | | |")
            continue
        cells = [row.weights, row.gradients, row.optimizer, row.activations, row.loss_gradient, row.step_temporaries]
        cells.append(row.total)
        lines.append(f"| {row.method} | {row.trainable:,} | " + " | ".join(gib(cell) for cell in cells) + " |")
    return "\n".join(lines)
