"""YAML recipes: which model, which adapter method, which data, how to train and how to evaluate, and under which
protocol (`paper` or `lenient`, see protocols.py) both are done.

A recipe file mirrors the dataclasses below section by section; unknown keys are errors so a typo cannot be
silently ignored. `extends: other.yaml` starts from another recipe, so method variants share one base file.
Any value can be overridden from the command line with `--set section.key=value`.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from peft import LoraConfig, PeftConfig

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.tuner.config import DTYPES

from .glue import GlueTask, glue_task
from .protocols import PROTOCOLS


class RecipeError(ValueError):
    """A recipe or an override names something wrong: the command prints the message alone, without a traceback."""


@dataclass
class MethodSpec:
    """The adapter: `neuroada` (k deltas per neuron, stored in `delta_dtype`; null follows peft, which keeps them in
    float32 on half-precision bases) or `lora` (rank r, scale alpha / r) as the baseline."""

    name: Literal["neuroada", "lora"] = "neuroada"
    k: int = 1
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: list[str] | str | None = None
    delta_dtype: str | None = None

    def peft_config(self, task_type: str = "CAUSAL_LM", modules_to_save: list[str] | None = None) -> PeftConfig:
        """The method's peft config; a sequence classifier (`SEQ_CLS`) passes its head as `modules_to_save`."""
        if self.name == "neuroada":
            return NeuroAdaConfig(
                k=self.k,
                target_modules=self.target_modules,
                delta_dtype=self.delta_dtype,
                task_type=task_type,
                modules_to_save=modules_to_save,
            )
        if self.name == "lora":
            if self.delta_dtype is not None:
                raise RecipeError("method.delta_dtype is NeuroAda's; LoRA keeps peft's adapter dtype.")
            return LoraConfig(
                r=self.r,
                lora_alpha=self.alpha,
                lora_dropout=self.dropout,
                target_modules=self.target_modules or "all-linear",
                task_type=task_type,
                modules_to_save=modules_to_save,
            )
        raise RecipeError(f"method.name must be 'neuroada' or 'lora' (got {self.name!r}).")

    @property
    def label(self) -> str:
        return f"neuroada k={self.k}" if self.name == "neuroada" else f"lora r={self.r}"


@dataclass
class DataSpec:
    """Training data: the union of `train` data sets in `dir`, `train_size` random examples of it (all if null).
    `dir` is relative to where `neuroada` runs; the default is a `dataset/` folder there (LLM-Adapters' name)."""

    dir: str = "dataset"
    train: list[str] = field(default_factory=lambda: ["commonsense_15k"])
    train_size: int | None = None
    max_length: int = 256
    seed: int = 42


@dataclass
class TrainingSpec:
    """Trainer settings (AdamW, linear decay). `warmup` below 1 is a fraction of all steps, else a step count.
    `max_steps` > 0 overrides `epochs`. `bf16: auto` uses bf16 mixed precision on GPUs that support it.

    `loss_average` is how a generation recipe's loss weighs its tokens when `gradient_accumulation_steps` > 1:
    `batch` gives every label token of the whole accumulated batch the same weight (transformers >= 4.46);
    `micro_batch` averages each micro-batch of `batch_size` examples over its own tokens and then the micro-batches
    (transformers < 4.46, which the official code ran on: the paper recipes use it). A GLUE classifier's loss is a
    mean over examples, so it always averages each micro-batch."""

    learning_rate: float = 1e-3
    batch_size: int = 16
    gradient_accumulation_steps: int = 1
    warmup: float = 0.06
    epochs: float = 3.0
    max_steps: int = -1
    weight_decay: float = 0.0
    lr_scheduler: str = "linear"
    logging_steps: int = 10
    save_steps: int = 500
    bf16: Literal["auto", True, False] = "auto"
    loss_average: Literal["batch", "micro_batch"] = "batch"

    def __post_init__(self) -> None:
        if self.loss_average not in ("batch", "micro_batch"):
            raise RecipeError(f"training.loss_average must be 'batch' or 'micro_batch' (got {self.loss_average!r}).")


@dataclass
class EvaluationSpec:
    """Test sets scored after training; `size` random examples per task (all if null). Of the two generation
    budgets the lenient protocol gives `options` to tasks whose answer is an option (AQuA's letters too) and
    `number` to arithmetic; the paper protocol gives `options` to commonsense and `number` to math tasks (AQuA
    included), as the official code's 32 and 512 new tokens. `merge` merges the adapter into the weights before
    evaluating; null merges under the paper protocol (the official code evaluates the merged model) and not
    otherwise. A GLUE recipe scores its task's held-out validation examples and names no `tasks`."""

    tasks: list[str] = field(default_factory=list)
    size: int | None = None
    batch_size: int = 16
    max_new_tokens_options: int = 32
    max_new_tokens_number: int = 256
    seed: int = 42
    merge: bool | None = None

    @property
    def max_new_tokens(self) -> dict[str, int]:
        return {"options": self.max_new_tokens_options, "number": self.max_new_tokens_number}


@dataclass
class Recipe:
    """One fine-tuning run. `model` is a local path / hub id, or `default` for the embedded SmolLM2-135M-Instruct;
    `dtype` is the dtype its frozen weights are loaded in (bf16 mixed precision is `training.bf16`). `protocol`
    decides prompts, tokenisation, generation budgets and scoring, for training and evaluation alike.

    `task` is what the run trains: `generation`, a causal LM answering the data sets' prompts (commonsense, math,
    your own), or `glue`, a sequence classifier with a trained head on the one GLUE task in `data.train`, scored on
    that task's validation set (glue.py). `seed` is the run's one seed, where the official code takes `--seed`:
    the Trainer's (a new head's initial values, the data order, neither drawn as in the official runs) and for GLUE
    the validation split's (drawn as there). The paper tunes with 42 and reports seeds 43-46 (`--set seed=43`)."""

    name: str
    output_dir: str
    model: str = "default"
    dtype: str = "float32"
    protocol: Literal["paper", "lenient"] = "lenient"
    task: Literal["generation", "glue"] = "generation"
    seed: int = 42
    method: MethodSpec = field(default_factory=MethodSpec)
    data: DataSpec = field(default_factory=DataSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    evaluation: EvaluationSpec = field(default_factory=EvaluationSpec)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise RecipeError(f"dtype must be one of {sorted(DTYPES)} (got {self.dtype!r}).")
        if self.protocol not in PROTOCOLS:
            raise RecipeError(f"protocol must be one of {sorted(PROTOCOLS)} (got {self.protocol!r}).")
        if self.task not in ("generation", "glue"):
            raise RecipeError(f"task must be 'generation' or 'glue' (got {self.task!r}).")
        try:  # the method's own checks, before any model loads
            self.method.peft_config()
        except RecipeError:
            raise
        except (TypeError, ValueError) as error:
            raise RecipeError(f"method ({self.method.name}): {error}") from None
        if self.task == "glue":
            if len(self.data.train) != 1:
                raise RecipeError(f"A GLUE recipe trains on one GLUE task; data.train is {self.data.train}.")
            try:
                glue_task(self.data.train[0])
            except ValueError as error:  # glue.py stands apart from recipes; its refusal is the recipe's
                raise RecipeError(str(error)) from None
            if self.evaluation.tasks:
                raise RecipeError(
                    "A GLUE recipe is scored on its task's held-out validation examples; "
                    f"evaluation.tasks must be empty (got {self.evaluation.tasks})."
                )

    @property
    def adapter_dir(self) -> Path:
        return Path(self.output_dir) / "adapter"

    @property
    def glue(self) -> GlueTask | None:
        """The GLUE task of a `glue` recipe."""
        return glue_task(self.data.train[0]) if self.task == "glue" else None

    @property
    def merge_before_evaluation(self) -> bool:
        merge = self.evaluation.merge
        return self.protocol == "paper" if merge is None else merge


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Turn a YAML value into the field's type: sections become dataclasses, and floats written like `1e-3` (which
    YAML reads as strings) become floats."""
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value or {}, where)
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    if value is not None and float in (typing.get_args(annotation) if union else (annotation,)):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise RecipeError(f"{where} must be a number (got {value!r}).") from None
    return value


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    if not isinstance(values, dict):
        raise RecipeError(f"Recipe section '{where}' must be a mapping (got {values!r}).")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise RecipeError(
            f"Unknown recipe key(s) {sorted(unknown)} in '{where or 'top level'}'; known: {sorted(known)}"
        )
    prefix = f"{where}." if where else ""
    return cls(**{key: _coerce(value, hints[key], prefix + key) for key, value in values.items()})


def _apply_override(values: dict[str, Any], assignment: str) -> None:
    """`section.key=value`, the value read as YAML (so numbers, lists and null work)."""
    path, separator, raw = assignment.partition("=")
    if not separator:
        raise RecipeError(f"Override {assignment!r} must look like section.key=value.")
    *sections, key = path.strip().split(".")
    target = values
    for section in sections:
        target = target.setdefault(section, {})
    target[key] = yaml.safe_load(raw)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def _read_with_bases(path: Path) -> dict[str, Any]:
    """The file's values on top of those of the file named by its `extends:` key (relative to it), recursively."""
    if path.is_dir():
        raise RecipeError(f"{path} is a folder; name a recipe file in it (e.g. {path}/NAME.yaml).")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise RecipeError(f"{path} is not valid YAML: {error}") from None
    base = values.pop("extends", None)
    return _merge(_read_with_bases(path.parent / base), values) if base else values


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe; `name` defaults to the file's stem and `output_dir` to outputs/NAME. `$VARS` and `~` expand."""
    path = Path(path)
    values = _read_with_bases(path)
    for assignment in overrides:
        _apply_override(values, assignment)
    values.setdefault("name", path.stem)
    values.setdefault("output_dir", f"outputs/{values['name']}")
    recipe = _build(Recipe, values, "")
    recipe.data.dir = os.path.expanduser(os.path.expandvars(recipe.data.dir))
    recipe.output_dir = os.path.expanduser(os.path.expandvars(recipe.output_dir))
    return recipe
