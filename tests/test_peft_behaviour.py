"""Everything a LoRA user does with a PeftModel works the same way with NeuroAda."""

from __future__ import annotations

import re

import pytest
import torch
from peft import PeftModel, get_peft_model, inject_adapter_in_model
from torch import nn
from transformers import RobertaConfig, RobertaForSequenceClassification, Trainer, TrainingArguments
from transformers.models.roberta.modeling_roberta import RobertaClassificationHead

from peft_neuroada import NeuroAdaConfig, select_by_gradient
from tests.conftest import (
    TINY_AND_REAL,
    hidden,
    logits,
    named_neuroada_layers,
    neuroada_layers,
    real_minilm,
    real_minilm_classifier,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
)

SMOLLM2_TARGET_OUT_FEATURES = {"q_proj": 576, "k_proj": 192, "v_proj": 192, "o_proj": 576}
SMOLLM2_TARGET_OUT_FEATURES |= {"gate_proj": 1536, "up_proj": 1536, "down_proj": 576}
SMOLLM2_LAYERS = 30


def logits_of(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def base_weights(model) -> dict[str, torch.Tensor]:
    """Copies of every frozen weight wrapped by a NeuroAda layer, by module name."""
    return {n: layer.get_base_layer().weight.detach().clone() for n, layer in named_neuroada_layers(model).items()}


def test_k1_on_smollm2_trains_exactly_one_delta_per_neuron(smollm2, capsys):
    model = get_peft_model(smollm2, NeuroAdaConfig(k=1))
    trainable, total = model.get_nb_trainable_parameters()
    assert trainable == SMOLLM2_LAYERS * sum(SMOLLM2_TARGET_OUT_FEATURES.values()) == 155_520
    model.print_trainable_parameters()
    assert "trainable params: 155,520" in capsys.readouterr().out
    assert all(not p.requires_grad for n, p in model.named_parameters() if "neuroada_delta" not in n)


def test_zero_initialised_adapter_leaves_smollm2_outputs_unchanged(smollm2, token_batch):
    before = logits(smollm2, token_batch)
    model = get_peft_model(smollm2, NeuroAdaConfig(k=20))
    assert torch.equal(logits(model, token_batch), before)


def test_inject_adapter_in_model_adapts_a_plain_module(token_batch):
    model = inject_adapter_in_model(NeuroAdaConfig(k=2, init_weights=False), tiny_llama())
    assert len(neuroada_layers(model)) == 2 * 7
    loss = model(token_batch, labels=token_batch).loss
    loss.backward()
    assert all(layer.neuroada_delta["default"].grad is not None for layer in neuroada_layers(model))


def test_inject_adapter_in_model_adapts_every_default_target_of_real_minilm(token_batch):
    """Without a PeftModel wrapper, a pretrained BERT gets BERT's default targets, starts unchanged and trains."""
    model = real_minilm()
    defaults = {"query", "key", "value", "dense"}
    expected = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in defaults}
    before = hidden(model, token_batch)
    model = inject_adapter_in_model(NeuroAdaConfig(k=2), model)
    assert set(named_neuroada_layers(model)) == expected
    assert torch.equal(hidden(model, token_batch), before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.neuroada_delta.default" for n in expected}
    output = model(token_batch)  # the pooler's dense layer only feeds pooler_output
    (output.last_hidden_state.square().mean() + output.pooler_output.square().mean()).backward()
    assert all(layer.neuroada_delta["default"].grad.abs().sum() > 0 for layer in neuroada_layers(model))


def test_training_steps_on_smollm2_lower_the_loss_and_change_only_deltas(smollm2, smollm2_tokenizer):
    batch = smollm2_tokenizer(["The capital of France is Paris."] * 2, return_tensors="pt")
    model = get_peft_model(smollm2, NeuroAdaConfig(k=1))
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen_before[n]) for n, p in model.named_parameters() if not p.requires_grad)


@TINY_AND_REAL
def test_an_adapter_added_while_another_is_merged_selects_its_inputs_on_the_base_weights(make_model):
    unmerged = get_peft_model(make_model(), NeuroAdaConfig(k=2, init_weights=False), adapter_name="one")
    unmerged.add_adapter("two", NeuroAdaConfig(k=2))
    merged = get_peft_model(make_model(), NeuroAdaConfig(k=2, init_weights=False), adapter_name="one")
    merged.merge_adapter()
    merged.add_adapter("two", NeuroAdaConfig(k=2))
    expected = [layer.placement("two").cols for layer in neuroada_layers(unmerged)]
    assert all(
        torch.equal(layer.placement("two").cols, cols)
        for layer, cols in zip(neuroada_layers(merged), expected, strict=True)
    )


@TINY_AND_REAL
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_merged_model_cast_to_another_dtype_unmerges_to_the_cast_base_weights(make_model, dtype, token_batch):
    """As with LoRA: merge, cast the model (e.g. `.half()` for inference), then add an adapter, disable, unmerge."""
    cast_base = {name: weight.detach().to(dtype) for name, weight in make_model().named_parameters()}
    model = get_peft_model(make_model(), NeuroAdaConfig(k=2, init_weights=False))
    model.merge_adapter()
    model.to(dtype)
    model.add_adapter("two", NeuroAdaConfig(k=2))
    selected_on_cast_base = get_peft_model(make_model().to(dtype), NeuroAdaConfig(k=2), adapter_name="two")
    for name, layer in named_neuroada_layers(model).items():
        expected = named_neuroada_layers(selected_on_cast_base)[name].placement("two").cols
        assert torch.equal(layer.placement("two").cols, expected), name
    with model.disable_adapter():  # unmerges
        disabled = hidden(model, token_batch)
    assert torch.equal(disabled, hidden(make_model().to(dtype), token_batch))
    model.merge_adapter()
    model.unmerge_adapter()
    for name, weight in model.unload().named_parameters():
        assert torch.equal(weight, cast_base[name]), name


@TINY_AND_REAL
def test_multiple_adapters_add_set_combine_and_delete(make_model, token_batch):
    base_outputs = hidden(make_model(), token_batch)
    model = get_peft_model(make_model(), NeuroAdaConfig(k=2, init_weights=False), adapter_name="one")
    model.add_adapter("two", NeuroAdaConfig(k=3, init_weights=False))
    only_one = hidden(model, token_batch)
    model.set_adapter("two")
    only_two = hidden(model, token_batch)
    assert not torch.allclose(only_one, only_two)
    assert model.active_adapters == ["two"]
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.endswith("neuroada_delta.one"))

    model.base_model.set_adapter(["one", "two"])
    both = hidden(model, token_batch)
    layer = neuroada_layers(model)[0]
    x = torch.randn(3, layer.in_features)
    summed = layer.get_base_layer()(x) + x @ (layer.get_delta_weight("one") + layer.get_delta_weight("two")).T
    torch.testing.assert_close(layer(x), summed)
    assert not torch.allclose(both, only_one) and not torch.allclose(both, only_two)

    model.delete_adapter("two")
    assert set(model.peft_config) == {"one"}
    assert all("neuroada_delta.two" not in n for n, _ in model.named_parameters())
    torch.testing.assert_close(hidden(model, token_batch), only_one)
    assert not torch.allclose(only_one, base_outputs)


def test_disable_adapter_context_gives_base_model_outputs(smollm2, token_batch):
    base = logits(smollm2, token_batch)
    model = get_peft_model(smollm2, NeuroAdaConfig(k=1, init_weights=False))
    adapted = logits(model, token_batch)
    with model.disable_adapter():
        assert torch.equal(logits(model, token_batch), base)
    assert torch.equal(logits(model, token_batch), adapted)


def test_merge_unmerge_and_merge_and_unload_on_smollm2(smollm2, token_batch):
    original = {n: p.detach().clone() for n, p in smollm2.named_parameters()}
    model = get_peft_model(smollm2, NeuroAdaConfig(k=20, init_weights=False))
    adapted = logits(model, token_batch)
    model.merge_adapter()
    torch.testing.assert_close(logits(model, token_batch), adapted, rtol=0, atol=1e-4)
    model.unmerge_adapter()
    base_params = dict(model.get_base_model().named_parameters())
    for name, value in original.items():
        key = name if name in base_params else name.replace(".weight", ".base_layer.weight")
        assert torch.equal(base_params[key], value), f"{name} not restored bit-exactly"
    merged = model.merge_and_unload(safe_merge=True)
    assert not neuroada_layers(merged) and not hasattr(merged, "peft_config")
    torch.testing.assert_close(logits(merged, token_batch), adapted, rtol=0, atol=1e-4)


@TINY_AND_REAL
def test_unload_returns_the_untouched_base_model(make_model, token_batch):
    base_outputs = hidden(make_model(), token_batch)
    model = get_peft_model(make_model(), NeuroAdaConfig(k=2, init_weights=False))
    assert not torch.equal(hidden(model, token_batch), base_outputs)
    unloaded = model.unload()
    assert not neuroada_layers(unloaded)
    assert torch.equal(hidden(unloaded, token_batch), base_outputs)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_safe_merge_refuses_non_finite_deltas_and_leaves_weights_untouched(bad_value):
    """A broken delta must neither reach the weights nor leave half-merged entries behind."""
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    layer = neuroada_layers(model)[0]
    weights_before = base_weights(model)
    with torch.no_grad():
        layer.neuroada_delta["default"][0, 0] = bad_value
    with pytest.raises(ValueError, match="NaN/inf"):
        model.merge_and_unload(safe_merge=True)
    assert not layer.merged
    weights_after = base_weights(model)
    assert weights_after.keys() == weights_before.keys()
    assert all(torch.equal(weights_after[n], w) for n, w in weights_before.items())


def test_modules_to_save_trains_and_saves_the_minilm_classification_head(minilm_classifier, tmp_path):
    model = get_peft_model(minilm_classifier, NeuroAdaConfig(k=1, modules_to_save=["classifier"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("classifier.modules_to_save.default" in n for n in trainable)
    assert any("neuroada_delta" in n for n in trainable)
    assert all("neuroada_delta" in n or "classifier" in n for n in trainable)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert {"base_model.model.classifier.weight", "base_model.model.classifier.bias"} <= set(saved)


def test_modules_to_save_head_round_trips_through_save_and_reload(minilm_classifier, minilm_tokenizer, tmp_path):
    """The trained head comes from the adapter file, not from the fresh head of the model it is loaded onto."""
    batch = minilm_tokenizer(["a fine film", "a dull film"], return_tensors="pt", padding=True)
    model = get_peft_model(minilm_classifier, NeuroAdaConfig(k=1, init_weights=False, modules_to_save=["classifier"]))
    with torch.no_grad():  # stands in for training the head copy
        for parameter in model.base_model.model.classifier.modules_to_save["default"].parameters():
            parameter.add_(torch.randn_like(parameter))
    expected = logits_of(model, batch)
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(real_minilm_classifier(head_seed=1), tmp_path)
    assert torch.equal(logits_of(reloaded, batch), expected)


def test_merge_and_unload_keeps_a_trained_head_that_has_no_weight_of_its_own():
    """RoBERTa's classification head (dense + out_proj: the paper's GLUE runs) comes out of `modules_to_save` as
    trained, as LoRA's does, with the deltas merged (`unload` as LoRA: tests/test_unload_as_lora.py)."""
    config = RobertaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=40, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    model = get_peft_model(
        RobertaForSequenceClassification(config).eval(),
        NeuroAdaConfig(k=2, init_weights=False, target_modules=["query", "value"], modules_to_save=["classifier"]),
    )
    head = model.base_model.model.classifier.modules_to_save["default"]
    with torch.no_grad():
        head.out_proj.weight.add_(1.0)  # stands in for training the head copy
    ids = torch.randint(3, 60, (2, 9))
    expected = model(ids).logits
    unloaded = model.merge_and_unload()
    assert isinstance(unloaded.classifier, RobertaClassificationHead) and unloaded.classifier is head
    torch.testing.assert_close(unloaded(ids).logits, expected)


def test_print_trainable_parameters_reports_the_trainable_share_of_all_parameters(minilm_classifier, capsys):
    """The printed counts and percentage are those of the model's own parameters (head copy included)."""
    model = get_peft_model(minilm_classifier, NeuroAdaConfig(k=1, modules_to_save=["classifier"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    model.print_trainable_parameters()
    printed = re.search(
        r"trainable params: ([\d,]+) \|\| all params: ([\d,]+) \|\| trainable%: ([\d.]+)", capsys.readouterr().out
    )
    assert printed is not None
    assert (int(printed[1].replace(",", "")), int(printed[2].replace(",", ""))) == (trainable, total)
    assert float(printed[3]) == pytest.approx(100 * trainable / total, abs=5e-5)  # printed with 4 decimals


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_delta_gradients(smollm2, token_batch):
    """Checkpointing is really active (each layer runs again during backward) and changes no gradient."""
    model = get_peft_model(smollm2, NeuroAdaConfig(k=1, init_weights=False))
    forward_calls = []
    model.base_model.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *_: forward_calls.append(1))

    def delta_grads_and_calls_in_backward() -> tuple[list[torch.Tensor], int]:
        model.zero_grad()
        loss = model(token_batch, labels=token_batch).loss
        calls_in_forward = len(forward_calls)
        loss.backward()
        calls_in_backward = len(forward_calls) - calls_in_forward
        forward_calls.clear()
        return [p.grad.clone() for n, p in model.named_parameters() if "neuroada_delta" in n], calls_in_backward

    plain, plain_recomputations = delta_grads_and_calls_in_backward()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.train()
    checkpointed, checkpointed_recomputations = delta_grads_and_calls_in_backward()
    assert (plain_recomputations, checkpointed_recomputations) == (0, 1)
    for a, b in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_transformers_trainer_trains_a_neuroada_model(tmp_path):
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=1))
    torch.manual_seed(0)
    examples = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 10))]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=examples)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0]
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_model.safetensors").exists()


def _trainer(model, output_dir, examples) -> Trainer:
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        max_steps=4,
        save_steps=2,
        learning_rate=5e-2,
        report_to=[],
        use_cpu=True,
    )
    return Trainer(model=model, args=args, train_dataset=examples)


def test_trainer_resumed_from_a_checkpoint_continues_a_gradient_selected_run_exactly(tmp_path):
    # The run's inputs come from select_by_gradient; the model it resumes in selected its own by magnitude. The
    # checkpoint's columns, deltas and optimizer state carry the run on bit-exactly.
    torch.manual_seed(0)
    examples = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 10))]

    def gradient_selected():
        model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, selection="gradient"))
        select_by_gradient(
            model, [{"input_ids": ids[None], "labels": ids[None]} for ids in torch.randint(0, 128, (4, 10))]
        )
        return model

    torch.manual_seed(1)
    uninterrupted = gradient_selected()
    _trainer(uninterrupted, tmp_path / "uninterrupted", examples).train()
    torch.manual_seed(1)
    _trainer(gradient_selected(), tmp_path / "run", examples).train()

    resumed = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2))
    fresh_columns = neuroada_layers(resumed)[0].placement("default").cols.clone()
    _trainer(resumed, tmp_path / "resumed", examples).train(resume_from_checkpoint=str(tmp_path / "run/checkpoint-2"))

    assert not torch.equal(neuroada_layers(resumed)[0].placement("default").cols, fresh_columns)
    expected = {n: t for n, t in uninterrupted.state_dict().items() if "neuroada_" in n}
    actual = {n: t for n, t in resumed.state_dict().items() if "neuroada_" in n}
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_adapter_layers_are_plain_nn_modules_with_a_readable_repr():
    layer = neuroada_layers(get_peft_model(tiny_llama(), NeuroAdaConfig(k=1)))[0]
    assert isinstance(layer, nn.Module)
    assert repr(layer).startswith("neuroada.NeuroAdaLinear(")


@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_bert, real_minilm], ids=["gpt2-conv1d", "bert", "minilm"])
def test_merge_and_reload_agree_across_architectures(make_model, tmp_path):
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    model = get_peft_model(make_model(), NeuroAdaConfig(k=4, init_weights=False))
    adapted = hidden(model, tokens)
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(make_model(), tmp_path)
    assert torch.equal(hidden(reloaded, tokens), adapted)
    torch.testing.assert_close(hidden(reloaded.merge_and_unload(), tokens), adapted, rtol=0, atol=1e-4)
