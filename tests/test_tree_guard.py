"""The never-slower guard for draft trees (flashspec/select/tree_guard.py; SPEC.md §7, "The
never-slower guard for trees"): the admission inequality, the lower-bound yields from full
information, catch-up prices and their memory, cold and stalled steps, a Hypothesis test of the
bound over adversarial preferences, and in the engine: greedy output unchanged, a stalled drafter
drafting again, the budget's cost model not poisoned by a stall, errors."""

from __future__ import annotations

import random
import types

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

import flashspec
from flashspec.decode import tree_loop
from flashspec.drafters.ngram import NgramDrafter
from flashspec.select.tree_budget import TreeBudget
from flashspec.select.tree_guard import RANKED, TreeGuardMemory, TreeGuard


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads on a busy 2-core machine (as test_greedy.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ratio_of(costs):
    """A cost model in target steps: ``costs[allocation]``, 1 for the target-only step."""
    return lambda a: 1.0 if not any(a) else costs[tuple(a)]


def measured(guard, steps=10, seconds=1.0, rows=1):
    """``steps`` target-only steps of ``seconds`` for ``rows`` tokens: s₀ = seconds, r₀ = rows / seconds."""
    zeros = (0,) * guard.drafters
    for _ in range(steps):
        guard.observe(zeros, seconds, rows, rows, [[-1] * rows] * guard.drafters, [1] * rows, {},
                      [0.0] * guard.drafters)
    return guard


# ---------------------------------------------------------------------------------- admission
def test_nothing_drafts_before_the_target_alone_was_measured():
    guard = TreeGuard(2, 0.01, ratio_of({(4, 0): 1.2}))
    assert guard.choose([(4, 0)], lambda a: {}) == (0, 0)
    assert guard.refused == 1
    assert guard.choose([(0, 0)], lambda a: {}) == (0, 0) and guard.refused == 1  # target-only asked: no refusal


def test_the_inequality_admits_what_fits_and_refuses_the_rest():
    """S = 10 s, N = 10 tokens (r₀ = 1, s₀ = 1): an allocation of 2.0 target steps counted at one
    token fits (10 + 2 ≤ 1.01 · 11 + 1 = 12.11); one of 2.2 does not (12.2 > 12.11)."""
    guard = measured(TreeGuard(2, 0.01, ratio_of({(4, 0): 2.0, (0, 3): 2.2, (4, 3): 9.0})))
    assert guard.fits((4, 0), {}) and not guard.fits((0, 3), {})
    assert guard.estimate((0, 3), {}) == pytest.approx(2.2)
    # the first preference refused, the next that fits taken; refusals counted once per step
    assert guard.choose([(0, 3), (4, 3), (4, 0)], lambda a: {}) == (4, 0) and guard.refused == 1
    assert guard.choose([(4, 3), (0, 3)], lambda a: {}) == (0, 0) and guard.refused == 2


def test_an_allocation_the_cost_model_never_measured_is_a_probe_of_one_target_step():
    """Unmeasured, an allocation is admitted as if it cost one target step (so that it gets measured),
    but its step is a stall only beyond OUTLIER times the cost model's own (pessimistic) prediction;
    an allocation taken for a stall KEPT_REQUESTS times is then taken at its word."""
    memory = TreeGuardMemory()
    guard = measured(TreeGuard(1, 0.01, ratio_of({(4,): 5.0}), memory, measured=lambda a: False))
    assert guard.cost((4,)) == pytest.approx(1.0) and guard.fits((4,), {})
    for stalls in range(1, 5):  # 21 s > 4 · 5 s
        assert guard.observe((4,), 21.0, 5, 1, [[4]], [5], {}, [0.1]) is False
        assert memory.stalls[(4,)] == stalls and guard.cost((4,)) == pytest.approx(1.0)
    assert guard.observe((4,), 21.0, 5, 1, [[4]], [5], {}, [0.1]) is True
    assert guard.cost((4,)) == pytest.approx(21.0)
    fresh = measured(TreeGuard(1, 0.01, ratio_of({(4,): 5.0}), measured=lambda a: False))
    assert fresh.observe((4,), 19.0, 5, 1, [[4]], [5], {}, [0.1]) is True  # below 4 · 5 s: a real cost


def test_only_so_many_ranked_allocations_are_tried():
    tried = []
    guard = measured(TreeGuard(1, 0.01, lambda a: 50.0 if any(a) else 1.0))
    guard.fits = lambda a, w: tried.append(a) or False
    guard.choose([(1,)] * 50, lambda a: {})
    assert len(tried) == 1 + RANKED


def test_yields_are_lower_bounds_from_every_step_that_ran_the_drafters():
    """Drafter 0 ran at γ 3 (would-be lengths 2 and 3 in two rows that committed 3 and 4 tokens),
    drafter 1 at γ 1 (0 and 1): ŷ((3, 0)) = (mean(min(3, 3), min(4, 4)) + 2) / (1 + 2); ŷ((0, 1)) from
    the same step, mean(1, 2); ŷ((3, 1)) the longest of the two per row; a step that did not run
    drafter 1 informs nothing about it."""
    guard = TreeGuard(2, 0.01, ratio_of({}))
    guard.observe((3, 1), 1.0, 7, 2, [[2, 3], [0, 1]], [3, 4], {}, [0.0, 0.0])
    assert guard.expected_yield((3, 0)) == pytest.approx((3.5 + 2) / 3)
    assert guard.expected_yield((0, 1)) == pytest.approx((1.5 + 2) / 3)
    assert guard.expected_yield((3, 1)) == pytest.approx((3.5 + 2) / 3)
    assert guard.expected_yield((1, 0)) == pytest.approx((2.0 + 2) / 3)  # capped at its own γ
    guard.observe((3, 0), 1.0, 2, 2, [[0, 0], [-1, -1]], [1, 1], {}, [0.0, 0.0])
    assert guard.expected_yield((0, 1)) == pytest.approx((1.5 + 2) / 3)  # unchanged: drafter 1 did not run
    assert guard.expected_yield((3, 0)) == pytest.approx((3.5 + 1 + 2) / 4)
    assert guard.expected_yield((0, 0)) == 1.0


def test_a_measured_allocation_costs_its_own_median():
    guard = measured(TreeGuard(1, 0.5, ratio_of({(2,): 3.0})))
    assert guard.cost((2,)) == pytest.approx(3.0)
    for seconds in (1.2, 1.4, 3.0):  # 3 s: above its estimate, but within OUTLIER = 4 of it
        guard.observe((2,), seconds, 3, 1, [[2]], [3], {}, [0.1])
    assert guard.cost((2,)) == pytest.approx(1.4)


# ---------------------------------------------------------------------------------- catch-ups
def test_a_catch_up_is_priced_from_the_prefill_then_from_what_it_cost():
    rates = TreeGuardMemory()
    guard = measured(TreeGuard(2, 0.01, ratio_of({(2, 0): 1.1}), rates, layer_ratios={0: 0.5}))
    assert guard.catch_up_cost(0, 300) is None and not guard.fits((2, 0), {0: 300})  # nothing prices it yet
    assert guard.catch_up_cost(0, 0) == 0.0
    guard.prefill(0.2, 100)  # 2 ms a position
    assert guard.catch_up_cost(0, 300) == pytest.approx(0.5 * 512 * 0.002)  # λ · max(T_p, b · T_p / L_p)
    assert guard.catch_up_cost(1, 3) == pytest.approx(0.2)  # λ = 1, at least the prefill
    guard.observe((2, 0), 1.2, 3, 1, [[2], [-1]], [3], {0: 300}, [0.03, 0.0])
    assert guard.catch_up_cost(0, 300) == pytest.approx(0.03 / 300 * 512)
    assert guard.cost((2, 0)) == pytest.approx(1.1)  # a step with a catch-up is not a steady measurement
    later = TreeGuard(2, 0.01, ratio_of({}), rates)  # the next call starts from the engine's memory
    assert later.catch_up_cost(0, 100) == pytest.approx(0.03 / 300 * 128)


# ---------------------------------------------------------------------------------- cold steps, stalls
def test_a_cold_step_counts_nowhere_and_a_stall_is_not_a_cost():
    guard = measured(TreeGuard(1, 0.01, ratio_of({(2,): 1.5})))
    before = (guard.seconds, guard.tokens)
    assert guard.observe((2,), 30.0, 3, 1, [[2]], [3], {}, [0.1], cold=True) is False
    assert (guard.seconds, guard.tokens) == before and not guard.history
    assert guard.observe((2,), 30.0, 3, 1, [[2]], [3], {}, [0.1]) is False  # 30 s > 4 · 1.5 s: a stall
    assert guard.seconds == before[0] + 30.0 and guard.cost((2,)) == pytest.approx(1.5)
    assert guard.observe((2,), 1.4, 3, 1, [[2]], [3], {}, [0.1]) is True
    assert guard.cost((2,)) == pytest.approx(1.4)


# ---------------------------------------------------------------------------------- the bound
@settings(max_examples=150, deadline=None)
@given(drafters=st.integers(1, 3), slack=st.sampled_from([0.0, 0.01, 0.05]), rows=st.integers(1, 4),
       steps=st.integers(1, 120), seed=st.integers(0, 2**16))
def test_a_call_is_never_slower_than_the_budget(drafters, slack, rows, steps, seed):
    """Allocations of fixed costs (in target steps, as the cost model says), adversarial preferences
    drawn at random, and a world where each drafter's would-be length in each row is random: after
    every step the time spent stays within (1 + δ) of the target alone's time for the same tokens plus
    one target step, plus what admitted steps made short of the yield they were counted at."""
    rng = random.Random(seed)
    gamma_max = [rng.randint(1, 4) for _ in range(drafters)]
    allocations = [tuple(rng.randint(0, g) for g in gamma_max) for _ in range(8)]
    costs = {a: rng.uniform(1.0, 3.0) for a in allocations if any(a)}
    guard = TreeGuard(drafters, slack, ratio_of(costs))
    spent = tokens = short = 0.0
    for _ in range(steps):
        preferences = [rng.choice(allocations) for _ in range(rng.randint(1, 4))]
        allocation = guard.choose(preferences, lambda a: {})
        counted = guard.expected_yield(allocation)
        lengths = [[rng.randint(0, g) if g else -1 for _ in range(rows)] for g in allocation]
        taken = [1 + max([0] + [lengths[i][b] for i, g in enumerate(allocation) if g]) for b in range(rows)]
        seconds = costs[allocation] if any(allocation) else 1.0
        short += (1 + slack) * max(0.0, rows * counted - sum(taken))
        guard.observe(allocation, seconds, sum(taken), rows, lengths, taken, {}, [0.0] * drafters)
        spent, tokens = spent + seconds, tokens + sum(taken)
        assert spent <= (1 + slack) * tokens / rows + 1 + short + 1e-9
    event(f"drafted: {guard.seconds > guard.base_seconds}")


# ---------------------------------------------------------------------------------- in the engine
LOOPING = tiny_model("llama", 0)  # its greedy output repeats itself: prompt lookup drafts well
LOOP_PROMPT = [5, 6, 7, 8, 9, 10, 11]


def hf_greedy(prompt, new):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = LOOPING.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                               pad_token_id=0)
    return out[0, len(prompt):].tolist()


class Stalling(NgramDrafter):
    """The n-gram drafter on a scripted clock: each proposal takes 0.1 ms, its first ``stalls`` 0.3 s."""

    def __init__(self, clock, stalls):
        super().__init__()
        self.clock, self.stalls = clock, stalls

    def propose(self, *args, **kwargs):
        self.clock.now += 1e-4
        if self.stalls:
            self.stalls -= 1
            self.clock.now += 0.3
        return super().propose(*args, **kwargs)


@pytest.fixture
def clock(monkeypatch):
    """The tree loop's clock, scripted so that the test does not depend on the machine's load: a
    target-only step's forward takes 1 ms, a tree forward 1.3 ms, nothing else takes any time."""
    fake = types.SimpleNamespace(now=0.0)
    fake.perf_counter = lambda: fake.now
    monkeypatch.setattr(tree_loop, "time", fake)
    score, forward = tree_loop._TreeRun._score, tree_loop.tree_forward

    def scored(self, *args, **kwargs):
        fake.now += 1e-3
        return score(self, *args, **kwargs)

    def tree_scored(*args, **kwargs):
        fake.now += 1.3e-3
        return forward(*args, **kwargs)

    monkeypatch.setattr(tree_loop._TreeRun, "_score", scored)
    monkeypatch.setattr(tree_loop, "tree_forward", tree_scored)
    return fake


def test_greedy_auto_with_the_guard_equals_generate_and_refuses_its_first_step():
    engine = flashspec.SpeculativeEngine(LOOPING, ["ngram"])
    out = engine.generate_tree([LOOP_PROMPT], max_new_tokens=60, gammas="auto", eos_token_id=[])
    assert out.sequences == [hf_greedy(LOOP_PROMPT, 60)]
    assert out.stats.step_log[0].arm is None and out.stats.guard_refused >= 1  # the probe waits for r₀
    unguarded = flashspec.SpeculativeEngine(LOOPING, ["ngram"])
    first = unguarded.generate_tree([LOOP_PROMPT], max_new_tokens=60, gammas="auto", eos_token_id=[], slack=None)
    assert first.stats.step_log[0].arm is not None and first.stats.guard_refused == 0


def test_a_drafter_that_stalled_drafts_again_and_the_cost_model_keeps_its_steady_cost(clock):
    """An n-gram drafter whose first two proposals stall for 0.3 s (hundreds of target steps): the call
    that met the stalls stops drafting, but the stalls are not taught to the budget's cost model, so
    the next calls draft again on the looping text; the output stays the target's."""
    drafter = Stalling(clock, stalls=2)
    engine = flashspec.SpeculativeEngine(LOOPING, [drafter])
    expected = hf_greedy(LOOP_PROMPT, 120)
    shares = []
    for _ in range(4):
        out = engine.generate_tree([LOOP_PROMPT], max_new_tokens=120, gammas="auto", eos_token_id=[])
        assert out.sequences == [expected]
        log = out.stats.step_log
        shares.append(sum(r.arm is not None for r in log) / len(log))
    assert drafter.stalls == 0
    assert min(shares[2:]) > 0.5, shares
    assert engine.tree_budget.seconds((engine.tree_budget.gamma_max[0],)) == pytest.approx(1.4e-3)


def test_slack_errors_are_clear():
    engine = flashspec.SpeculativeEngine(LOOPING, ["ngram"])
    with pytest.raises(ValueError, match="slack guards the choice"):
        engine.generate_tree([LOOP_PROMPT], gammas=[2], slack=0.05)
    for bad in (-0.1, float("nan"), "lots", True):
        with pytest.raises(ValueError, match="slack"):
            engine.generate_tree([LOOP_PROMPT], gammas="auto", slack=bad)
    assert isinstance(engine.generate_tree([LOOP_PROMPT], gammas=[2], max_new_tokens=3).sequences[0], list)
    engine.tree_budget = TreeBudget([2])
    out = engine.generate_tree([LOOP_PROMPT], gammas="auto", max_new_tokens=8, slack=0.0, eos_token_id=[])
    assert out.sequences == [hf_greedy(LOOP_PROMPT, 8)]


def test_sampled_auto_behind_the_guard_follows_the_target_law():
    """χ² (10,000 samples) with the guard on, as by default: its first step runs the target alone (no
    r₀ yet), the next drafts (a fixed cost model that makes drafting pay: a measured estimate that
    fits); n-gram and a noisy copy (p ≠ q), T = 0.7 with top-k and top-p: each row's law is the target's."""
    from stats_helpers import ALPHA
    from test_tree_decode import NOISY, PROMPT, SAMPLES, TARGET, THREADS, exact_law, pvalue

    temperature, top_k, top_p = 0.7, 5, 0.9
    engine = flashspec.SpeculativeEngine(TARGET, ["ngram", NOISY], device="cpu")
    engine.tree_budget = TreeBudget([2, 2], cost=lambda a: 1.0 + 0.01 * sum(a))
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        out = engine.generate_tree([PROMPT] * SAMPLES, max_new_tokens=3, gammas="auto", do_sample=True,
                                   temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=[], seed=99)
    finally:
        torch.set_num_threads(before)
    log = out.stats.step_log
    assert log[0].arm is None and out.stats.guard_refused >= 1  # the guard waited for r₀
    assert any(record.arm is not None for record in log[1:])  # then admitted a drafting step
    p = pvalue(out, exact_law(temperature, top_k, top_p))
    assert p > ALPHA, f"χ² p-value {p:.2e}: the output law differs from the target's"
