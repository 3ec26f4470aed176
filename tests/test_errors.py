"""Bad input gets a ValueError with a sentence, never a crash, a hang or a silent clamp."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from flashspec import SpeculativeEngine
from flashspec.select import make_selector


def llama(vocab: int = 32, context: int = 64, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context,
    )
    return LlamaForCausalLM(config).eval()


TARGET = llama()
ENGINE = SpeculativeEngine(TARGET, ["ngram"])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, temperature=-1.0), "temperature"),
        (dict(do_sample=True, temperature=math.nan), "temperature"),
        (dict(do_sample=True, temperature=math.inf), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(num_draft_tokens=-3), "num_draft_tokens"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=2.0), "max_new_tokens"),
        (dict(seed="x"), "seed"),
        (dict(eos_token_id=1000), "eos_token_id"),
    ],
)
def test_bad_generation_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ENGINE.generate([[1, 2, 3]], **kwargs)


def test_greedy_accepts_temperature_zero():
    out = ENGINE.generate([[1, 2, 3]], max_new_tokens=3, do_sample=False, temperature=0.0, eos_token_id=[])
    assert len(out.sequences[0]) == 3


@pytest.mark.parametrize(
    "prompt,message",
    [
        ([[]], "empty"),
        ([], "empty"),
        ([[1, 2], []], "empty"),
        ([[1, 32]], "outside the vocabulary"),
        ([[1, -1]], "outside the vocabulary"),
        (torch.tensor([[1, 2, 99]]), "outside the vocabulary"),
        ("hello", "tokenizer"),
        (3.5, "input_ids"),
    ],
)
def test_bad_prompts(prompt, message):
    with pytest.raises(ValueError, match=message):
        ENGINE.generate(prompt, max_new_tokens=2)


def test_mask_shape_must_match():
    with pytest.raises(ValueError, match="attention_mask"):
        ENGINE.generate(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 2))


def test_context_window():
    with pytest.raises(ValueError, match="context window of 64"):
        ENGINE.generate([[1] * 40], max_new_tokens=25)
    out = ENGINE.generate([[1] * 40], max_new_tokens=24, eos_token_id=[])  # exactly fits
    assert len(out.sequences[0]) == 24


def test_drafter_with_another_vocabulary():
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeEngine(TARGET, [llama(vocab=48)])
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeEngine(TARGET, gpt2)


def test_bad_drafter_and_selector():
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeEngine(TARGET, [42])
    with pytest.raises(ValueError, match="selector"):
        SpeculativeEngine(TARGET, ["ngram"], selector="ucb-typo")
    with pytest.raises(ValueError, match="selector"):
        make_selector(object())


def test_missing_files():
    with pytest.raises(ValueError, match="does not exist"):
        SpeculativeEngine("/nonexistent/model.gguf", [])
    with pytest.raises(ValueError, match="Could not load"):
        SpeculativeEngine("/nonexistent/folder", [])


def test_sliding_window_is_refused_when_it_matters():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=8, max_position_embeddings=64,
    )
    engine = SpeculativeEngine(MistralForCausalLM(config).eval(), ["ngram"])
    with pytest.raises(ValueError, match="sliding"):
        engine.generate([[1, 2, 3]], max_new_tokens=10)
