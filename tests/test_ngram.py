"""SPEC.md §4: NgramDrafter (prompt lookup)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashspec.drafters.base import Draft, History
from flashspec.drafters.ngram import NgramDrafter
from flashspec.sampling import SamplingParams
from tiny_models import history_of

GREEDY = SamplingParams()


history = history_of


def propose(drafter: NgramDrafter, hist: History, num_tokens: int, params=GREEDY) -> Draft:
    drafter.begin(hist.tokens.shape[0])
    uniforms = torch.rand(hist.tokens.shape[0], num_tokens, dtype=torch.float64)
    draft = drafter.propose(hist, num_tokens, params, uniforms)
    assert draft.probs is None  # deterministic: verified with one-hot q
    assert draft.tokens.dtype == torch.long
    assert draft.tokens.shape[0] == hist.tokens.shape[0]
    return draft


def reference(row: list[int], max_ngram: int, min_ngram: int, num_tokens: int) -> list[int] | None:
    """Brute force: for n = max..min, the most recent earlier occurrence of the last n tokens;
    the tokens that followed it (at most num_tokens, only committed ones). None: no match."""
    length = len(row)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length < n + 1:
            continue
        suffix = row[length - n :]
        for start in range(length - n - 1, -1, -1):  # window ends strictly before the suffix does
            if row[start : start + n] == suffix:
                follow = start + n
                return row[follow : min(length, follow + num_tokens)]
    return None


# ----------------------------------------------------------------------------------------------
# Hand-built histories
# ----------------------------------------------------------------------------------------------


def test_proposes_continuation_of_most_recent_match():
    # [1, 2] occurs at 0 (followed by 3) and at 3 (followed by 4): the later one wins
    draft = propose(NgramDrafter(max_ngram=2, min_ngram=1), history([[1, 2, 3, 1, 2, 4, 1, 2]]), 3)
    assert draft.tokens.tolist() == [[4, 1, 2]]
    # single-token lookup: the last 9 occurred before at 1 and 3; the one at 3 is followed by 6, 9
    row = [5, 9, 7, 9, 6, 9]
    draft = propose(NgramDrafter(max_ngram=1, min_ngram=1), history([row]), 2)
    assert draft.tokens.tolist() == [[6, 9]]


def test_longer_ngram_preferred():
    row = [3, 1, 2, 7, 5, 1, 2, 8, 3, 1, 2]
    # trigram [3, 1, 2] matches at 0 -> continues with 7, 5, 1
    assert propose(NgramDrafter(3, 1), history([row]), 3).tokens.tolist() == [[7, 5, 1]]
    # bigram [1, 2]: the most recent earlier match is at 5 -> 8, 3, 1
    assert propose(NgramDrafter(2, 1), history([row]), 3).tokens.tolist() == [[8, 3, 1]]
    # min_ngram above every matching size: no match, so the pending token is repeated
    assert propose(NgramDrafter(5, 4), history([row]), 3).tokens.tolist() == [[2, 2, 2]]


def test_falls_back_to_shorter_ngram():
    row = [4, 6, 0, 2, 8, 1, 5, 8]  # [1, 5, 8] and [5, 8] never occurred before; [8] did at 4
    assert propose(NgramDrafter(3, 1), history([row]), 3).tokens.tolist() == [[1, 5, 8]]
    assert propose(NgramDrafter(3, 2), history([row]), 3).tokens.tolist() == [[8, 8, 8]]


def test_no_match_repeats_the_pending_token():
    # Always num_tokens drafts (shapes fixed on the host); without a match, the pending token.
    draft = propose(NgramDrafter(3, 1), history([[1, 2, 3, 4], [5, 6, 7, 8]]), 4)
    assert draft.tokens.tolist() == [[4, 4, 4, 4], [8, 8, 8, 8]]
    # a single committed token can match nothing
    assert propose(NgramDrafter(3, 1), history([[7]]), 4).tokens.tolist() == [[7, 7, 7, 7]]


def test_zero_padding_never_matches():
    # the row ends in 0, the pad value; the padding after it must not count as an occurrence
    hist = history([[4, 3]], capacity=10)
    assert propose(NgramDrafter(2, 1), hist, 3).tokens.tolist() == [[3, 3, 3]]
    hist = history([[4, 0]], capacity=10)  # no match: the pending 0 repeated, not padding read
    assert propose(NgramDrafter(2, 1), hist, 3).tokens.tolist() == [[0, 0, 0]]
    hist = history([[0, 0, 0]], capacity=9)  # real zeros do match: [0, 0] at 0 -> 0, then pending
    assert propose(NgramDrafter(2, 1), hist, 4).tokens.tolist() == [[0, 0, 0, 0]]


def test_batch_of_one_and_num_tokens_one():
    hist = history([[10, 11, 12, 10, 11]])
    assert propose(NgramDrafter(2, 1), hist, 1).tokens.tolist() == [[12]]
    assert propose(NgramDrafter(2, 1), hist, 0).tokens.shape == (1, 0)


def test_continuation_shorter_than_num_tokens():
    hist = history([[5, 6, 7, 5, 6]])  # [5, 6] at 0: followed by 7, 5, 6 (3 committed tokens)
    draft = propose(NgramDrafter(2, 1), hist, 8)
    assert draft.tokens.tolist() == [[7, 5, 6, 6, 6, 6, 6, 6]]  # then the pending token


def test_rows_of_different_lengths():
    rows = [
        [1, 2, 3, 1, 2],  # [1, 2] at 0 -> 3, 1, 2
        [4, 5, 6],  # no match
        [9, 8, 9, 8, 7, 9, 8],  # [9, 8] most recent at 2 -> 7, 9, 8
        [2, 2],  # [2] at 0 -> 2
    ]
    hist = history(rows, capacity=12)
    draft = propose(NgramDrafter(2, 1), hist, 4)
    assert draft.tokens.shape == (4, 4)  # always num_tokens
    assert draft.tokens[1].tolist() == [6, 6, 6, 6]  # no match: the pending token
    assert draft.tokens[0].tolist() == [3, 1, 2, 2]
    assert draft.tokens[2].tolist() == [7, 9, 8, 8]
    assert draft.tokens[3].tolist() == [2, 2, 2, 2]
    assert (draft.tokens >= 0).all()
    # the same rows in another order give the same per-row proposals
    order = [2, 3, 0, 1]
    permuted = propose(NgramDrafter(2, 1), history([rows[i] for i in order], capacity=12), 4)
    assert permuted.tokens[0].tolist() == [7, 9, 8, 8]
    assert permuted.tokens[2].tolist() == [3, 1, 2, 2]


def test_does_not_depend_on_sampling_params_or_uniforms():
    hist = history([[1, 2, 3, 1, 2], [3, 3, 3, 3, 3]])
    drafter = NgramDrafter(3, 1)
    a = drafter.propose(hist, 3, SamplingParams(), torch.zeros(2, 3, dtype=torch.float64))
    b = drafter.propose(
        hist, 3, SamplingParams(do_sample=True, temperature=0.3, top_k=1), torch.rand(2, 3, dtype=torch.float64)
    )
    assert torch.equal(a.tokens, b.tokens)
    assert a.tokens.tolist()[0] == [3, 1, 2]
    # [3, 3, 3] most recently at 1: only the pending token 3 follows it
    assert a.tokens[1, :1].tolist() == [3]


@pytest.mark.parametrize(
    "max_ngram, min_ngram",
    [(0, 0), (1, 0), (2, 3), (3, -1), (-1, -2), (2.0, 1), (3, 1.5), ("3", 1), (None, 1)],
)
def test_bad_ngram_sizes_raise(max_ngram, min_ngram):
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)


def test_good_ngram_sizes_accepted():
    NgramDrafter()
    NgramDrafter(1, 1)
    NgramDrafter(max_ngram=7, min_ngram=2)


# ----------------------------------------------------------------------------------------------
# Property test against a brute-force reference
# ----------------------------------------------------------------------------------------------


@st.composite
def ngram_cases(draw):
    batch = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 4))  # small vocabularies: matches are common
    capacity = draw(st.integers(1, 20))
    rows = []
    for _ in range(batch):
        if draw(st.booleans()):
            row = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=capacity))
        else:  # a repeated pattern with a few edits: long n-grams match at different places
            pattern = draw(st.lists(st.integers(0, vocab + 2), min_size=1, max_size=5))
            length = draw(st.integers(1, capacity))
            row = (pattern * capacity)[:length]
            for _ in range(draw(st.integers(0, 3))):
                row[draw(st.integers(0, length - 1))] = draw(st.integers(0, vocab + 2))
        rows.append(row)
    max_ngram = draw(st.integers(1, 4))
    min_ngram = draw(st.integers(1, max_ngram))
    num_tokens = draw(st.integers(0, 6))
    return rows, capacity, max_ngram, min_ngram, num_tokens


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ngram_cases())
def test_matches_bruteforce_reference(case):
    rows, capacity, max_ngram, min_ngram, num_tokens = case
    hist = history(rows, capacity=capacity)
    draft = propose(NgramDrafter(max_ngram, min_ngram), hist, num_tokens)
    expected = [reference(r, max_ngram, min_ngram, num_tokens) for r in rows]
    assert draft.tokens.shape == (len(rows), num_tokens)
    for b, e in enumerate(expected):
        # the matched continuation (if any), then the pending token repeated
        e = e or []
        assert draft.tokens[b].tolist() == e + [rows[b][-1]] * (num_tokens - len(e)), (b, rows[b])
    assert (draft.tokens >= 0).all()
    # the history is not modified
    assert torch.equal(hist.tokens, history(rows, capacity=capacity).tokens)
    # whatever lies past a row's length (stale tokens instead of zeros) is never read
    stale = hist.tokens.clone()
    past = torch.arange(capacity)[None, :] >= hist.length[:, None]
    stale[past] = (torch.arange(capacity).expand(len(rows), -1)[past] * 7 + 1) % 5
    again = propose(NgramDrafter(max_ngram, min_ngram), History(stale, hist.length.clone()), num_tokens)
    assert torch.equal(again.tokens, draft.tokens)
