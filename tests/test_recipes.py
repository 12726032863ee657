"""YAML recipes: the shipped configs, inheritance with `extends`, command-line overrides and validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from peft import LoraConfig

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.train.recipes import MethodSpec, load_recipe

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER_MODELS = ("llama-7b", "llama-13b", "llama2-7b", "llama3-8b")


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
                assert recipe.protocol == "paper"
                budgets = recipe.evaluation.max_new_tokens
                assert (budgets["options"], budgets["number"]) == (32, 512), "official commonsense / math budgets"
            assert top1.training.learning_rate > top20.training.learning_rate


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
    lora = MethodSpec(name="lora", r=4, alpha=8).peft_config()
    assert isinstance(lora, LoraConfig) and (lora.r, lora.lora_alpha, lora.target_modules) == (4, 8, "all-linear")
    with pytest.raises(ValueError, match="'neuroada' or 'lora'"):
        MethodSpec(name="ia3").peft_config()
