"""SPEC.md §4: DatastoreDrafter (retrieval drafting from a fixed token store)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashspec
from flashspec.drafters import DatastoreDrafter
from flashspec.sampling import SamplingParams
from tiny_models import history_of, tiny_model

GREEDY = SamplingParams()


history = history_of


def reference(store: list[int], row: list[int], max_ngram: int, min_ngram: int, k: int) -> list[int]:
    """Brute force: for n = max..min, the occurrences in the store of the row's last n tokens
    that something follows; the token that most often follows (ties: the smaller id); the
    tokens after its earliest such occurrence, padded with the row's last token."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(row) < n:
            continue
        suffix = row[-n:]
        starts = [i for i in range(len(store) - n) if store[i : i + n] == suffix]
        if not starts:
            continue
        counts = Counter(store[i + n] for i in starts)
        token = min(counts, key=lambda t: (-counts[t], t))
        i = next(i for i in starts if store[i + n] == token)
        follow = store[i + n : i + n + k]
        return follow + [row[-1]] * (k - len(follow))
    return [row[-1]] * k


def context_reference(row: list[int], max_ngram: int, min_ngram: int, k: int) -> list[int] | None:
    """Prompt lookup in the row itself (NgramDrafter's rule); None without a match."""
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = row[len(row) - n:] if len(row) >= n + 1 else None
        for start in range(len(row) - n - 1, -1, -1) if suffix else ():
            if row[start : start + n] == suffix:
                follow = row[start + n : start + n + k]
                return follow + [row[-1]] * (k - len(follow))
    return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    store=st.lists(st.integers(0, 5), min_size=4, max_size=60),
    rows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=4),
    k=st.integers(1, 7),
    sizes=st.tuples(st.integers(1, 3), st.integers(1, 3)).map(sorted),
    pad=st.integers(0, 3),
    in_context=st.booleans(),
)
def test_proposal_equals_brute_force(store, rows, k, sizes, pad, in_context):
    """Every batch size (1 included), draft length (γ = 1 included), n-gram range and padding;
    with and without the request's own text searched first."""
    min_ngram, max_ngram = sizes
    if len(store) < max_ngram + 1:
        store = store + [0] * (max_ngram + 1 - len(store))
    drafter = DatastoreDrafter(store, max_ngram=max_ngram, min_ngram=min_ngram, in_context=in_context)
    hist = history(rows, capacity=max(len(r) for r in rows) + pad)
    drafter.begin(len(rows))
    draft = drafter.propose(hist, k, GREEDY, torch.rand(len(rows), k, dtype=torch.float64))
    assert draft.probs is None and draft.tokens.shape == (len(rows), k)
    for b, row in enumerate(rows):
        expected = (context_reference(row, max_ngram, min_ngram, k) if in_context else None) \
            or reference(store, row, max_ngram, min_ngram, k)
        assert draft.tokens[b].tolist() == expected


def test_longest_match_wins_and_large_token_ids_are_exact():
    big = 151_000  # Qwen-sized ids: packed keys stay exact
    store = [1, 2, 3, 7, 7, big, 2, 3, 9, 9, 4, 2, 3, 9, 8]
    drafter = DatastoreDrafter(store, max_ngram=3, min_ngram=1, in_context=False)
    draft = drafter.propose(history([[5, 2, 3], [1, 2, 3], [big, 2, 3]]), 2, GREEDY, torch.zeros(3, 2))
    # [5,2,3]: no trigram; bigram (2,3) is followed by 7 once and 9 twice → 9, 9 (its first 9).
    # [1,2,3] and [big,2,3]: their trigrams → 7, 7 and 9, 9.
    assert draft.tokens.tolist() == [[9, 9], [7, 7], [9, 9]]


@pytest.mark.parametrize("store, options, message", [
    ([[1, 2], [3, 4]], {}, "1-D"),
    ([0.5, 1.0, 2.0, 3.0, 4.0], {}, "1-D"),
    ([1, 2], {}, "at least max_ngram"),
    ([1, 2, 3, 4, 5], {"max_ngram": 4}, "max_ngram <= 3"),
    ([1, 2, 3, 4, 5], {"min_ngram": 0}, "1 <= min_ngram"),
    ([1, 2, 3, 4, 5], {"min_ngram": 3, "max_ngram": 2}, "min_ngram <= max_ngram"),
    ([1, -2, 3, 4, 5], {}, "Token ids"),
    ([1, 2, 3, 1 << 21], {}, "Token ids"),
    ([], {}, "store is empty"),
    ([1, 2, 3, 4, 5], {"max_ngram": True}, "min_ngram <= max_ngram"),
])
def test_bad_stores_and_sizes_are_value_errors(store, options, message):
    with pytest.raises(ValueError, match=message):
        DatastoreDrafter(store, **options)


def test_from_text_tokenizes_and_names():
    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

    drafter = DatastoreDrafter.from_text("abcabd", Tokenizer(), name="code")
    assert drafter.name == "code" and len(drafter) == 6
    with pytest.raises(ValueError, match="tokenizes to nothing"):
        DatastoreDrafter.from_text("", Tokenizer())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_engine_output_equals_target_only(arch, gamma):
    """A store drafted from the target's own greedy text is mostly accepted, never changes
    the output (batch of ragged prompts, float32)."""
    torch.manual_seed(0)
    target = tiny_model(arch, seed=3)
    prompts = [[5, 9, 17], [3, 8, 3, 8, 3, 8], [40, 41, 42, 43, 40]]
    plain = flashspec.SpeculativeEngine(target, [], device="cpu")
    expected = plain.generate(prompts, max_new_tokens=16, eos_token_id=[]).sequences
    store = [t for p, s in zip(prompts, expected) for t in p + s] + list(range(50))
    engine = flashspec.SpeculativeEngine(target, [DatastoreDrafter(store, name="own")], device="cpu")
    out = engine.generate(prompts, max_new_tokens=16, num_draft_tokens=gamma, eos_token_id=[])
    assert out.sequences == expected
    assert out.stats.accepted > 0
    noisy = flashspec.SpeculativeEngine(target, [DatastoreDrafter(list(range(128)) * 2)], device="cpu")
    assert noisy.generate(prompts, max_new_tokens=16, num_draft_tokens=gamma, eos_token_id=[]).sequences == expected


def test_engine_refuses_a_store_outside_the_target_vocabulary():
    target = tiny_model("llama", seed=0)  # 128 tokens
    with pytest.raises(ValueError, match="stores token id 500.*128 tokens"):
        flashspec.SpeculativeEngine(target, [DatastoreDrafter([1, 2, 500, 3])], device="cpu")
