"""Everything a LoRA user does with a PeftModel works the same way with NeuroAda."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model, inject_adapter_in_model
from torch import nn
from transformers import AutoModel, Trainer, TrainingArguments

from peft_neuroada import NeuroAdaConfig, NeuroAdaLayer
from tests.conftest import minilm_path, tiny_bert, tiny_gpt2, tiny_llama

SMOLLM2_TARGET_OUT_FEATURES = {"q_proj": 576, "k_proj": 192, "v_proj": 192, "o_proj": 576}
SMOLLM2_TARGET_OUT_FEATURES |= {"gate_proj": 1536, "up_proj": 1536, "down_proj": 576}
SMOLLM2_LAYERS = 30


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def hidden(model, tokens: torch.Tensor) -> torch.Tensor:
    """Last hidden state (or logits): what every architecture's forward returns first."""
    with torch.no_grad():
        return model(tokens)[0]


def real_minilm():
    return AutoModel.from_pretrained(minilm_path()).eval()


def neuroada_layers(model) -> list[NeuroAdaLayer]:
    return [m for m in model.modules() if isinstance(m, NeuroAdaLayer)]


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


def test_multiple_adapters_add_set_combine_and_delete(token_batch):
    base_logits = logits(tiny_llama(), token_batch)
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False), adapter_name="one")
    model.add_adapter("two", NeuroAdaConfig(k=3, init_weights=False))
    only_one = logits(model, token_batch)
    model.set_adapter("two")
    only_two = logits(model, token_batch)
    assert not torch.allclose(only_one, only_two)
    assert model.active_adapters == ["two"]
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.endswith("neuroada_delta.one"))

    model.base_model.set_adapter(["one", "two"])
    both = logits(model, token_batch)
    layer = neuroada_layers(model)[0]
    x = torch.randn(3, layer.in_features)
    summed = layer.get_base_layer()(x) + x @ (layer.get_delta_weight("one") + layer.get_delta_weight("two")).T
    torch.testing.assert_close(layer(x), summed)
    assert not torch.allclose(both, only_one) and not torch.allclose(both, only_two)

    model.delete_adapter("two")
    assert set(model.peft_config) == {"one"}
    assert all("neuroada_delta.two" not in n for n, _ in model.named_parameters())
    torch.testing.assert_close(logits(model, token_batch), only_one)
    assert not torch.allclose(only_one, base_logits)


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


def test_unload_returns_the_untouched_base_model(token_batch):
    base_logits = logits(tiny_llama(), token_batch)
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2, init_weights=False))
    unloaded = model.unload()
    assert not neuroada_layers(unloaded)
    assert torch.equal(logits(unloaded, token_batch), base_logits)


def test_safe_merge_refuses_non_finite_deltas_and_leaves_weights_untouched():
    model = get_peft_model(tiny_llama(), NeuroAdaConfig(k=2))
    layer = neuroada_layers(model)[0]
    weight_before = layer.get_base_layer().weight.detach().clone()
    with torch.no_grad():
        layer.neuroada_delta["default"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN/inf"):
        model.merge_and_unload(safe_merge=True)
    assert torch.equal(layer.get_base_layer().weight, weight_before)


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


def test_gradient_checkpointing_gives_the_same_delta_gradients(smollm2, token_batch):
    model = get_peft_model(smollm2, NeuroAdaConfig(k=1, init_weights=False))

    def delta_grads() -> list[torch.Tensor]:
        model.zero_grad()
        model(token_batch, labels=token_batch).loss.backward()
        return [p.grad.clone() for n, p in model.named_parameters() if "neuroada_delta" in n]

    plain = delta_grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.train()
    checkpointed = delta_grads()
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


def test_adapter_layers_are_plain_nn_modules_with_a_readable_repr():
    layer = neuroada_layers(get_peft_model(tiny_llama(), NeuroAdaConfig(k=1)))[0]
    assert isinstance(layer, nn.Module)
    assert repr(layer).startswith("neuroada.Linear(")


@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_bert, real_minilm], ids=["gpt2-conv1d", "bert", "minilm"])
def test_merge_and_reload_agree_across_architectures(make_model, tmp_path):
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    model = get_peft_model(make_model(), NeuroAdaConfig(k=4, init_weights=False))
    adapted = hidden(model, tokens)
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(make_model(), tmp_path)
    assert torch.equal(hidden(reloaded, tokens), adapted)
    torch.testing.assert_close(hidden(reloaded.merge_and_unload(), tokens), adapted, rtol=0, atol=1e-4)
