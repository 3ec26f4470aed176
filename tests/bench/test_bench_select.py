"""``flashspec bench select`` (flashspec.bench.select.run_selection) on tiny models and a tiny corpus: every
system decodes every prompt, warm-started bandits learn on training text only, errors are clear."""

from __future__ import annotations

import lzma

import pytest

from flashspec import SpeculativeEngine
from flashspec.data.corpus import DOMAINS, HELDOUT_FRACTION, heldout_text
from flashspec.bench.select import run_selection
from tiny_models import CharTokenizer, noisy_copy, tiny_model, write_tiny_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"), lines=2000)


def test_training_part_is_the_text_just_before_the_heldout_part(corpus):
    for domain, name in DOMAINS.items():
        whole = lzma.decompress((corpus / name).read_bytes()).decode()
        held, train = heldout_text(corpus, domain), heldout_text(corpus, domain, part="train")
        assert whole.endswith(train + held)  # adjacent, disjoint, in this order
        assert heldout_text(corpus, domain, part="fit") + train + held == whole  # "fit": the first 90 %
        assert len(held) <= HELDOUT_FRACTION * len(whole) and len(train) <= 1.01 * HELDOUT_FRACTION * len(whole)
    with pytest.raises(ValueError, match="part must be"):
        heldout_text(corpus, "code", part="test")


def test_every_system_decodes_every_prompt_and_warm_starts_add_copies(corpus):
    target = tiny_model("llama", seed=0)
    engine = SpeculativeEngine(target, [noisy_copy(target, 0.05, seed=1), "ngram"], gammas=[2, 3],
                               tokenizer=CharTokenizer())
    bandits = {"thompson (per domain)": {"selector": "thompson", "options": {"seed": 0}, "context": "domain"}}
    results = run_selection(engine, corpus, bandits=bandits, prompts_per_domain=2, prompt_tokens=12,
                            max_new_tokens=10, warm_start_prompts=2)
    fixed = [f"fixed {engine.arm_label(a)}" for a in range(4)]
    expected = fixed + ["thompson (per domain)", "thompson (per domain), warm-started"]
    assert results["settings"]["warm_start_prompts_per_domain"] == 2
    assert len(results["rows"]) == 2 * len(DOMAINS)
    for row in results["rows"]:
        assert list(row["systems"]) == expected
        for name, system in row["systems"].items():
            assert system["tokens"] == 10 and system["seconds"] > 0
            if name.startswith("fixed"):  # a fixed arm never plays another
                assert list(system["arms"]) == [name.removeprefix("fixed ")]


def test_store_drafters_index_training_text_only(corpus):
    """``store:DOMAIN`` → a DatastoreDrafter over the end of that domain's first 95 % (never the
    held-out prompts' text); other specs pass through; bad domains and sizes are clear errors."""
    from flashspec.data.corpus import store_drafters, training_text

    whole = lzma.decompress((corpus / DOMAINS["code"]).read_bytes()).decode()
    held = heldout_text(corpus, "code")
    text = training_text(corpus, "code", max_bytes=2000)
    assert whole.endswith(text + held) and 0 < len(text) <= 2000 and text.startswith(whole[-len(text + held):][:5])
    assert training_text(corpus, "code", max_bytes=10**9) + held == whole
    drafters = store_drafters(["store:code", "ngram", "store:chat"], corpus, CharTokenizer(), max_bytes=2000)
    assert [getattr(d, "name", d) for d in drafters] == ["store-code", "ngram", "store-chat"]
    assert drafters[0].store.tolist() == CharTokenizer()(text)["input_ids"]
    with pytest.raises(ValueError, match="Unknown domain 'poetry'"):
        store_drafters(["store:poetry"], corpus, CharTokenizer())
    with pytest.raises(ValueError, match="max_bytes"):
        training_text(corpus, "code", max_bytes=0)
    engine = SpeculativeEngine(tiny_model("llama", seed=0), drafters, gammas=[2], tokenizer=CharTokenizer())
    assert [engine.arm_label(a) for a in range(3)] == ["store-code@2", "ngram@2", "store-chat@2"]
