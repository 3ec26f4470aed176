"""The loss mask (SPEC.md §11, "Training data in the target's own words"): distilled samples are
cut into rows of one sample each, every answer token scored once; the training loss counts a
position only where the token it predicts is a target, so prompts are context and no masked
position gets a gradient; text files keep every position."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashspec.training.train as train
from flashspec import FeatureHead
from flashspec.training.data import OVERLAP, PAD, draft_vocab, sample_windows
from flashspec.training.train import TrainOptions, _features_and_logits, _loss, _weights, train_head
from tiny_models import tiny_model


def _sample(prompt: int, answer: int, start: int) -> SimpleNamespace:
    """A sample of ``prompt`` context tokens then ``answer`` answer tokens: ids ``start + 1, start + 2, …``
    (distinct, never PAD)."""
    ids = np.arange(start + 1, start + 1 + prompt + answer)
    return SimpleNamespace(ids=ids, mask=np.array([0] * prompt + [1] * answer, dtype=bool))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=6),
       seq_len=st.sampled_from([4, 8, 16, 32]))
def test_rows_hold_one_sample_each_and_score_every_answer_token_once(sizes, seq_len):
    samples = [_sample(p, a, 1000 * i) for i, (p, a) in enumerate(sizes)]
    ids, mask = sample_windows(samples, seq_len)
    assert ids.shape == mask.shape and ids.shape[1:] == (seq_len,)
    scored: dict[int, int] = {}
    for row, scores in zip(ids.tolist(), mask.tolist()):
        real = [t for t in row if t != PAD]
        assert row[len(real):] == [PAD] * (seq_len - len(real)) and not any(scores[len(real):])  # pads masked
        owner = {t // 1000 for t in real}
        assert len(owner) == 1  # never two samples in a row
        sample = samples[owner.pop()]
        first = int(np.flatnonzero(sample.ids == real[0])[0])
        assert real == sample.ids[first : first + len(real)].tolist()  # a contiguous piece of it
        assert first == 0 or all(not s for s in scores[: seq_len // OVERLAP])  # later rows: context first
        assert any(scores[1:])  # rows with nothing to score are left out
        for offset, s in enumerate(scores):
            if s:
                assert sample.mask[first + offset]  # only answer tokens are targets
                if offset:
                    scored[real[offset]] = scored.get(real[offset], 0) + 1
    answers = [int(t) for s in samples for t, m in zip(s.ids[1:], s.mask[1:]) if m]
    assert sorted(scored) == sorted(answers) and set(scored.values()) <= {1}  # each answer token once


def test_a_long_sample_goes_on_in_overlapping_rows():
    ids, mask = sample_windows([_sample(3, 30, 0)], 16)  # 33 tokens, 4 of context overlap per row
    assert ids[:, 0].tolist() == [1, 13, 25]  # rows start 12 tokens apart: 16 − 16 // 4
    assert mask[0].tolist() == [False] * 3 + [True] * 13
    assert mask[1].tolist() == [False] * 4 + [True] * 12 and mask[2].tolist()[:9] == [False] * 4 + [True] * 5
    assert ids[2, 9:].tolist() == [PAD] * 7 and not bool(mask[2, 9:].any())


@pytest.fixture(scope="module")
def setup():
    target = tiny_model("llama", seed=2, vocab_size=64)
    torch.manual_seed(0)
    head = FeatureHead(target.config, 1)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :5] = False  # a prompt of 5 tokens, then the answer
    mask[1, 8:] = False  # the answer ends at 8: the rest is padding
    return target, head, head.draft_model(target), ids, mask


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("unroll", [1, 3])
def test_masked_positions_get_no_gradient(setup, hard, unroll, monkeypatch):
    target, head, draft, ids, mask = setup
    options = TrainOptions(unroll=unroll, seq_len=12, hard_labels=hard)
    features, logits = _features_and_logits(target, ids)
    kept: list[torch.Tensor] = []
    passes = train._passes

    def keeping(*args):
        out = passes(*args)
        for t in out[0]:
            t.retain_grad()
            kept.append(t)
        return out

    monkeypatch.setattr(train, "_passes", keeping)
    weights = _weights(mask, ids)
    loss = _loss(head, draft, target, ids, features, logits, options, weights, feature_weight=1.0)
    loss.backward()
    counted = weights.bool()
    for j, values in enumerate(kept):
        grads = values.grad.abs().sum(-1)  # [b, T]: each position's logits' gradient
        assert bool((grads[~counted] == 0).all())  # masked: nothing flows back from them
        assert bool((grads[:, j:-1][counted[:, j:-1]] > 0).all())  # every counted position of the pass learns
    unmasked = _loss(head, draft, target, ids, features, logits, options, None, feature_weight=1.0)
    assert abs(unmasked.item() - loss.item()) > 1e-4  # the mask changes the loss


def test_a_context_only_tail_changes_nothing(setup):
    """A masked tail (padding after an answer) gives the loss of the sequence without it: masked
    positions are neither scored nor, after every scored one, context."""
    target, head, draft, ids, _ = setup
    options = TrainOptions(unroll=3, seq_len=12)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 9:] = False
    full = _loss(head, draft, target, ids, *_features_and_logits(target, ids), options, _weights(mask, ids))
    cut = ids[:, :9]
    alone = _loss(head, draft, target, cut, *_features_and_logits(target, cut), options, None)
    torch.testing.assert_close(full, alone, rtol=1e-5, atol=1e-6)
    changed_law = _features_and_logits(target, ids)[1].clone()
    changed_law[:, 8:] = torch.randn_like(changed_law[:, 8:])  # the target's law where nothing counts
    again = _loss(head, draft, target, ids, _features_and_logits(target, ids)[0], changed_law, options,
                  _weights(mask, ids))
    assert torch.equal(again, full)


def test_text_data_keeps_every_position(setup):
    """Without a mask (text files) the loss is the mean over every position, as before masks:
    each pass's cross-entropy over positions j … T − 2 and its feature loss over j … T − 1."""
    target, head, draft, ids, _ = setup
    options = TrainOptions(unroll=2, seq_len=12)
    features, logits = _features_and_logits(target, ids)
    everything = torch.ones_like(ids, dtype=torch.bool)
    assert torch.equal(_weights(None, ids), _weights(everything, ids))
    loss = _loss(head, draft, target, ids, features, logits, options, _weights(everything, ids), 1.0)
    passes, predicted = train._passes(head, draft, target, ids, features, 2)
    law = torch.softmax(logits[:, :-1], dim=-1)
    parts = [-(law[:, j:] * torch.log_softmax(mine[:, j:-1], dim=-1)).sum(-1).mean()
             + torch.nn.functional.smooth_l1_loss(predicted[j][:, j:], features[:, j:]) for j, mine in enumerate(passes)]
    torch.testing.assert_close(loss, (parts[0] + 0.8 * parts[1]) / 1.8, rtol=1e-6, atol=1e-7)


def test_training_with_a_mask_counts_answers_and_its_draft_vocabulary_holds_them(setup):
    target, _, _, _, _ = setup
    chunks = torch.randint(0, 60, (16, 12), generator=torch.Generator().manual_seed(2))
    chunks[:, :6] = 63  # prompts of one token the drafter never drafts
    mask = torch.zeros_like(chunks, dtype=torch.bool)
    mask[:, 6:] = True
    assert 63 not in draft_vocab(chunks, 8, (), mask).tolist() and 63 in draft_vocab(chunks, 8).tolist()
    options = TrainOptions(steps=3, batch=4, seq_len=12, draft_vocab=8, estimate_every=3)
    head, log = train_head("feature", target, chunks, options, estimate=chunks[:4], progress=False, mask=mask,
                           estimate_mask=mask[:4])
    assert 63 not in head.vocab.tolist()
    assert log["tokens"] == 3 * 4 * 12 and log["target_tokens"] == 3 * 4 * 6  # positions 5 … 10 predict 6 … 11
    with pytest.raises(ValueError, match="chunks' shape"):
        train_head("feature", target, chunks, options, progress=False, mask=mask[:, :5])
