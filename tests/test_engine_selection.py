"""SPEC.md §8 in the engine: arms are (drafter, γ) pairs, observations reach the selector
(lagged, with step times), state per context / per request, save and load."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flashspec import SpeculativeEngine
from flashspec.select import Observation


def llama(seed: int = 0, vocab: int = 40) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


TARGET, DRAFT = llama(0), llama(3)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7]]


class Recorder:
    """Round-robin over the arms; records every observation."""

    def __init__(self, num_arms: int) -> None:
        self.num_arms, self.t, self.seen = num_arms, 0, []

    def select(self) -> int:
        self.t += 1
        return (self.t - 1) % self.num_arms

    def update(self, arm, observation) -> None:
        self.seen.append((arm, observation))


def test_arms_are_drafter_gamma_pairs_with_their_own_statistics():
    recorder = Recorder(4)
    engine = SpeculativeEngine(TARGET, [DRAFT, "ngram"], gammas=[1, 3], selector=recorder)
    assert [engine.arm_label(a) for a in range(4)] == ["llama@1", "llama@3", "ngram@1", "ngram@3"]
    out = engine.generate(PROMPTS, max_new_tokens=20, eos_token_id=[])
    per_arm = out.stats.per_arm
    assert set(per_arm) == {"llama@1", "llama@3", "ngram@1", "ngram@3"}
    assert sum(a.steps for a in per_arm.values()) == len(recorder.seen)
    for label, gamma in (("llama@1", 1), ("llama@3", 3), ("ngram@1", 1), ("ngram@3", 3)):
        arm = per_arm[label]
        assert arm.steps > 0 and arm.proposed % gamma == 0 and arm.proposed >= arm.accepted
    # the γ of each observation is the arm's: proposed = γ × active rows
    gammas = [1, 3, 1, 3]
    for arm, obs in recorder.seen:
        assert obs.proposed % gammas[arm] == 0 and obs.proposed // gammas[arm] in (1, 2)


@pytest.mark.parametrize("sync_every", [1, 4])
def test_observations_add_up_to_the_statistics(sync_every):
    recorder = Recorder(2)
    engine = SpeculativeEngine(TARGET, [DRAFT], gammas=[2, 4], selector=recorder)
    out = engine.generate(PROMPTS, max_new_tokens=25, eos_token_id=[], sync_every=sync_every)
    seen = [obs for _, obs in recorder.seen]
    assert all(isinstance(o, Observation) and o.seconds > 0 for o in seen)
    assert sum(o.accepted for o in seen) == out.stats.accepted
    assert sum(o.proposed for o in seen) == out.stats.proposed
    assert sum(o.tokens for o in seen) == out.stats.decode_tokens
    assert out.stats.selector_seconds > 0


def test_greedy_output_does_not_depend_on_the_selector():
    prompts = [[1, 2, 3, 4, 1, 2, 3]]
    alone = SpeculativeEngine(TARGET, []).generate(prompts, max_new_tokens=24, eos_token_id=[]).sequences
    for name in ("ucb1", "thompson", "sliding-window-ucb", "epsilon-greedy"):
        engine = SpeculativeEngine(TARGET, [DRAFT, "ngram"], gammas=[1, 4], selector=name,
                                   selector_options={"seed": 1})
        assert engine.generate(prompts, max_new_tokens=24, eos_token_id=[]).sequences == alone


def test_each_context_learns_separately_and_the_state_survives_a_restart(tmp_path):
    options = {"reward": "acceptance", "seed": 0}
    engine = SpeculativeEngine(TARGET, [DRAFT, "ngram"], gammas=[2], selector="ucb1", selector_options=options)
    engine.generate(PROMPTS, max_new_tokens=12, eos_token_id=[], context="code")
    engine.generate(PROMPTS, max_new_tokens=12, eos_token_id=[], context=("chat", 1))
    assert engine.selection.selector.total_updates == 0  # the default state saw neither request
    assert engine.selection.contexts["code"].total_updates > 0
    path = tmp_path / "selector.json"
    engine.selection.save(str(path))
    restarted = SpeculativeEngine(TARGET, [DRAFT, "ngram"], gammas=[2], selector="ucb1", selector_options=options)
    restarted.selection.load(str(path))
    assert restarted.selection.state_dict() == engine.selection.state_dict()
    assert json.loads(path.read_text())["contexts"]  # plain JSON on disk
    # both continue identically
    a = engine.generate(PROMPTS, max_new_tokens=12, eos_token_id=[], context="code").stats.per_arm
    b = restarted.generate(PROMPTS, max_new_tokens=12, eos_token_id=[], context="code").stats.per_arm
    assert {k: v.steps for k, v in a.items()} == {k: v.steps for k, v in b.items()}


def test_per_request_selection_starts_afresh_each_time():
    engine = SpeculativeEngine(TARGET, [DRAFT, "ngram"], selector="ucb1", share_selector=False,
                               selector_options={"reward": "acceptance", "seed": 0})
    first = engine.generate(PROMPTS, max_new_tokens=12, eos_token_id=[]).stats.per_arm
    second = engine.generate(PROMPTS, max_new_tokens=12, eos_token_id=[]).stats.per_arm
    assert {k: v.steps for k, v in first.items()} == {k: v.steps for k, v in second.items()}
    assert engine.selection.selector.total_updates == 0


@pytest.mark.parametrize("gammas", [[], [0], [2, -1], [1.5], [True], "2"])
def test_bad_gammas_raise(gammas):
    with pytest.raises(ValueError, match="gammas"):
        SpeculativeEngine(TARGET, [DRAFT], gammas=gammas)


def test_bad_context_and_state_raise(tmp_path):
    engine = SpeculativeEngine(TARGET, [DRAFT, "ngram"], selector="ucb1")
    with pytest.raises(ValueError, match="context"):
        engine.generate(PROMPTS, max_new_tokens=4, context=["not", "hashable"])
    with pytest.raises(ValueError, match="selector state"):
        engine.selection.load_state_dict({"nonsense": 1})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="selector state"):
        engine.selection.load(str(bad))
    with pytest.raises(ValueError, match="arm"):  # a selector for 3 arms, but 1 is configured
        SpeculativeEngine(TARGET, [DRAFT], selector=Recorder(3))


def test_selections_are_independent_learners_on_one_engine():
    """``engine.selection`` and assigning it: two learning states on one engine, each keeps
    its own shared selector and its own per-context selectors."""
    engine = SpeculativeEngine(TARGET, [DRAFT, "ngram"], gammas=[2], selector="ucb1", selector_options={"seed": 0})
    first = engine.selection
    engine.selection = engine.new_selection("thompson", seed=1)
    second = engine.selection
    assert first.selector is not second.selector
    engine.selection = first
    engine.generate([PROMPTS[0]], max_new_tokens=8, eos_token_id=[], context="code")
    assert set(first.contexts) == {"code"} and second.contexts == {}
    engine.selection = second
    engine.generate([PROMPTS[1]], max_new_tokens=8, eos_token_id=[])
    assert second.selector.total_updates > 0 and set(first.contexts) == {"code"}
    with pytest.raises(ValueError, match="must be a Selection"):
        engine.selection = {"selector": None}
    target_only = SpeculativeEngine(TARGET, [])
    with pytest.raises(ValueError, match="different set of arms"):
        target_only.selection = first


def test_target_only_engine_still_checks_the_selector_name():
    engine = SpeculativeEngine(TARGET, [])
    engine.new_selection("thompson")  # nothing to choose among, but a valid name
    with pytest.raises(ValueError, match="Unknown selector 'thompsen'"):
        engine.new_selection("thompsen")
    with pytest.raises(ValueError, match="Bad option"):
        engine.new_selection("ucb1", windw=3)


# ------------------------------------------------------------------ drafter catch-up window widths

from hypothesis import given, settings, strategies as st  # noqa: E402

from flashspec.drafters.base import History  # noqa: E402
from flashspec.drafters.model import ModelDrafter  # noqa: E402
from flashspec.drafters.base import Seen  # noqa: E402
from flashspec.models.graphs import Graphs  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(bound=st.integers(1, 4200), seen_offset=st.integers(-64, 4096), first=st.booleans(),
       capacity=st.integers(2, 4096), graphs=st.booleans())
def test_drafter_window_covers_unseen_tokens_with_few_distinct_widths(bound, seen_offset, first, capacity, graphs):
    """SPEC §4: the re-fed window covers every token the cache has not seen (at most the whole
    cache); with CUDA graphs it is always one of the drafter's few widths (2, then powers of two
    from 16, then the capacity: one graph each, captured together), the first proposal's too;
    without them it stops at the bound (the history's length, a prefill's width)."""
    drafter = ModelDrafter.__new__(ModelDrafter)  # _window reads only _seen and _graphs
    drafter._graphs = Graphs(enabled=False)
    drafter._graphs.enabled = graphs
    drafter._seen = Seen()
    drafter._seen.mark = None if first else max(0, bound - seen_offset)
    history = History(torch.zeros(1, capacity, dtype=torch.long), torch.ones(1, dtype=torch.long), max_length=bound)
    window = drafter._window(history)
    unseen = bound if first else max(2, 2 + bound - drafter._seen.mark)
    assert 1 <= window <= capacity
    assert window >= min(unseen, capacity, bound)  # nothing unseen is left out
    if graphs:
        assert window in drafter.widths(capacity)
        assert len(drafter.widths(capacity)) <= 2 + max(capacity, 16).bit_length() - 4
    else:
        assert window <= bound
        assert window == min(bound, capacity) or window & (window - 1) == 0
    if first:
        assert window >= min(bound, capacity)
    elif unseen <= 2:  # the same drafter drafted the previous step
        assert window == min(2, capacity) or window == min(bound, capacity)
    else:  # a switch: one width for every short gap
        assert window >= min(ModelDrafter.SWITCH_WINDOW, capacity, bound)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), gamma=st.integers(1, 6), steps=st.integers(0, 40))
def test_growth_bounds_every_rows_growth_and_is_exact_once_polled_at_batch_one(data, batch, gamma, steps):
    """SPEC §4, "Catch-up windows": ``Growth.since(j)`` bounds how far any row grew over steps
    j, j + 1, … — k + 1 for a step not polled yet, at most what the step committed over all rows
    once polled — so a window sized from it never leaves a position unfed; at batch 1, with
    every step polled, it is exact (a gap of drafting steps that committed one token each costs
    one position each, not γ + 1)."""
    from flashspec.drafters.base import Growth

    growth, commits, polled = Growth(), [], 0
    for _ in range(steps):
        k = data.draw(st.integers(0, gamma))
        rows = [data.draw(st.integers(0, k + 1)) for _ in range(batch)]
        growth.launched(k)
        commits.append(rows)
        upto = data.draw(st.integers(polled, len(commits)))
        for i in range(polled, upto):
            growth.polled(sum(commits[i]))
        polled = upto
    assert growth.steps == steps
    for j in range(steps + 2):
        truth = max(sum(c[r] for c in commits[j:]) for r in range(batch)) if commits[j:] else 0
        assert growth.since(j) >= truth
        if batch == 1 and polled == steps:
            assert growth.since(j) == truth
    if batch == 1 and polled == steps and steps:
        history = History(torch.zeros(1, 8, dtype=torch.long), torch.ones(1, dtype=torch.long), growth=growth)
        assert history.grown_since(history.mark()) == 0 and history.grown_since(0) == sum(c[0] for c in commits)


def test_growth_forgets_old_steps_as_everything_unseen():
    """Only Growth.KEPT steps are kept (a server's batch runs for ever): a reading older than
    them counts as having missed everything, which every window clamps to the whole cache."""
    from flashspec.drafters.base import Growth

    growth = Growth()
    for _ in range(Growth.KEPT + 10):
        growth.launched(0)
        growth.polled(1)
    assert growth.steps == Growth.KEPT + 10
    assert growth.since(Growth.KEPT + 10) == 0 and growth.since(20) == Growth.KEPT - 10
    assert growth.since(3) >= 1 << 30
