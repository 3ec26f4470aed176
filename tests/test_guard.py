"""The target-only arm and the never-slower guard (SPEC.md §8, "The target-only arm and the
never-slower guard")."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashspec import Draft, SpeculativeEngine
from flashspec.select.guard import DEFAULT_SLACK, GRACE_STEPS, Guard, check_slack
from tiny_models import noisy_copy, tiny_model

pytestmark = pytest.mark.default_configuration


# ----------------------------------------------------------------------------- the guard alone
def excess(guard: Guard) -> float:
    """How much slower than the target alone the observed steps were: S · r₀ / N − 1."""
    return guard.seconds * (guard.base_tokens / guard.base_seconds) / guard.tokens - 1


def test_nothing_drafts_before_a_target_only_step_was_observed():
    guard = Guard([4, 2, 0], baseline=2)
    assert [guard.admit(0), guard.admit(1), guard.admit(2)] == [2, 2, 2]
    assert guard.refused == 2 and len(guard.pending) == 3


def test_the_budget_matches_the_formula():
    """S + Σ pending ĉ + ĉ_a <= (1 + δ)(N + (|P| + 1) n̂) / r₀ + g s₀, by hand."""
    guard = Guard([4, 0], baseline=1, slack=0.1, grace=1)
    for _ in range(10):  # ten target-only steps of 1 s, 2 rows: r₀ = 2 tokens/s, s₀ = 1 s, n̂ = 2
        guard.observe(guard.admit(1), tokens=2, seconds=1.0, rows=2)
    # drafting arm unmeasured: ĉ = (1 + 4/2) s₀ = 3 s; S = 10, N = 20:
    # 10 + 3 <= 1.1 * (20 + 2) / 2 + 1 = 13.1: admitted
    assert guard.cost(0) == pytest.approx(3.0)
    assert guard.admit(0) == 0
    # now pending: one step of 3 s. Another: 10 + 3 + 3 = 16 <= 1.1 * (20 + 4) / 2 + 1 = 14.2? no
    assert guard.admit(0) == 1
    assert guard.refused == 1
    guard.observe(0, tokens=2, seconds=5.0, rows=2)  # the drafting step: 5 s, 1 token per row
    assert guard.cost(0) == pytest.approx(5.0)
    guard.observe(1, tokens=2, seconds=1.0, rows=2)
    # S = 16, N = 24, no pending: 16 + 5 = 21 <= 1.1 * 26 / 2 + 1 = 15.3? no
    assert guard.admit(0) == 1
    assert excess(guard) == pytest.approx(16 * (22 / 11) / 24 - 1)


@pytest.mark.parametrize("prior", [None, 1.5])
def test_drafting_that_pays_is_refused_only_while_the_first_slack_builds(prior):
    """Drafting steps of 1.5 s for 3 tokens (2x the target alone's 1 s per token). With the
    cautious prior (1 + γ/2 = 2.5 target steps) the first drafting step waits until the slack
    covers it: (2.5 - 1 - g) / δ more target steps; with the cost known from an earlier request
    (prior 1.5) it waits for none."""
    guard = Guard([3, 0], baseline=1, priors=None if prior is None else {0: prior})
    for _ in range(500):
        arm = guard.admit(0)
        guard.observe(arm, tokens=3 if arm == 0 else 1, seconds=1.5 if arm == 0 else 1.0, rows=1)
    waited = 1 + (0 if prior is not None else int((2.5 - 1 - GRACE_STEPS) / DEFAULT_SLACK) + 1)
    assert guard.refused <= waited  # the first step always runs target-only
    assert excess(guard) < -0.4
    assert guard.ratios() == {0: pytest.approx(1.5)}


@settings(max_examples=200, deadline=None)
@given(
    gammas=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    costs=st.lists(st.floats(1.0, 12.0), min_size=4, max_size=4),
    rows=st.integers(1, 8),
    lag=st.integers(0, 9),
    slack=st.sampled_from([0.0, 0.01, DEFAULT_SLACK, 0.2]),
    steps=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_a_request_is_never_slower_than_the_budget(gammas, costs, rows, lag, slack, steps, seed):
    """Arms of fixed step costs (in target steps), an adversarial random selector, tokens at
    random (at least one per row, at most γ + 1), observations lagged by ``lag`` steps: after
    every step the time spent stays within (1 + δ) of the target alone's time for the same
    tokens plus one target step, plus what each arm's first step cost beyond its prior."""
    import random

    rng = random.Random(seed)
    arm_gammas = gammas + [0]
    base = len(gammas)
    cost = [c for c, _ in zip(costs, gammas)] + [1.0]  # seconds per step; the target alone: 1 s
    guard = Guard(arm_gammas, base, slack)
    in_flight: list[tuple[int, int, float]] = []
    overshoot = sum(max(0.0, c - (1 + g / 2)) for c, g in zip(cost, gammas))  # first steps vs their prior
    spent = tokens = 0.0
    for _ in range(steps):
        arm = guard.admit(rng.randrange(len(arm_gammas)))
        made = rows if arm == base else rng.randint(rows, rows * (arm_gammas[arm] + 1))
        in_flight.append((arm, made, cost[arm]))
        spent, tokens = spent + cost[arm], tokens + made
        if len(in_flight) > lag:
            guard.observe(*in_flight.pop(0), rows=rows)
        # the target alone makes `rows` tokens per 1-second step
        assert spent <= (1 + slack) * tokens / rows + 1 + overshoot + 1e-9


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.03", [0.03]])
def test_bad_slack_is_refused(bad):
    with pytest.raises(ValueError, match="slack"):
        check_slack(bad)


def test_a_guard_needs_a_target_only_baseline():
    with pytest.raises(ValueError, match="target-only"):
        Guard([2, 4], baseline=0)


# ----------------------------------------------------------------------------- in the engine
TARGET = tiny_model("llama")
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


def test_auto_adds_the_target_only_arm_and_a_guard():
    engine = SpeculativeEngine(TARGET, [noisy_copy(TARGET, 0.05, 1), "ngram"], gammas=[2, 4])
    labels = [engine.arm_label(a) for a in range(len(engine.arms))]
    assert labels[-1] == "target@0" and len(labels) == 5
    assert engine.target_only_arm == 4 and engine.slack == DEFAULT_SLACK
    fixed = SpeculativeEngine(TARGET, ["ngram"], selector="fixed")
    assert fixed.target_only_arm is None and fixed.slack is None
    chosen = SpeculativeEngine(TARGET, ["ngram"], selector="ucb1", target_only=True)
    assert chosen.target_only_arm == 1 and chosen.slack == DEFAULT_SLACK
    unguarded = SpeculativeEngine(TARGET, ["ngram"], target_only=True, slack=None)
    assert unguarded.target_only_arm == 1 and unguarded.new_guard([4, 0]) is None
    alone = SpeculativeEngine(TARGET, [])  # nothing to draft with: no arms at all
    assert alone.arms == [] and alone.slack is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_output_with_the_default_configuration_equals_generate(arch):
    model = tiny_model(arch)
    engine = SpeculativeEngine(model, [noisy_copy(model, 0.05, 2), "ngram"], gammas=[1, 3])
    ids = torch.tensor([PROMPTS[0]])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              pad_token_id=0, eos_token_id=None)[0, ids.shape[1]:].tolist()
    for _ in range(2):  # the second request starts from what the first one learned
        out = engine.generate(PROMPTS[:1], max_new_tokens=24, eos_token_id=[])
        assert out.sequences[0] == expected
        assert out.stats.per_arm["target@0"].steps >= 1  # the guard's first step, at least


def test_bad_target_only_options_are_refused():
    with pytest.raises(ValueError, match="target_only"):
        SpeculativeEngine(TARGET, ["ngram"], target_only="yes")
    with pytest.raises(ValueError, match="target_only=True"):
        SpeculativeEngine(TARGET, ["ngram"], selector="fixed", slack=0.05)
    with pytest.raises(ValueError, match="reward='throughput'"):
        SpeculativeEngine(TARGET, ["ngram"], selector_options={"reward": "acceptance"})
    with pytest.raises(ValueError, match="slack"):
        SpeculativeEngine(TARGET, ["ngram"], slack=-1)


class SlowDrafter:
    """Proposes token 0 after sleeping: every step it drafts costs far more than it gains."""

    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def begin(self, batch_size: int) -> None:
        pass

    def propose(self, history, num_tokens, params, uniforms) -> Draft:
        time.sleep(self.seconds)
        return Draft(torch.zeros(history.tokens.shape[0], num_tokens, dtype=torch.long), None)


def test_the_guard_keeps_a_request_with_a_losing_drafter_near_the_target_alone():
    """A drafter that sleeps 20 ms per proposal: the guard lets it run only as often as the
    budget allows, and the request's measured step time stays within the budget's bound."""
    slack = 0.05
    engine = SpeculativeEngine(TARGET, [SlowDrafter(0.02)], selector="fixed", target_only=True, slack=slack)
    out = engine.generate(PROMPTS, max_new_tokens=120, eos_token_id=[])
    log = out.stats.step_log
    base = [r for r in log if r.arm == "target@0"]
    drafted = [r for r in log if r.arm != "target@0"]
    assert drafted and base and out.stats.guard_refused > 0
    rate = sum(r.committed for r in base) / sum(r.seconds for r in base)
    step = sum(r.seconds for r in base) / len(base)
    spent, tokens = sum(r.seconds for r in log), sum(r.committed for r in log)
    first = drafted[0].seconds  # the one step whose cost the guard could not know
    assert spent <= (1 + slack) * tokens / rate + step + first
    assert len(drafted) < len(base) / 5


def test_a_reset_starts_a_new_budget_and_keeps_the_priors():
    guard = Guard([2, 0], baseline=1, priors={0: 1.2})
    for _ in range(5):
        guard.observe(guard.admit(1), tokens=1, seconds=1.0, rows=1)
    guard.reset()
    assert guard.seconds == guard.tokens == guard.base_steps == 0 and guard.priors == {0: 1.2}
    assert guard.admit(0) == 1  # r₀ unknown again: the target alone first


def test_a_batch_runs_the_default_configuration_and_equals_generate():
    """The never-slower guard in a running batch (SPEC.md §8, §12): rows join and leave, the
    guard is reset when the batch empties, every greedy row equals its offline output."""
    engine = SpeculativeEngine(TARGET, [noisy_copy(TARGET, 0.05, 1), "ngram"], gammas=[2])
    expected = [SpeculativeEngine(TARGET, []).generate([p], max_new_tokens=16, eos_token_id=[]).sequences[0]
                for p in PROMPTS]
    with engine.batch(slots=2, max_length=64, eos_token_id=[]) as batch:
        for _ in range(2):  # twice: the second time after the batch emptied
            got = {batch.add(p, max_new_tokens=16): [] for p in PROMPTS}
            order = list(got)
            while batch.running:
                for update in batch.step():
                    got[update.handle].extend(update.tokens)
            assert [got[h] for h in order] == expected
    assert batch.stats.per_arm["target@0"].steps >= 1
