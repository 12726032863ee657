"""How a recipe's loss averages over an accumulated batch: every token alike (`batch`), or each micro-batch's own
mean (`micro_batch`, the official runs' transformers < 4.46); a GLUE classifier's gradient does not depend on how
its batch is split into micro-batches."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from datasets import Dataset
from peft import get_peft_model
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.train.recipes import DataSpec, Recipe, RecipeError, TrainingSpec
from peft_neuroada.train.training import make_trainer, training_arguments

# Two examples whose loss covers 2 and 9 label tokens: the two averages weigh them differently.
EXAMPLES = [
    {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "labels": [-100] * 7 + [12, 13, 14]},
    {"input_ids": [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], "labels": [-100, 21, 22, 23, 24, 25, 26, 27, 28, 29]},
]


class FirstStepGradients(TrainerCallback):
    """The trainable parameters' gradients right before the first optimizer step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.gradients = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.gradients is None:
            self.gradients = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}


def one_step_gradients(recipe: Recipe, model, rows: list[dict], collate) -> dict[str, torch.Tensor]:
    arguments = training_arguments(recipe, max_steps=1, max_grad_norm=0.0, save_strategy="no")
    grab = FirstStepGradients(model)
    trainer = make_trainer(
        recipe, model, args=arguments, train_dataset=Dataset.from_list(rows), data_collator=collate, callbacks=[grab]
    )
    trainer.train()
    return grab.gradients


def stack(features: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([f[key] for f in features]) for key in features[0]}


def adapted_llama():
    return get_peft_model(tiny_llama().train(), NeuroAdaConfig(k=2, init_weights=False))


def gradients_of(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def example_loss(model, example: dict, reduction: str) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([example["input_ids"]])).logits[0, :-1]
    targets = torch.tensor(example["labels"][1:])
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction=reduction)


def generation_recipe(tmp_path, loss_average: str) -> Recipe:
    training = TrainingSpec(batch_size=1, gradient_accumulation_steps=2, loss_average=loss_average)
    return Recipe(name="accumulate", output_dir=str(tmp_path), training=training)


def assert_same_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys() and got
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_micro_batch_average_gives_each_micro_batch_the_same_weight(tmp_path):
    """The official runs' gradient: the mean over micro-batches of each one's mean over its own label tokens."""
    got = one_step_gradients(generation_recipe(tmp_path, "micro_batch"), adapted_llama(), EXAMPLES, stack)
    reference = adapted_llama()
    mean_of_means = sum(example_loss(reference, example, "mean") for example in EXAMPLES) / 2
    assert_same_gradients(got, gradients_of(reference, mean_of_means))


def test_batch_average_gives_every_label_token_the_same_weight(tmp_path):
    got = one_step_gradients(generation_recipe(tmp_path, "batch"), adapted_llama(), EXAMPLES, stack)
    reference = adapted_llama()
    tokens = sum(sum(label != -100 for label in example["labels"][1:]) for example in EXAMPLES)
    token_mean = sum(example_loss(reference, example, "sum") for example in EXAMPLES) / tokens
    assert_same_gradients(got, gradients_of(reference, token_mean))


def adapted_classifier():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    return get_peft_model(model, NeuroAdaConfig(k=2, init_weights=False, modules_to_save=["classifier"]))


@pytest.mark.parametrize("loss_average", ["batch", "micro_batch"])
def test_glue_gradient_is_the_same_however_the_batch_is_split(tmp_path, loss_average):
    """transformers' Trainer alone doubles it at 2 accumulation steps (the classifier ignores `num_items_in_batch`)."""
    rows = [{"input_ids": [1, 2 + i, 9 + i], "labels": i % 2} for i in range(4)]
    gradients = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        training = TrainingSpec(
            batch_size=batch_size, gradient_accumulation_steps=accumulation, loss_average=loss_average
        )
        recipe = Recipe(
            name="glue", output_dir=str(tmp_path / str(accumulation)), task="glue", data=DataSpec(train=["sst2"]),
            training=training,
        )  # fmt: skip
        gradients.append(one_step_gradients(recipe, adapted_classifier(), rows, stack))
    assert_same_gradients(gradients[1], gradients[0])


def test_an_unknown_loss_average_is_refused():
    with pytest.raises(RecipeError, match="loss_average must be 'batch' or 'micro_batch'"):
        TrainingSpec(loss_average="tokens")
