"""`neuroada estimate`: the memory a training run takes, per method, before any weight is loaded or downloaded.

The model is built from its config on the meta device (shapes and dtypes, no storage). Weights, gradients and AdamW's
state are counted from them; what backward keeps is traced: one forward pass on meta tensors records each tensor
autograd saves (each storage once, weights excluded), so the count follows the architecture's own code. Attention is
traced as the memory-efficient kernels run it (PyTorch's flash kernel on the CPU, FlashAttention or memory-efficient
SDPA on CUDA: query, key, value, output and log-sum-exp), where SDPA on meta tensors would take the math kernel and
keep every seq x seq attention matrix. MoE experts' grouped matmul is traced by its shapes and saved tensors in every
dtype (its meta function takes bfloat16 alone). What the estimate cannot know is said with the table: the allocator's
caching and fragmentation, library workspaces and the CUDA context, and temporaries inside one op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import ParamWrapper as LoraParamWrapper
from torch import nn
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from ..budget import lora_rank_for_k, neuroada_parameter_count, targeted_shapes
from ..targets import targeted_modules, targeted_parameters
from ..tuner.config import DTYPES, NeuroAdaConfig
from ..tuner.selection import INDEX_DTYPE as BUFFER_DTYPE

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
    # An adapter on expert stacks (NeuroAda, LoRA): backward forms the dense gradient of each stack's per-forward copy
    # (`stack_gradient`), the largest net of the copies it has freed by then.
    stack_gradient: int = 0

    @property
    def total(self) -> int:
        """The peak: over the weights and optimizer state, either backward with what it keeps (at its start with the
        loss's gradient, or at an expert stack with that stack's gradient) or the optimizer step (every gradient and
        the step's temporaries), whichever is larger; in between, activations are freed as gradients come."""
        at_step = self.gradients + self.step_temporaries
        in_backward = self.activations + max(self.loss_gradient, self.stack_gradient)
        return self.weights + self.optimizer + max(in_backward, at_step)


def is_count(value: object) -> bool:
    """A whole number of at least 1: what k, a batch and a sequence length are (0 would estimate a run of nothing)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


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


class MetaKernels(TorchFunctionMode):
    """Within the trace, the kernels whose meta functions differ from a real run's: scaled_dot_product_attention runs
    as PyTorch's flash kernel, whose meta function keeps what the memory-efficient kernels keep (see the module's
    docstring), and the experts' grouped matmul as `GroupedMatmul`, in every dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm and GroupedMatmul.covers(*args, **kwargs):
            return GroupedMatmul.apply(*args[:2], kwargs.get("offs", args[2] if len(args) > 2 else None))
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


class GroupedMatmul(torch.autograd.Function):
    """torch._grouped_mm of (tokens, d_in) rows grouped by `offs` over a (groups, d_in, d_out) stack, as autograd
    records it: the output's shape and dtype, and what its backward keeps (the stack for the rows' gradient, the rows
    for the stack's, the offsets). Its meta function refuses all but bfloat16, while the CPU kernel, which
    transformers' experts run there, takes every dtype. The trace never runs backward."""

    @staticmethod
    def covers(mat_a: torch.Tensor, mat_b: torch.Tensor, *args, **kwargs) -> bool:
        """The experts' call (transformers' grouped_mm_experts_forward), on meta tensors."""
        plain = not args[1:] and kwargs.get("bias") is None and kwargs.get("out_dtype") is None
        return mat_a.is_meta and mat_a.dim() == 2 and mat_b.dim() == 3 and plain

    @staticmethod
    def forward(ctx, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        rows_need, stack_needs = ctx.needs_input_grad[:2]
        ctx.save_for_backward(mat_b if rows_need else None, offs, mat_a if stack_needs else None)
        return mat_a.new_empty(mat_a.shape[0], mat_b.shape[-1])


class StackCopy(nn.Module):
    """An adapter's copy of an expert stack W, made once per forward in W's size and dtype and requiring grad, that the
    experts read in place of W: their matmuls keep it for backward and form its dense gradient there. Each copy's
    bytes go to `reads`, in the order the forward makes them."""

    def __init__(self, reads: list[int]) -> None:
        super().__init__()
        self.reads = reads

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        self.reads.append(weight.numel() * weight.element_size())
        return self.copy(weight)

    def copy(self, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TransientCopy(StackCopy):
    """NeuroAda's (tuner/experts.py): W + P ⊙ Θ, whose backward keeps nothing."""

    def __init__(self, weight: torch.Tensor, reads: list[int]) -> None:
        super().__init__(reads)
        self.delta = torch.zeros((), dtype=weight.dtype, device=weight.device, requires_grad=True)

    def copy(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta


class FoldedFactors(StackCopy):
    """peft's LoRA's (`_LoraFactorsProxy`, where peft has it): W + s · B A per expert, one baddbmm, which keeps both
    factors. peft runs it under torch.autocast(device_type=W.device.type), which the meta device does not have, so
    within the trace its wrappers step aside for this one."""

    def __init__(self, wrapper: LoraParamWrapper, reads: list[int]) -> None:
        super().__init__(reads)
        self.lhs, self.rhs, self.scaling = wrapper.get_delta_factors(wrapper.active_adapters[0])

    def copy(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(weight, self.lhs, self.rhs, alpha=self.scaling)


def stack_gradient(reads: list[int]) -> int:
    """The largest dense gradient of an expert stack's copy (`reads`, in forward order) net of the copies backward has
    freed before it: backward meets the copies in reverse order and frees each one's kept copy, as large as its
    gradient, once past it."""
    freed = largest = 0
    for size in reversed(reads):
        largest = max(largest, size - freed)
        freed += size
    return largest


@contextlib.contextmanager
def parametrized(stacks: Sequence[tuple[nn.Module, str, nn.Module]]) -> Iterator[None]:
    """Each (module, parameter name, parametrization) read through its parametrization, once per forward, as the
    adapters' wrappers make it."""
    for module, name, parametrization in stacks:
        parametrize.register_parametrization(module, name, parametrization, unsafe=True)
    try:
        with parametrize.cached():
            yield
    finally:
        for module, name, _ in stacks:
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)


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
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), MetaKernels():
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
    """NeuroAda's column indices, as its layers store them: (d_out, k) int32 per layer."""
    return sum(d_out * min(k, d_in) for d_out, d_in in shapes) * BUFFER_DTYPE.itemsize


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
        for name, value in (("batch", batch), ("seq", seq)):
            if not is_count(value):
                raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")
        self.model, self.batch, self.seq, self.quantize = meta_model(config, dtype), batch, seq, quantize
        if device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
        if adamw is not None and adamw not in ADAMW_IMPLEMENTATIONS:
            raise ValueError(f"adamw must be one of {', '.join(ADAMW_IMPLEMENTATIONS)}, not {adamw!r}")
        self.device = device
        self.adamw = adamw or ("foreach" if device == "cuda" else "for-loop")  # torch's default on that device
        self.weights = weight_bytes(self.model, quantize)
        self.layers = [module.weight for _, module in targeted_modules(self.model, NeuroAdaConfig())]
        self.stacks = [name for name, _ in targeted_parameters(self.model, NeuroAdaConfig())]  # experts' parameters
        self.targets = self.layers + [self.model.get_parameter(name) for name in self.stacks]  # what NeuroAda adapts
        self.shapes = targeted_shapes(self.model, NeuroAdaConfig())
        if not self.shapes:
            raise ValueError("No layer of this model is one of NeuroAda's default targets; nothing to estimate.")
        vocabulary = self.model.get_output_embeddings().weight.shape[0]
        self.loss_gradient = 2 * batch * seq * vocabulary * 4  # float32: the gradient at the loss and at its input

    def _saved(self, parameters: list[nn.Parameter], stacks: Sequence[tuple[nn.Module, str, nn.Module]] = ()) -> int:
        """What backward keeps with `parameters` trained and `stacks` parametrized (`parametrized`)."""
        with trained(parameters), parametrized(stacks):
            return saved_bytes(self.model, self.batch, self.seq)

    def _stack(self, name: str) -> tuple[nn.Module, str]:
        owner, _, attribute = name.rpartition(".")
        return self.model.get_submodule(owner), attribute

    def _estimate(
        self,
        method: str,
        trainable: int,
        own: int,
        trained: list[int],
        saved: int,
        moments: list[int] | None = None,
        stacks: int = 0,
    ) -> Estimate:
        """`own`: the adapter's tensors; `trained`: the bytes of each tensor AdamW updates (the size of its gradient);
        `moments`: the bytes of each of AdamW's two states for it (by default, as its gradient); `stacks`: the
        Estimate's `stack_gradient`."""
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
            stacks,
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
        """NeuroAda's layers keep exactly what their weights' own gradients would (each layer's input); its expert
        stacks keep the copy W + P ⊙ Θ each forward makes, and what the experts' matmuls keep for its gradient. Its
        deltas and their gradients never take a dense shape."""
        trainable = neuroada_parameter_count(self.shapes, k)
        deltas = [d_out * min(k, d_in) * ADAPTER_DTYPE.itemsize for d_out, d_in in self.shapes]
        own = sum(deltas) + index_bytes(self.shapes, k)
        reads: list[int] = []
        copies = [(*self._stack(name), TransientCopy(self.model.get_parameter(name), reads)) for name in self.stacks]
        saved = self._saved(self.layers, copies)
        return self._estimate(f"NeuroAda k={k}", trainable, own, deltas, saved, stacks=stack_gradient(reads))

    def lora(self, k: int) -> Estimate:
        """LoRA at the rank whose parameter count is closest to NeuroAda's with this k, on NeuroAda's targets (expert
        stacks through `target_parameters`), traced with peft's LoRA (its expert wrappers as `FoldedFactors`)."""
        rank = lora_rank_for_k(self.shapes, k)
        targets = sorted({name.rsplit(".", 1)[-1] for name, _ in targeted_modules(self.model, NeuroAdaConfig())})
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, target_parameters=self.stacks)
        peft_model = get_peft_model(self.model, config)
        # peft releases without `get_delta_factors` add a materialised delta without torch.autocast: traced as they run
        folds = hasattr(LoraParamWrapper, "get_delta_factors")
        wrappers = [module for module in peft_model.modules() if folds and isinstance(module, LoraParamWrapper)]
        try:
            parameters = [parameter for parameter in peft_model.parameters() if parameter.requires_grad]
            reads: list[int] = []
            folded = [(w.get_base_layer(), w.parameter_name, FoldedFactors(w, reads)) for w in wrappers]
            for wrapper in wrappers:
                wrapper._disable_adapters = True  # its forward calls the experts, which read `folded`
            with parametrized(folded):
                saved = saved_bytes(peft_model, self.batch, self.seq)
        finally:
            self.model = peft_model.unload()
        trainable = sum(parameter.numel() for parameter in parameters)
        factors = [parameter.numel() * parameter.element_size() for parameter in parameters]
        method = f"LoRA r={rank} (k={k}'s budget)"
        return self._estimate(method, trainable, sum(factors), factors, saved, stacks=stack_gradient(reads))

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
    if not ks or (bad := next((k for k in ks if not is_count(k)), None)) is not None:
        raise ValueError(f"k must be whole numbers of at least 1, not {ks if not ks else bad!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
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
    """A markdown table; the expert stacks' gradient gets a column where any row has one."""
    stacks = any(isinstance(row, Estimate) and row.stack_gradient for row in rows)
    columns = ["weights (GiB)", "gradients", "optimizer", "activations", "loss gradient"]
    columns += ["expert stack gradient"] * stacks + ["step temporaries", "total (GiB)"]
    lines = [f"| method | trainable | {' | '.join(columns)} |", "|---|" + "---:|" * (len(columns) + 1)]
    for row in rows:
        if isinstance(row, tuple):
            lines.append(f"| {row[0]} | cannot run: {row[1]} |" + " |" * len(columns))
            continue
        cells = [row.weights, row.gradients, row.optimizer, row.activations, row.loss_gradient]
        cells += [row.stack_gradient] * stacks + [row.step_temporaries, row.total]
        lines.append(f"| {row.method} | {row.trainable:,} | " + " | ".join(gib(cell) for cell in cells) + " |")
    return "\n".join(lines)
