"""YAML recipes: the shipped configs, inheritance with `extends`, command-line overrides and validation."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from transformers import RobertaConfig, RobertaForSequenceClassification

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.train.glue import GLUE_TASKS
from peft_neuroada.train.recipes import MethodSpec, load_recipe
from peft_neuroada.train.training import training_autocast, use_bf16

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER_MODELS = ("llama-7b", "llama-13b", "llama2-7b", "llama3-8b")
# The official scripts' micro-batches: (micro_batch_size, batch_size // micro_batch_size) of
# scripts/percell/perCell_mag_add/top{1,20}/{commonsense,math}.sh (a batch below micro_batch_size is one micro-batch).
OFFICIAL_MICRO_BATCHES = {
    ("commonsense", 1): (8, 1),
    ("commonsense", 20): (16, 1),
    ("math", 1): (2, 8),
    ("math", 20): (2, 4),
}
# LoReFT's RoBERTa-base GLUE settings (arXiv 2404.03592v3, Table 9): learning rate, warmup ratio, epochs.
LOREFT_ROBERTA_BASE = {
    "mnli": (6e-4, 0.06, 40),
    "sst2": (6e-4, 0.1, 40),
    "mrpc": (3e-4, 0.0, 40),
    "cola": (4e-4, 0.005, 60),
    "qnli": (9e-4, 0.1, 20),
    "qqp": (6e-4, 0.0, 40),
    "rte": (9e-4, 0.0, 60),
    "stsb": (6e-4, 0.03, 60),
}


@pytest.mark.parametrize("path", sorted((CONFIGS / "paper").glob("*.yaml")), ids=lambda p: p.stem)
def test_paper_recipes_train_and_score_in_pure_bf16_without_autocast(path, monkeypatch):
    """The official run loads bf16 weights and then asks `dtype == "bfloat16"` of what is by then torch.bfloat16, so
    its TrainingArguments get bf16=None (train_our.py L516, L577): no autocast in training or in the final test, even
    on a GPU with bf16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    recipe = load_recipe(path)
    assert recipe.dtype == "bfloat16"
    assert not use_bf16(recipe.training.bf16)
    assert isinstance(training_autocast(recipe, torch.nn.Linear(1, 1)), contextlib.nullcontext)


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    assert isinstance(recipe.method.peft_config(), NeuroAdaConfig | LoraConfig)


def test_paper_recipes_cover_every_model_task_and_k_with_the_papers_protocol():
    for model in PAPER_MODELS:
        for task, train, n_tests in (("commonsense", "commonsense_170k", 8), ("math", "math_10k", 7)):
            top1, top20 = (load_recipe(CONFIGS / "paper" / f"{model}_{task}_top{k}.yaml") for k in (1, 20))
            assert (top1.method.k, top20.method.k) == (1, 20)
            for recipe in (top1, top20):
                assert recipe.training.epochs == 3 and recipe.data.max_length == 512
                assert recipe.data.train == [train] and len(recipe.evaluation.tasks) == n_tests
                assert recipe.evaluation.size is None and recipe.dtype == "bfloat16"
                assert recipe.protocol == "paper" and recipe.task == "generation"
                assert recipe.method.delta_dtype == "bfloat16" and recipe.merge_before_evaluation, "official settings"
                spec = recipe.training
                micro_batches = (spec.batch_size, spec.gradient_accumulation_steps)
                assert micro_batches == OFFICIAL_MICRO_BATCHES[task, recipe.method.k], recipe.name
                assert spec.loss_average == "micro_batch", "each micro-batch averaged alone, as on transformers 4.45"
                budgets = recipe.evaluation.max_new_tokens
                assert (budgets["options"], budgets["number"]) == (32, 512), "official commonsense / math budgets"
            assert top1.training.learning_rate > top20.training.learning_rate


def test_paper_glue_recipes_cover_every_task_at_both_budgets_with_loreft_settings():
    for task, (learning_rate, warmup, epochs) in LOREFT_ROBERTA_BASE.items():
        top1, top9 = (load_recipe(CONFIGS / "paper" / f"roberta-base_glue_{task}_top{k}.yaml") for k in (1, 9))
        assert (top1.method.k, top9.method.k) == (1, 9) and top1.output_dir != top9.output_dir
        for recipe in (top1, top9):
            assert (recipe.task, recipe.glue.name, recipe.model) == ("glue", task, "FacebookAI/roberta-base")
            assert (recipe.protocol, recipe.seed, recipe.dtype, recipe.method.delta_dtype) == (
                "paper",
                42,
                "bfloat16",
                "bfloat16",
            )
            assert recipe.merge_before_evaluation and recipe.data.max_length == 256
            spec = recipe.training
            assert (spec.learning_rate, spec.warmup, spec.epochs) == (learning_rate, warmup, epochs)
            assert (spec.batch_size, spec.weight_decay, recipe.evaluation.batch_size) == (32, 0.0, 32)
    assert set(LOREFT_ROBERTA_BASE) == set(GLUE_TASKS)


def test_paper_glue_recipes_train_the_papers_shares_of_roberta_base():
    """0.0297% and 0.2674% of RoBERTa-base without its head (the paper's GLUE table)."""
    config = RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, num_labels=2)
    with torch.device("meta"):
        model = RobertaForSequenceClassification(config)
    body = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("classifier."))
    assert body == 124_055_040
    for k, share in ((1, 0.0297), (9, 0.2674)):
        recipe = load_recipe(CONFIGS / "paper" / f"roberta-base_glue_sst2_top{k}.yaml")
        peft_config = recipe.method.peft_config("SEQ_CLS", ["classifier"])
        rows = sum(
            module.out_features
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
            and not name.startswith("classifier")
            and check_target_module_exists(peft_config, name)
        )
        assert round(100 * k * rows / body, 4) == share


def test_a_glue_recipe_names_one_glue_task_and_no_test_sets(tmp_path):
    (tmp_path / "r.yaml").write_text("task: glue\ndata: {train: [rte]}\n")
    recipe = load_recipe(tmp_path / "r.yaml", ["seed=43"])
    assert recipe.glue.name == "rte" and recipe.seed == 43
    with pytest.raises(ValueError, match="one GLUE task"):
        load_recipe(tmp_path / "r.yaml", ["data.train=[rte, mrpc]"])
    with pytest.raises(ValueError, match="Unknown GLUE task 'boolq'"):
        load_recipe(tmp_path / "r.yaml", ["data.train=[boolq]"])
    with pytest.raises(ValueError, match="evaluation.tasks must be empty"):
        load_recipe(tmp_path / "r.yaml", ["evaluation.tasks=[rte]"])
    with pytest.raises(ValueError, match="task must be 'generation' or 'glue'"):
        load_recipe(tmp_path / "r.yaml", ["task=ner"])


def test_the_paper_protocol_evaluates_merged_models_unless_told_otherwise(tmp_path):
    (tmp_path / "r.yaml").write_text("model: default\n")
    assert not load_recipe(tmp_path / "r.yaml").merge_before_evaluation
    assert load_recipe(tmp_path / "r.yaml", ["protocol=paper"]).merge_before_evaluation
    assert not load_recipe(tmp_path / "r.yaml", ["protocol=paper", "evaluation.merge=false"]).merge_before_evaluation
    assert load_recipe(tmp_path / "r.yaml", ["evaluation.merge=true"]).merge_before_evaluation


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_keep_their_data_inside_the_checkout(path):
    data_dir = Path(load_recipe(path).data.dir)
    assert not data_dir.is_absolute() and ".." not in data_dir.parts


@pytest.mark.parametrize("task", ["commonsense", "math"])
def test_small_recipes_compare_neuroada_and_lora_on_identical_data_and_evaluation(task):
    recipes = [
        load_recipe(CONFIGS / f"smol_{task}_{m}.yaml") for m in ("neuroada_k1", "neuroada_k20", "lora_r1", "lora_r8")
    ]
    assert [r.method.label for r in recipes] == ["neuroada k=1", "neuroada k=20", "lora r=1", "lora r=8"]
    assert all(r.model == "default" for r in recipes)
    assert len({(str(r.data), str(r.evaluation), r.training.max_steps, r.training.epochs) for r in recipes}) == 1
    assert {r.protocol for r in recipes} == {"lenient"}
    assert len({r.output_dir for r in recipes}) == 4


def test_extends_overrides_and_float_strings(tmp_path):
    (tmp_path / "base.yaml").write_text("data: {train: [math_10k], train_size: 10}\ntraining: {batch_size: 4}\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\ntraining: {learning_rate: 5e-4}\n")
    recipe = load_recipe(tmp_path / "child.yaml", ["training.max_steps=7", "evaluation.tasks=[gsm8k, AQuA]"])
    assert recipe.data.train == ["math_10k"] and recipe.data.train_size == 10
    assert recipe.training.batch_size == 4 and recipe.training.max_steps == 7
    assert recipe.training.learning_rate == 5e-4 and isinstance(recipe.training.learning_rate, float)
    assert recipe.evaluation.tasks == ["gsm8k", "AQuA"]
    assert recipe.output_dir == "outputs/child" and recipe.adapter_dir == Path("outputs/child/adapter")


def test_the_protocol_is_a_top_level_choice_of_two(tmp_path):
    (tmp_path / "r.yaml").write_text("model: default\n")
    assert load_recipe(tmp_path / "r.yaml").protocol == "lenient"
    assert load_recipe(tmp_path / "r.yaml", ["protocol=paper"]).protocol == "paper"
    with pytest.raises(ValueError, match=r"protocol must be one of \['lenient', 'paper'\]"):
        load_recipe(tmp_path / "r.yaml", ["protocol=official"])


def test_typos_are_errors_not_silently_ignored(tmp_path):
    (tmp_path / "typo.yaml").write_text("training: {learnin_rate: 1.0e-3}\n")
    with pytest.raises(ValueError, match=r"Unknown recipe key\(s\) \['learnin_rate'\] in 'training'"):
        load_recipe(tmp_path / "typo.yaml")
    with pytest.raises(ValueError, match="must look like section.key=value"):
        load_recipe(tmp_path / "typo.yaml", ["training.max_steps"])


def test_methods_build_their_peft_configs():
    neuroada = MethodSpec(name="neuroada", k=20).peft_config()
    assert isinstance(neuroada, NeuroAdaConfig) and neuroada.k == 20 and neuroada.task_type == "CAUSAL_LM"
    classifier = MethodSpec(name="neuroada", delta_dtype="bfloat16").peft_config("SEQ_CLS", ["classifier"])
    assert (classifier.task_type, classifier.modules_to_save, classifier.delta_dtype) == (
        "SEQ_CLS",
        ["classifier"],
        "bfloat16",
    )
    lora = MethodSpec(name="lora", r=4, alpha=8).peft_config()
    assert isinstance(lora, LoraConfig) and (lora.r, lora.lora_alpha, lora.target_modules) == (4, 8, "all-linear")
    with pytest.raises(ValueError, match="'neuroada' or 'lora'"):
        MethodSpec(name="ia3").peft_config()
    with pytest.raises(ValueError, match="delta_dtype is NeuroAda's"):
        MethodSpec(name="lora", delta_dtype="bfloat16").peft_config()


def test_the_model_dtype_is_one_of_the_dtype_table(tmp_path):
    (tmp_path / "r.yaml").write_text("dtype: float64\n")
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\]"):
        load_recipe(tmp_path / "r.yaml")
