"""Answering conversations turn by turn (flashspec/training/conversations.py) on a tiny random-weight
target: each turn's context holds the target's own earlier answers, never the recorded ones; the
loss mask covers exactly the answers; turns, context length and EOS end conversations; rows of
several conversations share each generate call."""

from __future__ import annotations

import pytest
import torch
from distill_helpers import (
    RECORDED,
    GenerateSpy,
    RewritingChatTokenizer,
    RoleChatTokenizer,
)
from tiny_models import tiny_model

from flashspec.engine import SpeculativeEngine
from flashspec.training.conversations import Item, answer_items, chat_ids

QUESTIONS = [("What is a fox?", "Why is it red?", "Thanks!"), ("Hello", "Tell me more"), ("One question only",)]


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model("llama", seed=0)


def _items(questions=QUESTIONS):
    return [Item(f"c{i}", turns=q) for i, q in enumerate(questions)]


def _text(ids):
    return "".join(map(chr, ids))


def test_each_turn_is_built_on_the_targets_own_answers(target, monkeypatch):
    tok = RoleChatTokenizer()
    spy = GenerateSpy(monkeypatch)
    engine = SpeculativeEngine(target, [], tokenizer=tok)
    samples, tally = answer_items(engine, _items(), max_turns=3, max_context=200, max_new_tokens=6, batch=3)
    # the answer each context got, by context
    answered = {tuple(p): s for prompts, outs in spy.calls for p, s in zip(prompts, outs)}
    for index, questions in enumerate(QUESTIONS):
        messages = []
        for question in questions:
            messages.append({"role": "user", "content": question})
            context = chat_ids(tok, messages)
            assert tuple(context) in answered, f"conversation {index}: the context of {question!r} was never answered"
            answer = answered[tuple(context)]
            messages.append({"role": "assistant", "content": _text(answer)})  # no EOS: the answer as it is
        # one sample per conversation: the last context and its answer, the mask on every answer
        sample = [s for s in samples if s.item == index]
        assert len(sample) == 1
        assert sample[0].ids == context + answer
        marked = _text(i for i, m in zip(sample[0].ids, sample[0].mask) if m)
        assert marked == "".join(m["content"] for m in messages if m["role"] == "assistant")
    assert all(RECORDED not in _text(p) for prompts, _ in spy.calls for p in prompts)
    assert tally.answers == 6 == len(answered) and tally.answer_tokens == 36 and tally.cut == 6
    assert tally.conversations == 3 and tally.skipped == 0 and tally.calls == len(spy.calls) == 3
    assert [len(prompts) for prompts, _ in spy.calls] == [3, 2, 1]  # turns 1, 2, 3 of the conversations left


def test_a_pool_keeps_every_call_full(target, monkeypatch):
    """Batch 2 over conversations of 3, 2 and 1 turns: a conversation that ends makes room."""
    spy = GenerateSpy(monkeypatch)
    engine = SpeculativeEngine(target, [], tokenizer=RoleChatTokenizer())
    answer_items(engine, _items(), max_turns=3, max_context=200, max_new_tokens=2, batch=2)
    assert [len(prompts) for prompts, _ in spy.calls] == [2, 2, 2]  # not [2, 2, 1, 1]: c2 fills c1's place


def test_turns_and_context_length_end_a_conversation(target, monkeypatch):
    tok = RoleChatTokenizer()
    engine = SpeculativeEngine(target, [], tokenizer=tok)
    samples, tally = answer_items(engine, _items(), max_turns=1, max_context=200, max_new_tokens=3, batch=8)
    assert tally.answers == 3 and all(sum(s.mask) == 3 for s in samples)
    # a context over max_context ends the conversation there; a first one skips it
    first = len(chat_ids(tok, [{"role": "user", "content": "What is a fox?"}]))
    long_items = [Item("long", turns=("x" * 300,)), *_items()[:1]]
    samples, tally = answer_items(engine, long_items, max_turns=3, max_context=first + 8, max_new_tokens=3, batch=8)
    assert tally.skipped == 1 and tally.conversations == 1 and tally.answers == 1
    assert [s.item for s in samples] == [1]


def test_an_answer_stops_at_eos_and_its_text_leaves_the_eos_out(monkeypatch):
    model = tiny_model("llama", seed=0)
    tok = RoleChatTokenizer()
    engine = SpeculativeEngine(model, [], tokenizer=tok)
    free, _ = answer_items(engine, _items()[:1], max_turns=1, max_context=200, max_new_tokens=8, batch=1)
    eos = free[0].ids[-6]  # the third token of the answer the model gives without an EOS
    model.generation_config.eos_token_id = eos
    spy = GenerateSpy(monkeypatch)
    engine = SpeculativeEngine(model, [], tokenizer=tok)
    samples, tally = answer_items(engine, _items()[:1], max_turns=2, max_context=200, max_new_tokens=8, batch=1)
    first_answer = spy.calls[0][1][0]
    assert first_answer[-1] == eos and eos not in first_answer[:-1] and len(first_answer) <= 3
    assert tally.cut == sum(1 for _, outs in spy.calls if outs[0][-1] != eos)
    # the next context holds the answer's text without the EOS, and the EOS is in the sample, marked
    second_context = spy.calls[1][0][0]
    expected = chat_ids(tok, [{"role": "user", "content": QUESTIONS[0][0]},
                              {"role": "assistant", "content": _text(first_answer[:-1])},
                              {"role": "user", "content": QUESTIONS[0][1]}])
    assert second_context == expected
    sample = samples[0]
    start = len(chat_ids(tok, [{"role": "user", "content": QUESTIONS[0][0]}]))
    assert sample.ids[start : start + len(first_answer)] == first_answer
    assert sample.mask[start : start + len(first_answer)] == [1] * len(first_answer)


def test_a_template_that_rewrites_earlier_answers_gives_a_sample_per_turn(target, monkeypatch):
    tok = RewritingChatTokenizer()
    spy = GenerateSpy(monkeypatch)
    engine = SpeculativeEngine(target, [], tokenizer=tok)
    samples, tally = answer_items(engine, _items()[:1], max_turns=3, max_context=200, max_new_tokens=5, batch=1)
    assert len(samples) == 3 == tally.answers
    for sample, (prompts, outs) in zip(samples, spy.calls):
        assert sample.ids == prompts[0] + outs[0]  # every sample is a context the target really saw
        assert sample.mask == [0] * len(prompts[0]) + [1] * len(outs[0])


def test_a_fixed_prompt_is_answered_once(target):
    engine = SpeculativeEngine(target, [], tokenizer=RoleChatTokenizer())
    prompt = tuple(ord(c) for c in "def f(x):")
    samples, tally = answer_items(engine, [Item("p", prompt=prompt)], max_turns=4, max_context=200, max_new_tokens=4,
                                  batch=4)
    assert tally.answers == 1 and samples[0].ids[: len(prompt)] == list(prompt)
    assert samples[0].mask == [0] * len(prompt) + [1] * 4


def test_sampled_answers_are_reproducible_by_seed(target):
    engine = SpeculativeEngine(target, [], tokenizer=RoleChatTokenizer())
    runs = [answer_items(engine, _items(), max_turns=2, max_context=200, max_new_tokens=6, batch=2,
                         temperature=1.0, seed=seed)[0] for seed in (5, 5, 6)]
    assert [s.ids for s in runs[0]] == [s.ids for s in runs[1]]
    assert [s.ids for s in runs[0]] != [s.ids for s in runs[2]]


def test_a_tokenizer_without_a_chat_template_is_refused(target):
    from tiny_models import CharTokenizer

    engine = SpeculativeEngine(target, [], tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match="chat template"):
        answer_items(engine, _items(), max_turns=1, max_context=100, max_new_tokens=2, batch=1)
