"""Quantized bases (bitsandbytes `Linear4bit`/`Linear8bitLt`, `nn.Linear` with a torchao weight), read dequantized and
merged by requantizing (keeping the replaced weight, which unmerge restores bit for bit). Other kinds are recognised by
package or class name, without importing their libraries, and refused."""

from __future__ import annotations

import copy
import re
from typing import Any, NamedTuple

import torch
from peft.utils.quantization_utils import Bnb4bitBackend, Bnb8bitBackend, QuantizationBackend, TorchaoBackend
from torch import nn

from .tuner.layer import FULL_PRECISION_HINT
from .tuner.selection import rows_per_block

# Quantized linear layers NeuroAda cannot read, by the package that defines them.
_UNSUPPORTED_PACKAGES = {
    "auto_gptq": "GPTQ (AutoGPTQ)",
    "gptqmodel": "GPTQ/AWQ (GPT-QModel)",
    "awq": "AWQ (AutoAWQ)",
    "optimum": "optimum-quanto",
    "compressed_tensors": "compressed-tensors",
    "neural_compressor": "Intel Neural Compressor",
    "transformer_engine": "Transformer Engine",
    "fp_quant": "FP-Quant",
    "spqr_quant": "SpQR",
    **{package: package.upper() for package in ("hqq", "eetq", "aqlm", "vptq", "higgs")},
}
# ... and by class name, for copies of those classes defined elsewhere (transformers ships several).
_UNSUPPORTED_CLASS_NAMES = re.compile(
    r"QuantLinear|^WQLinear|^HQQLinear$|^EetqLinear$|^QuantizedLinear$|^PatchedLinear$|^QLinear$|Fp8Linear$|"
    r"FP8Linear$|^BitLinear$|^AutoBitLinear$|^HiggsLinear$|^SpQRLinear$|^FPQuantLinear$|^NVFP4Linear$"
)
_BNB_4BIT = ("Linear4bit", "LinearFP4", "LinearNF4")
_BNB_8BIT = ("Linear8bitLt",)

CPU_PACKED_HINT = (
    "bitsandbytes has packed its 4-bit weight for AVX512-BF16 CPU inference (the first eval-mode forward without "
    "gradients does that), a layout bitsandbytes converts back only approximately. Load the model again and add or "
    "load the adapter before running the model in inference mode (NeuroAda then keeps the layers it adapts unpacked)"
)


def _package(obj: Any) -> str:
    return type(obj).__module__.split(".", 1)[0]


def _is_torchao(weight: Any) -> bool:
    return type(weight).__module__.startswith("torchao.")


def unsupported_quantization(base: nn.Module) -> str | None:
    """Why `base` is a quantized layer NeuroAda cannot adapt (None: it is plain or a supported kind)."""
    cls, package = type(base), _package(base)
    kind = f"{cls.__module__}.{cls.__qualname__}"
    if package == "bitsandbytes":
        if cls.__name__ not in _BNB_4BIT + _BNB_8BIT:
            return f"it is a bitsandbytes {cls.__name__} ({kind}); only Linear4bit and Linear8bitLt are supported"
        if cls.__name__ in _BNB_8BIT and base.state.has_fp16_weights:
            return "it is a bitsandbytes Linear8bitLt with has_fp16_weights=True (8-bit training mode)"
        return None
    if package in _UNSUPPORTED_PACKAGES:
        return f"it is a {_UNSUPPORTED_PACKAGES[package]} quantized layer ({kind})"
    if cls.__module__.startswith("transformers.integrations.") or _UNSUPPORTED_CLASS_NAMES.search(cls.__name__):
        return f"it is a quantized layer NeuroAda does not support ({kind})"
    if any(hasattr(base, name) for name in ("qweight", "W_q", "qzeros")):
        return f"it holds packed quantized weights ({kind})"
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.is_meta or (_is_torchao(weight) and isinstance(base, nn.Linear)):
        return None
    if _is_torchao(weight):
        return f"it is a {cls.__name__} with a torchao {type(weight).__name__} weight; only nn.Linear is supported"
    if not weight.dtype.is_floating_point:
        return f"its weight is stored as {weight.dtype} by {kind}, a quantization NeuroAda does not know"
    return None


def unreadable_quantized_weight(base: nn.Module) -> str | None:
    """Why the values of a supported quantized layer cannot be read as it is now (None: they can)."""
    if _package(base) == "bitsandbytes":
        weight, state = base.weight, None
        if type(base).__name__ in _BNB_4BIT:
            state = weight.quant_state
            quantized = weight.bnb_quantized and (state is not None or base.quant_state is not None)
        else:
            quantized = weight.dtype == torch.int8
        if not quantized:
            return (
                "its bitsandbytes weight is not quantized yet (bitsandbytes quantizes when the layer is moved to its "
                "device): call `model.to(device)` first, or load the model with `quantization_config=...`"
            )
        if getattr(state, "packing_format_for_cpu", False):
            return CPU_PACKED_HINT
    elif _is_torchao(getattr(base, "weight", None)) and not callable(getattr(base.weight, "dequantize", None)):
        return f"its torchao {type(base.weight).__name__} weight cannot be dequantized"
    return None


class Snapshot(NamedTuple):
    """What a quantized layer held before a merge replaced its weight (put back as is on unmerge)."""

    module: nn.Module
    attributes: dict[str, Any]
    weight_state: dict[str, Any]  # the weight's own attributes: peft's requantizing marks the replaced one unquantized

    @classmethod
    def of(cls, module: nn.Module, attributes: dict[str, Any]) -> Snapshot:
        return cls(module, attributes, dict(vars(attributes["weight"])))

    def __call__(self) -> None:
        """Put it back (the tuner's layers restore a merged quantized weight by calling its snapshot)."""
        vars(self.attributes["weight"]).update(self.weight_state)
        for name, value in self.attributes.items():
            setattr(self.module, name, value)


class QuantizedLinear:
    """A quantized linear layer seen as its dequantized (d_out, d_in) float32 weight: indexing dequantizes only the
    rows asked for, a block at a time, unless they do not dequantize alone (`reads_rows`). Subclasses define
    `_dequantized_rows` and `replace` (requantize a (d_out, d_in) weight and install it)."""

    kind: str
    dtype = torch.float32

    def __init__(self, base: nn.Module, backend: QuantizationBackend) -> None:
        self.base, self.backend, self.device = base, backend, base.weight.device
        self.shape = torch.Size((base.out_features, base.in_features))
        self._whole: torch.Tensor | None = None

    def __getitem__(self, index: slice | torch.Tensor) -> torch.Tensor:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.shape[0])
            if step != 1:
                raise IndexError("QuantizedLinear reads contiguous blocks of rows only.")
            return self.rows(start, stop)
        rows = index.long().reshape(-1)
        out = torch.empty(rows.numel(), self.shape[1], dtype=self.dtype, device=self.device)
        block = rows_per_block(self.shape[1])
        for start in range(0, self.shape[0], block):
            wanted = ((rows >= start) & (rows < start + block)).nonzero().squeeze(1)
            if wanted.numel():
                out[wanted] = self.rows(start, min(start + block, self.shape[0]))[rows[wanted] - start]
        return out

    def rows(self, start: int, stop: int) -> torch.Tensor:
        if self._whole is None and self.reads_rows():
            return self._dequantized_rows(start, stop).float()
        return self.dense()[start:stop]

    def dense(self) -> torch.Tensor:
        if self._whole is None:
            self._whole = self._dequantized().float()
        return self._whole

    def reads_rows(self) -> bool:
        """Whether a block of rows dequantizes on its own, exactly as within the whole layer."""
        return True

    def _dequantized(self) -> torch.Tensor:
        return self.backend.get_base_weight(self.base)

    def get_base_layer(self) -> nn.Module:  # (peft's backends requantize into `peft_layer.get_base_layer()`)
        return self.base

    def replace(self, weight: torch.Tensor) -> None:
        """Quantize a (d_out, d_in) weight again as the layer's was, with peft's backend, and install it."""
        self.backend.set_base_weight(self, weight.to(self._float_dtype()))

    def _float_dtype(self) -> torch.dtype:
        return torch.float32

    def merge_refusal(self) -> str | None:
        """Why deltas cannot be merged into this layer (checked before any layer changes), or None."""
        return None

    def snapshot(self) -> Snapshot:
        return Snapshot.of(self.base, {"weight": self.base.weight})


class Bnb4bit(QuantizedLinear):
    """bitsandbytes `Linear4bit`: 4-bit codes in blocks of `blocksize` values of the flattened weight, with one scale
    per block (`absmax`, itself 8-bit quantized under double quantization)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__(base, Bnb4bitBackend())
        self.state = base.weight.quant_state if base.weight.quant_state is not None else base.quant_state
        self.kind = f"bitsandbytes 4-bit ({self.state.quant_type})"
        self._scales: torch.Tensor | None = None

    def reads_rows(self) -> bool:
        # Scale blocks spanning rows (d_in not a multiple of blocksize) read differently in bitsandbytes' CPU kernel.
        return self.shape[1] % self.state.blocksize == 0

    def merge_refusal(self) -> str | None:
        return CPU_PACKED_HINT if getattr(self.state, "packing_format_for_cpu", False) else None

    def _functional(self) -> Any:
        if reason := self.merge_refusal():
            raise ValueError(f"NeuroAda cannot read this 4-bit weight: {reason}")
        import bitsandbytes.functional

        return bitsandbytes.functional

    def _dequantized(self) -> torch.Tensor:
        self._functional()  # refuses a CPU-packed weight
        return super()._dequantized()

    def _dequantized_rows(self, start: int, stop: int) -> torch.Tensor:
        functional, state, d_in = self._functional(), self.state, self.shape[1]
        if self._scales is None:  # 1/blocksize of the layer's size, dequantized once
            scales = state.absmax
            if state.nested:
                scales = functional.dequantize_blockwise(scales, state.state2) + state.offset
            self._scales = scales.float()
        blocks_per_row = d_in // state.blocksize
        scales = self._scales[start * blocks_per_row : stop * blocks_per_row]
        same = {name: getattr(state, name) for name in ("code", "blocksize", "quant_type", "dtype")}
        rows_state = functional.QuantState(absmax=scales, shape=torch.Size((stop - start, d_in)), **same)
        codes = self.base.weight.data.view(torch.uint8).reshape(-1)  # two 4-bit codes per byte
        return functional.dequantize_4bit(codes[start * d_in // 2 : stop * d_in // 2], rows_state)

    def snapshot(self) -> Snapshot:
        return Snapshot.of(self.base, {"weight": self.base.weight, "quant_state": self.base.quant_state})

    def _float_dtype(self) -> torch.dtype:
        return self.state.dtype


class Bnb8bit(QuantizedLinear):
    """bitsandbytes `Linear8bitLt`: int8 codes with one scale per row (`SCB`), so any block of rows reads alone."""

    kind = "bitsandbytes 8-bit"

    def __init__(self, base: nn.Module) -> None:
        super().__init__(base, Bnb8bitBackend())

    def _dequantized_rows(self, start: int, stop: int) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        scales = self.base.weight.SCB if self.base.weight.SCB is not None else self.base.state.SCB
        return bnb_functional.int8_vectorwise_dequant(self.base.weight.data[start:stop], scales[start:stop])

    def snapshot(self) -> Snapshot:
        return Snapshot.of(self.base, {"weight": self.base.weight, "state": copy.copy(self.base.state)})


class Torchao(QuantizedLinear):
    """An `nn.Linear` with a torchao weight; `requantize_with`: the config the model was loaded with, to merge."""

    def __init__(self, base: nn.Module, requantize_with: Any = None) -> None:
        super().__init__(base, TorchaoBackend(lambda: requantize_with))
        self.kind = f"torchao {type(base.weight).__name__}"
        self.requantize_with = requantize_with
        self._slices: bool | None = None

    def reads_rows(self) -> bool:
        # Most torchao tensors slice along rows (and dequantize the slice alone); found out once per layer.
        if self._slices is None:
            try:
                self.base.weight[:1].dequantize()
                self._slices = True
            except (NotImplementedError, RuntimeError, TypeError, IndexError):
                self._slices = False
        return self._slices

    def _dequantized_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.base.weight[start:stop].dequantize()

    def _dequantized(self) -> torch.Tensor:
        try:
            return self.base.weight.dequantize()
        except NotImplementedError as error:
            raise TypeError(f"NeuroAda cannot read a {self.kind} weight: it cannot be dequantized.") from error

    def merge_refusal(self) -> str | None:
        if self.requantize_with is None:
            return (
                f"the torchao config its {type(self.base.weight).__name__} weight was quantized with is unknown, so "
                "the merged weight cannot be quantized again (load the base model through transformers with "
                "`quantization_config=TorchAoConfig(...)` to merge)"
            )
        return None

    def replace(self, weight: torch.Tensor) -> None:
        if reason := self.merge_refusal():
            raise ValueError(f"Cannot merge into this layer: {reason}. {FULL_PRECISION_HINT}")
        old = self.base.weight
        self.backend.set_base_weight(self, weight.to(device=old.device, dtype=old.dtype))
        if not _is_torchao(self.base.weight):
            raise ValueError(
                f"Requantizing a {self.kind} weight with {type(self.requantize_with).__name__} left it unquantized. "
                + FULL_PRECISION_HINT
            )


def quantized_linear(base: nn.Module, requantize_with: Any = None) -> QuantizedLinear | None:
    """The quantized view of `base` (None: plain float); `requantize_with`: the torchao config for merged weights."""
    if _package(base) == "bitsandbytes":
        return Bnb4bit(base) if type(base).__name__ in _BNB_4BIT else Bnb8bit(base)
    if _is_torchao(getattr(base, "weight", None)):
        return Torchao(base, requantize_with)
    return None


def keep_standard_layout(base: nn.Module) -> None:
    """Stop bitsandbytes packing this 4-bit layer for AVX512-BF16 CPU inference (on its first eval forward without
    gradients): every save's `state_dict()` unpacks it only approximately, silently changing the model."""
    if hasattr(base, "support_avx512bf16_for_cpu"):
        base.support_avx512bf16_for_cpu = False


def torchao_config_of(model: nn.Module) -> Any:
    """The torchao config transformers quantized `model` with (None if it was not loaded that way)."""
    config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    get_config = getattr(config, "get_apply_tensor_subclass", None)
    return get_config() if callable(get_config) else None
