"""Mixed-batch inference as peft's LoRA offers it: `adapter_names` gives each row its own adapter (`"__base__"`: none)
in forward and generate; each row equals that adapter's own output; unknown names and merged adapters raise LoRA's
errors."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from peft_neuroada import NeuroAdaConfig
from tests.conftest import tiny_llama

ROWS = ["default", "other", "__base__", "other"]


def with_two_adapters(base):
    model = get_peft_model(base, NeuroAdaConfig(k=2, init_weights=False))
    model.add_adapter("other", NeuroAdaConfig(k=1, init_weights=False, neuron_fraction=0.5))
    return model.eval()


def single_adapter_logits(model, tokens: torch.Tensor, name: str) -> torch.Tensor:
    with torch.no_grad():
        if name == "__base__":
            with model.disable_adapter():
                return model(tokens).logits
        model.set_adapter(name)
        return model(tokens).logits


def assert_rows_match_their_adapters(model, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        mixed = model(tokens, adapter_names=ROWS).logits
    for row, name in enumerate(ROWS):
        expected = single_adapter_logits(model, tokens[row : row + 1], name)
        torch.testing.assert_close(mixed[row : row + 1], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(mixed[0], mixed[2]) and not torch.allclose(mixed[1], mixed[2])


def test_each_row_of_a_mixed_batch_gets_its_own_adapter():
    model = with_two_adapters(tiny_llama())
    assert_rows_match_their_adapters(model, torch.randint(0, 128, (4, 10)))


def test_each_row_of_a_mixed_batch_gets_its_own_adapter_on_smollm2(smollm2, smollm2_tokenizer):
    model = with_two_adapters(smollm2)
    tokens = smollm2_tokenizer(["The sky is"] * 4, return_tensors="pt").input_ids
    assert_rows_match_their_adapters(model, tokens)


def test_generate_serves_each_row_with_its_own_adapter():
    model = with_two_adapters(tiny_llama())
    tokens = torch.randint(0, 128, (4, 5))
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        mixed = model.generate(input_ids=tokens, adapter_names=ROWS, **settings)
        for row, name in enumerate(ROWS):
            if name == "__base__":
                with model.disable_adapter():
                    expected = model.generate(input_ids=tokens[row : row + 1], **settings)
            else:
                model.set_adapter(name)
                expected = model.generate(input_ids=tokens[row : row + 1], **settings)
            assert torch.equal(mixed[row : row + 1], expected)


def test_a_modules_to_save_head_follows_the_rows_adapter(minilm_classifier, minilm_tokenizer):
    model = get_peft_model(
        minilm_classifier, NeuroAdaConfig(k=1, init_weights=False, modules_to_save=["classifier"])
    ).eval()
    with torch.no_grad():
        model.base_model.model.classifier.modules_to_save["default"].weight.normal_()
    batch = minilm_tokenizer(["a good film", "a bad film"], return_tensors="pt", padding=True)
    with torch.no_grad():
        mixed = model(**batch, adapter_names=["default", "__base__"]).logits
        adapted = model(**batch).logits
        with model.disable_adapter():
            base = model(**batch).logits
    torch.testing.assert_close(mixed[0], adapted[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1], base[1], rtol=1e-5, atol=1e-5)


def test_inside_disable_adapter_adapter_names_serve_the_base_model_as_under_lora():
    model = with_two_adapters(tiny_llama())
    tokens = torch.randint(0, 128, (4, 10))
    with torch.no_grad(), model.disable_adapter():
        base = model(tokens).logits
        assert torch.equal(model(tokens, adapter_names=ROWS).logits, base)
        layer = model.base_model.model.model.layers[0].self_attn.q_proj  # a layer called directly, too
        x = torch.randn(4, 3, layer.in_features)
        assert torch.equal(layer(x, adapter_names=ROWS), layer.get_base_layer()(x))


def test_unknown_adapter_names_are_refused():
    model = with_two_adapters(tiny_llama())
    with pytest.raises(ValueError, match="Trying to infer with non-existing adapter"):
        model(torch.randint(0, 128, (2, 5)), adapter_names=["default", "typo"])


def test_adapter_names_with_merged_adapters_are_refused():
    model = with_two_adapters(tiny_llama())
    model.merge_adapter()
    with pytest.raises(ValueError, match="Cannot pass `adapter_names` when there are merged adapters"):
        model(torch.randint(0, 128, (2, 5)), adapter_names=["default", "other"])


def test_adapter_names_of_the_wrong_length_are_refused():
    model = with_two_adapters(tiny_llama())
    with pytest.raises(ValueError, match="Length of `adapter_names` should be the same"):
        model(torch.randint(0, 128, (2, 5)), adapter_names=["default"])


def test_adapter_names_in_training_mode_are_refused():
    model = with_two_adapters(tiny_llama()).train()
    with pytest.raises(ValueError, match="Cannot pass `adapter_names` when the model is in training mode"):
        model(torch.randint(0, 128, (2, 5)), adapter_names=["default", "other"])


def test_mixed_batches_do_not_change_the_active_adapter_or_later_calls():
    model = with_two_adapters(tiny_llama())
    tokens = torch.randint(0, 128, (4, 6))
    before = single_adapter_logits(model, tokens, "default")
    with torch.no_grad():
        model(tokens, adapter_names=ROWS)
        assert model.active_adapters == ["default"]
        assert torch.equal(model(tokens).logits, before)
