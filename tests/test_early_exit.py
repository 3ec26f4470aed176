"""The early-exit drafter (SPEC.md §11): the target's first N layers, its final norm and head,
sharing the target's weights and KV cache. Greedy output is the target's (tests/test_greedy.py
runs it on every cached architecture) and so is the sampled law (tests/test_distribution.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashspec import EarlyExitDrafter, SpeculativeEngine
from tiny_models import noisy_copy, tiny_model

LAYERS = 2  # tiny_models' depth


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=3)


def _reference(target, prompts, n):
    return SpeculativeEngine(target, [], device="cpu").generate(prompts, max_new_tokens=n, eos_token_id=[]).sequences


def test_it_shares_the_targets_weights_and_cache(target):
    """No weight is copied: the drafter holds the target's cache wrapper itself and no tensors."""
    engine = SpeculativeEngine(target, ["early-exit:1"], device="cpu")
    drafter = engine.drafters[0]
    assert isinstance(drafter, EarlyExitDrafter) and drafter.target is engine._target_lm
    target_storages = {p.untyped_storage().data_ptr() for p in target.parameters()}
    reachable = [v for v in vars(drafter).values() if isinstance(v, torch.Tensor)]
    assert not reachable  # nothing of its own
    assert {p.untyped_storage().data_ptr() for p in drafter.target.model.parameters()} == target_storages


def test_all_layers_is_the_target_itself(target):
    """N = L: the drafter's one-token forwards over the shared cache are the target's, so every
    greedy draft is accepted (drafter == target) and sampling with p == q accepts nearly all."""
    prompts = [[1, 2, 3, 4], [9, 8]]
    engine = SpeculativeEngine(target, [f"early-exit:{LAYERS}"], device="cpu")
    out = engine.generate(prompts, max_new_tokens=24, num_draft_tokens=4, eos_token_id=[])
    assert out.sequences == _reference(target, prompts, 24)
    assert out.stats.acceptance_rate > 0.99
    sampled = engine.generate(prompts, max_new_tokens=24, do_sample=True, temperature=0.7, eos_token_id=[], seed=0)
    assert sampled.stats.acceptance_rate > 0.99


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(layers=st.integers(1, LAYERS), gamma=st.integers(1, 6), batch=st.integers(1, 3),
       new_tokens=st.integers(1, 18), seed=st.integers(0, 3))
def test_greedy_output_is_the_targets_for_any_depth_gamma_and_batch(target, layers, gamma, batch, new_tokens, seed):
    prompts = [[(seed + 3 * b + i) % 100 for i in range(1 + 2 * b)] for b in range(batch)]
    engine = SpeculativeEngine(target, [f"early-exit:{layers}"], device="cpu")
    out = engine.generate(prompts, max_new_tokens=new_tokens, num_draft_tokens=gamma, eos_token_id=[])
    assert out.sequences == _reference(target, prompts, new_tokens)


def test_among_other_drafters_under_a_bandit(target):
    prompts = [[5, 6, 5, 6, 5], [1]]
    engine = SpeculativeEngine(target, ["early-exit:1", noisy_copy(target, 0.05, seed=1), "ngram"], gammas=[1, 3],
                               selector="thompson", selector_options={"seed": 0}, device="cpu")
    for _ in range(2):
        out = engine.generate(prompts, max_new_tokens=20, eos_token_id=[])
        assert out.sequences == _reference(target, prompts, 20)
    assert out.stats.per_drafter["early-exit:1"].steps > 0


@pytest.mark.parametrize("spec", ["early-exit:0", f"early-exit:{LAYERS + 1}", "early-exit:x", "early-exit:", "early-exit:-1"])
def test_bad_depths_are_refused(target, spec):
    with pytest.raises(ValueError, match="early-exit:N"):
        SpeculativeEngine(target, [spec], device="cpu")


def test_targets_without_the_static_cache_are_refused():
    gpt2 = tiny_model("gpt2", seed=0)
    with pytest.raises(ValueError, match="static cache"):
        SpeculativeEngine(gpt2, ["early-exit:1"], device="cpu")
