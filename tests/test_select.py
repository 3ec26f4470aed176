"""Selectors (flashspec.select): behaviour, posteriors, windows, state, threads, validation."""

from __future__ import annotations

import json
import math
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashspec.select import (
    SELECTORS,
    DiscountedUCBSelector,
    EpsilonGreedySelector,
    FixedSelector,
    Observation,
    OracleSelector,
    Selector,
    SlidingWindowUCBSelector,
    ThompsonSelector,
    UCB1Selector,
    make_selector,
    selector_from_state_dict,
)

HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def obs(accepted: int, proposed: int = 1, tokens: int | None = None, seconds: float = 1.0) -> Observation:
    return Observation(accepted, proposed, accepted + 1 if tokens is None else tokens, seconds)


def build(name: str, num_arms: int = 3, **options):
    if name == "oracle":
        options.setdefault("means", [0.1 * (i + 1) for i in range(num_arms)])
    return make_selector(name, num_arms, **options)


def drive(selector, steps: int, seed: int, means=None) -> list[int]:
    """Select/update ``steps`` times with Bernoulli rewards of ``means``; the choices."""
    rng = random.Random(seed)
    means = means or [0.3 + 0.5 * i / max(selector.num_arms - 1, 1) for i in range(selector.num_arms)]
    arms = []
    for _ in range(steps):
        arm = selector.select()
        proposed = rng.randint(1, 4)
        accepted = sum(rng.random() < means[arm] for _ in range(proposed))
        selector.update(arm, Observation(accepted, proposed, accepted + 1, rng.uniform(0.01, 0.05)))
        arms.append(arm)
    return arms


# -- the interface -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_every_selector_has_the_interface(name):
    sel = build(name)
    assert isinstance(sel, Selector)
    assert sel.kind == name and type(sel).kind == name
    arm = sel.select()
    assert 0 <= arm < 3
    sel.update(arm, obs(1, 2))
    assert sel.pulls[arm] == 1 and sel.total_updates == 1
    json.dumps(sel.state_dict())


def test_fixed_needs_no_arm_count():
    fixed = make_selector("fixed")  # the release-1 call
    assert isinstance(fixed, FixedSelector) and fixed.select() == 0


def test_update_takes_an_observation_only():
    with pytest.raises(ValueError, match="Observation"):
        make_selector("ucb1", 2, reward="acceptance").update(1, 3)


# -- UCB1 ----------------------------------------------------------------------------------


def test_ucb1_plays_each_arm_once_first_then_the_index():
    sel = UCB1Selector(4, reward="acceptance", seed=0)
    first = []
    for _ in range(4):
        arm = sel.select()
        first.append(arm)
        sel.update(arm, obs(1 if arm == 2 else 0))
    assert sorted(first) == [0, 1, 2, 3]
    assert sel.select() == 2  # the only arm with a reward
    sel.update(2, obs(1))


def test_ucb1_index_matches_the_formula():
    sel = UCB1Selector(3, reward="acceptance", seed=0)
    data = {0: [1, 1, 0, 1, 1, 1, 0, 1], 1: [1, 0], 2: [0, 0, 0, 1]}
    for arm, rewards in data.items():
        for r in rewards:
            sel.update(arm, obs(r))
    t = sum(len(v) for v in data.values())
    index = {a: sum(v) / len(v) + math.sqrt(2 * math.log(t) / len(v)) for a, v in data.items()}
    assert sel.select() == max(index, key=index.get)
    assert sel.counts == [8, 2, 4] and sel.sums == [6.0, 1.0, 1.0]


def test_ucb1_exploits_but_keeps_exploring():
    sel = UCB1Selector(2, reward="acceptance", seed=1)
    choices = drive(sel, 3000, seed=2, means=[0.8, 0.4])
    assert choices.count(0) > 0.85 * len(choices)  # mostly the best arm
    assert 10 < choices.count(1) < 400  # but the other arm keeps being tried
    assert 1 in choices[-1500:]


def test_round_robin_when_updates_lag():
    """With updates that arrive late (the engine's sync_every), unobserved arms are still
    tried in turn instead of the same one repeatedly."""
    for name in ("ucb1", "discounted-ucb", "sliding-window-ucb", "epsilon-greedy"):
        sel = build(name, 3, seed=0)
        assert [sel.select() for _ in range(5)] == [0, 1, 2, 0, 1]


def test_throughput_is_normalised_by_the_running_maximum():
    sel = UCB1Selector(2, seed=0)
    sel.update(0, Observation(2, 4, tokens=30, seconds=1.0))  # 30 tok/s
    sel.update(1, Observation(2, 4, tokens=15, seconds=0.5))  # 30 tok/s
    sel.update(1, Observation(0, 4, tokens=12, seconds=0.2))  # 60 tok/s
    assert sel.normaliser == 60.0
    assert sel.sums == [30.0, 90.0]
    floor = UCB1Selector(2, scale=100.0)
    floor.update(0, Observation(1, 1, 2, 0.1))
    assert floor.normaliser == 100.0
    floor.update(0, Observation(1, 1, 2, 0.01))
    assert floor.normaliser == 200.0
    assert UCB1Selector(2).normaliser == 1.0  # nothing seen yet
    assert UCB1Selector(2, reward="acceptance").normaliser == 1.0


# -- Thompson ------------------------------------------------------------------------------


def test_beta_posterior_is_the_conjugate_update():
    sel = ThompsonSelector(2, reward="acceptance", seed=0)
    assert sel.model == "beta"
    assert sel.posterior(0) == (1.0, 1.0)
    for a, p in [(3, 4), (0, 4), (4, 4), (2, 3)]:
        sel.update(0, obs(a, p))
    assert sel.posterior(0) == (1 + 9, 1 + 6)
    assert sel.posterior(1) == (1.0, 1.0)
    custom = ThompsonSelector(1, reward="acceptance", prior_alpha=0.5, prior_beta=2.0)
    custom.update(0, obs(5, 5))  # all accepted: β stays at its prior, never 0
    assert custom.posterior(0) == (5.5, 2.0)


@HYPOTHESIS
@given(
    num_arms=st.integers(1, 5),
    steps=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 8), st.integers(0, 8)), max_size=40),
)
def test_beta_posterior_always_valid(num_arms, steps):
    sel = ThompsonSelector(num_arms, reward="acceptance", seed=0)
    expected = [[1.0, 1.0] for _ in range(num_arms)]
    for arm, x, y in steps:
        arm %= num_arms
        accepted, proposed = min(x, y), max(x, y, 1)
        sel.update(arm, obs(accepted, proposed))
        expected[arm][0] += accepted
        expected[arm][1] += proposed - accepted
        assert 0 <= sel.select() < num_arms
    for arm in range(num_arms):
        alpha, beta = sel.posterior(arm)
        assert alpha > 0 and beta > 0
        assert [alpha, beta] == expected[arm]


def test_gaussian_posterior_matches_the_normal_gamma_formulas():
    xs = [40.0, 55.0, 47.0, 61.0]  # tokens per second
    sel = ThompsonSelector(2, scale=100.0, seed=0)  # normaliser fixed at 100
    assert sel.model == "gaussian"
    for x in xs:
        sel.update(1, Observation(1, 2, tokens=int(x), seconds=1.0))
    mu0, k0, a0, b0 = 0.5, 1.0, 1.0, 0.25
    ys = [x / 100 for x in xs]
    n = len(ys)
    ybar = sum(ys) / n
    s = sum((y - ybar) ** 2 for y in ys)
    kappa = k0 + n
    expected = (
        (k0 * mu0 + n * ybar) / kappa,
        kappa,
        a0 + n / 2,
        b0 + s / 2 + k0 * n * (ybar - mu0) ** 2 / (2 * kappa),
    )
    assert sel.posterior(1) == pytest.approx(expected, rel=1e-12)
    assert sel.posterior(0) == pytest.approx((mu0, k0, a0, b0))


def test_gaussian_thompson_finds_the_fastest_arm():
    sel = ThompsonSelector(3, seed=3)
    rng = random.Random(4)
    speeds = [50.0, 80.0, 65.0]
    choices = []
    for _ in range(600):
        arm = sel.select()
        seconds = rng.uniform(0.9, 1.1) * 4 / speeds[arm]
        sel.update(arm, Observation(3, 4, tokens=4, seconds=seconds))
        choices.append(arm)
        mu, kappa, alpha, beta = sel.posterior(arm)
        assert kappa > 0 and alpha > 0 and beta > 0
    assert choices[-200:].count(1) > 180


def test_beta_thompson_finds_the_best_arm():
    sel = ThompsonSelector(3, reward="acceptance", seed=5)
    choices = drive(sel, 1500, seed=6, means=[0.5, 0.8, 0.3])
    assert choices[-500:].count(1) > 470


# -- sliding window and discount -----------------------------------------------------------


def test_sliding_window_forgets_exactly_after_w_observations():
    w = 5
    sel = SlidingWindowUCBSelector(2, window=w, reward="acceptance", seed=0)
    sel.update(0, obs(1))  # will leave the window after 5 more updates
    for _ in range(4):
        sel.update(1, obs(0))
    assert sel.counts == [1, 4] and sel.sums == [1.0, 0.0]
    sel.update(1, obs(1))  # the sixth: arm 0's only observation leaves
    assert sel.counts == [0, 5] and sel.sums == [0.0, 1.0]
    assert sel.select() == 0  # no observation of arm 0 in the window: played first
    assert len(sel.history) == w


@HYPOTHESIS
@given(
    num_arms=st.integers(1, 4),
    window=st.integers(1, 12),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 5)), max_size=60),
)
def test_sliding_window_statistics_are_those_of_the_last_w(num_arms, window, steps):
    sel = SlidingWindowUCBSelector(num_arms, window=window, reward="acceptance", seed=0)
    log = []
    for arm, a, p in steps:
        arm %= num_arms
        a = min(a, p)
        sel.update(arm, obs(a, p))
        log.append((arm, a / p))
        recent = log[-window:]
        assert sel.counts == [sum(1 for x, _ in recent if x == i) for i in range(num_arms)]
        for i in range(num_arms):
            assert sel.sums[i] == pytest.approx(math.fsum(r for x, r in recent if x == i), abs=1e-12)
        assert 0 <= sel.select() < num_arms


def test_sliding_window_ignores_what_came_before_the_window():
    """Two selectors that saw different pasts but the same last W observations make the same
    choices (given the same RNG state)."""
    w = 20
    a = SlidingWindowUCBSelector(3, window=w, reward="acceptance", seed=7)
    b = SlidingWindowUCBSelector(3, window=w, reward="acceptance", seed=7)
    for i in range(50):
        a.update(i % 3, obs(1))
        b.update(0, obs(0))
    tail = [(i % 3, (i * 7) % 2) for i in range(w)]
    for arm, r in tail:
        a.update(arm, obs(r))
        b.update(arm, obs(r))
    assert a.counts == b.counts and a.sums == b.sums
    assert [a.select() for _ in range(10)] == [b.select() for _ in range(10)]


def test_discounted_weights():
    g = 0.5
    sel = DiscountedUCBSelector(2, discount=g, reward="acceptance")
    sel.update(0, obs(1))
    sel.update(1, obs(0))
    sel.update(0, obs(0))
    # arm 0: rewards 1 (two updates ago) and 0 (now); arm 1: 0 one update ago.
    assert sel.weights == pytest.approx([g**2 + 1, g])
    assert sel.sums == pytest.approx([g**2, 0.0])
    assert sel.weights[0] + sel.weights[1] <= 1 / (1 - g)


def test_discount_one_is_ucb1():
    a = DiscountedUCBSelector(3, discount=1.0, exploration=2.0, reward="acceptance", seed=9)
    b = UCB1Selector(3, reward="acceptance", seed=9)
    assert drive(a, 300, seed=1) == drive(b, 300, seed=1)


def test_discounted_ucb_recovers_after_a_change():
    sel = DiscountedUCBSelector(2, discount=0.99, reward="acceptance", seed=0)
    drive(sel, 1000, seed=1, means=[0.9, 0.2])
    late = drive(sel, 1000, seed=2, means=[0.2, 0.9])
    assert late[-300:].count(1) > 250


# -- ε-greedy, fixed, oracle ---------------------------------------------------------------


def test_epsilon_zero_is_greedy():
    sel = EpsilonGreedySelector(3, epsilon=0.0, reward="acceptance", seed=0)
    for arm, r in [(0, 0), (1, 1), (2, 0)]:
        sel.update(arm, obs(r))
    assert [sel.select() for _ in range(50)] == [1] * 50
    sel.update(1, obs(0))
    sel.update(1, obs(0))  # arm 1's mean falls to 1/3, still the best
    assert sel.select() == 1


def test_epsilon_explores_at_rate_epsilon():
    sel = EpsilonGreedySelector(4, epsilon=0.4, reward="acceptance", seed=1)
    for arm in range(4):
        sel.update(arm, obs(int(arm == 3)))
    picks = [sel.select() for _ in range(4000)]
    # greedy 0.6 + uniform 0.4 / 4 = 0.7 on arm 3
    assert abs(picks.count(3) / 4000 - 0.7) < 0.03
    assert all(picks.count(a) > 300 for a in range(3))


def test_epsilon_ties_are_broken_by_the_rng():
    sel = EpsilonGreedySelector(3, epsilon=0.0, reward="acceptance", seed=2)
    for arm in range(3):
        sel.update(arm, obs(1))
    assert set(sel.select() for _ in range(60)) == {0, 1, 2}


def test_fixed_and_oracle():
    fixed = FixedSelector(4, arm=2)
    for i in range(10):
        assert fixed.select() == 2
        fixed.update(i % 4, obs(0))
    oracle = OracleSelector(3, means=[0.2, 0.7, 0.5])
    assert [oracle.select() for _ in range(5)] == [1] * 5
    oracle.set_means([0.9, 0.7, 0.9])
    assert oracle.select() == 0  # lowest index among the best


# -- state ---------------------------------------------------------------------------------

STATEFUL = [
    ("ucb1", {}),
    ("ucb1", {"reward": "acceptance"}),
    ("thompson", {}),
    ("thompson", {"reward": "acceptance"}),
    ("thompson", {"reward": "acceptance", "model": "gaussian"}),
    ("discounted-ucb", {}),
    ("sliding-window-ucb", {"window": 7}),
    ("epsilon-greedy", {"epsilon": 0.3}),
    ("fixed", {"arm": 1}),
    ("oracle", {}),
]


@pytest.mark.parametrize("name,options", STATEFUL)
def test_state_dict_round_trip_gives_the_same_future(name, options):
    original = build(name, 3, seed=11, **options)
    drive(original, 137, seed=12)
    state = json.loads(json.dumps(original.state_dict()))
    restored = selector_from_state_dict(state)
    reloaded = build(name, 3, seed=999, **options)  # another seed: the RNG state is restored
    reloaded.load_state_dict(state)
    assert restored.state_dict() == original.state_dict() == reloaded.state_dict()
    futures = [drive(s, 200, seed=13) for s in (original, restored, reloaded)]
    assert futures[0] == futures[1] == futures[2]


def test_bad_state_is_refused():
    sel = UCB1Selector(3, seed=0)
    state = sel.state_dict()
    with pytest.raises(ValueError, match="selector 'ucb1'"):
        ThompsonSelector(3).load_state_dict(state)
    with pytest.raises(ValueError, match="arms"):
        UCB1Selector(4).load_state_dict(state)
    with pytest.raises(ValueError, match="configuration"):
        UCB1Selector(3, exploration=1.0).load_state_dict(state)
    with pytest.raises(ValueError, match="format"):
        sel.load_state_dict({**state, "format": 99})
    with pytest.raises(ValueError, match="malformed"):
        sel.load_state_dict({**state, "stats": {"counts": [1, 2], "sums": [0.0, 0.0]}})
    window = SlidingWindowUCBSelector(2, window=3, reward="acceptance")
    window.update(0, obs(1))
    bad = window.state_dict()
    bad["stats"]["sums"] = [5.0, 0.0]
    with pytest.raises(ValueError, match="window sums"):
        window.load_state_dict(bad)
    with pytest.raises(ValueError, match="state"):
        selector_from_state_dict({"kind": "nope"})


# -- threads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_concurrent_select_and_update(name):
    sel = build(name, 4, seed=0, **({"window": 50} if name == "sliding-window-ucb" else {}))
    threads, per_thread = 8, 250
    errors = []
    barrier = threading.Barrier(threads)

    def work(k: int) -> None:
        try:
            barrier.wait()
            rng = random.Random(k)
            for _ in range(per_thread):
                arm = sel.select()
                a = rng.randint(0, 3)
                sel.update(arm, Observation(a, 3, a + 1, 0.01))
        except Exception as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    total = threads * per_thread
    assert not errors
    assert sel.total_updates == total and sum(sel.selections) == total
    if hasattr(sel, "counts") and name != "sliding-window-ucb":
        assert sum(sel.counts) == total
    if name == "sliding-window-ucb":
        assert sum(sel.counts) == 50 == len(sel.history)
    if name == "thompson":
        assert sum(sel.counts) == total
    if name == "discounted-ucb":
        assert sum(sel.weights) <= 1 / (1 - sel.discount) + 1e-9


# -- any number of arms --------------------------------------------------------------------


@HYPOTHESIS
@given(
    name=st.sampled_from(sorted(SELECTORS)),
    num_arms=st.integers(1, 6),
    seed=st.integers(0, 2**32),
    steps=st.integers(0, 40),
)
def test_any_number_of_arms(name, num_arms, seed, steps):
    sel = build(name, num_arms, seed=seed)
    choices = drive(sel, steps, seed=seed)
    assert all(0 <= a < num_arms for a in choices)
    if num_arms == 1:
        assert set(choices) <= {0}
    if name in ("ucb1", "discounted-ucb", "sliding-window-ucb", "epsilon-greedy") and steps >= num_arms:
        assert sorted(choices[:num_arms]) == list(range(num_arms))  # each arm once first


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"accepted": -1, "proposed": 2, "tokens": 1, "seconds": 1.0}, "accepted must be >= 0"),
        ({"accepted": 1, "proposed": -2, "tokens": 1, "seconds": 1.0}, "proposed must be >= 0"),
        ({"accepted": 3, "proposed": 2, "tokens": 1, "seconds": 1.0}, "cannot exceed"),
        ({"accepted": 1, "proposed": 2, "tokens": -1, "seconds": 1.0}, "tokens must be >= 0"),
        ({"accepted": 1, "proposed": 2, "tokens": 1, "seconds": 0.0}, "seconds must be > 0"),
        ({"accepted": 1, "proposed": 2, "tokens": 1, "seconds": -1.0}, "seconds must be > 0"),
        ({"accepted": 1, "proposed": 2, "tokens": 1, "seconds": math.nan}, "seconds must be finite"),
        ({"accepted": 1.5, "proposed": 2, "tokens": 1, "seconds": 1.0}, "accepted must be an integer"),
        ({"accepted": True, "proposed": 2, "tokens": 1, "seconds": 1.0}, "accepted must be an integer"),
        ({"accepted": 1, "proposed": 2, "tokens": 1, "seconds": "fast"}, "seconds must be a number"),
    ],
)
def test_bad_observations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Observation(**kwargs)


@pytest.mark.parametrize(
    "name,num_arms,options,message",
    [
        ("ucb1", 0, {}, "num_arms must be >= 1"),
        ("ucb1", -3, {}, "num_arms must be >= 1"),
        ("ucb1", 2.5, {}, "num_arms must be an integer"),
        ("ucb1", True, {}, "num_arms must be an integer"),
        ("ucb1", None, {}, "needs num_arms"),
        ("ucb1", 2, {"reward": "speed"}, "reward must be one of"),
        ("ucb1", 2, {"scale": 0}, "scale must be > 0"),
        ("ucb1", 2, {"seed": "x"}, "seed must be an integer"),
        ("ucb1", 2, {"exploration": 0}, "exploration must be > 0"),
        ("ucb1", 2, {"window": 5}, "Bad option"),
        ("sliding-window-ucb", 2, {"window": 0}, "window must be >= 1"),
        ("sliding-window-ucb", 2, {"window": 2.5}, "window must be an integer"),
        ("discounted-ucb", 2, {"discount": 0}, r"discount must be in \(0, 1\]"),
        ("discounted-ucb", 2, {"discount": 1.01}, r"discount must be in \(0, 1\]"),
        ("discounted-ucb", 2, {"discount": -0.5}, r"discount must be in \(0, 1\]"),
        ("epsilon-greedy", 2, {"epsilon": -0.1}, r"epsilon must be in \[0, 1\]"),
        ("epsilon-greedy", 2, {"epsilon": 1.5}, r"epsilon must be in \[0, 1\]"),
        ("thompson", 2, {"model": "poisson"}, "model must be one of"),
        ("thompson", 2, {"model": "beta"}, "needs reward='acceptance'"),
        ("thompson", 2, {"reward": "acceptance", "prior_alpha": 0}, "prior_alpha must be > 0"),
        ("thompson", 2, {"reward": "acceptance", "prior_beta": -1}, "prior_beta must be > 0"),
        ("thompson", 2, {"prior_kappa": 0}, "prior_kappa must be > 0"),
        ("thompson", 2, {"reward": "acceptance", "prior_mean": 0.5}, "belong to model='gaussian'"),
        ("fixed", 2, {"arm": 2}, "out of range"),
        ("fixed", None, {"arm": -1}, "arm must be"),
        ("oracle", 2, {}, "needs the true means"),
        ("oracle", 2, {"means": [0.1]}, "1 entries for 2 arm"),
        ("oracle", 2, {"means": [0.1, math.inf]}, "finite"),
        ("bandit", 2, {}, "Unknown selector 'bandit'"),
    ],
)
def test_bad_selector_options(name, num_arms, options, message):
    with pytest.raises(ValueError, match=message):
        make_selector(name, num_arms, **options)


def test_bad_updates_and_objects():
    sel = UCB1Selector(3)
    for arm in (-1, 3, 1.0, "0", True):
        with pytest.raises(ValueError, match="arm"):
            sel.update(arm, obs(1))
    with pytest.raises(ValueError, match="needs an Observation"):
        sel.update(0, {"accepted": 1})
    acc = UCB1Selector(3, reward="acceptance")
    with pytest.raises(ValueError, match="proposed >= 1"):
        acc.update(0, Observation(0, 0, 1, 1.0))
    with pytest.raises(ValueError, match="cannot exceed"):
        acc.update(0, Observation(5, 4, 5, 1.0))
    assert acc.total_updates == 0 and acc.counts == [0, 0, 0]  # nothing recorded on error
    with pytest.raises(ValueError, match="selector"):
        make_selector(object())
    with pytest.raises(ValueError, match="options"):
        make_selector(UCB1Selector(2), 2, seed=1)
    with pytest.raises(ValueError, match="2 arm"):
        make_selector(UCB1Selector(2), 3)
    mine = UCB1Selector(2)
    assert make_selector(mine, 2) is mine
    with pytest.raises(ValueError, match="3 entries"):
        OracleSelector(2, means=[0.1, 0.2]).set_means([0.1, 0.2, 0.3])


# -- the request selector ---------------------------------------------------------------------


def test_request_selector_values_match_the_formula():
    """SPEC.md §8, request: m_i = (w D_i / N_i + T_i) / (w + n_i) over the mean seconds, times
    1 + b sqrt(ln(n + 2) / (w + n_i)); an arm never observed is worth the most."""
    from flashspec.select import RequestSelector

    sel = RequestSelector(3, prior_steps=2.0, bonus=0.5, seed=0)
    for tokens, seconds in ((5, 2.0), (1, 2.0)):  # an earlier request: arm 0, 2 steps, 6 tokens, 2 s each
        sel.update(0, Observation(tokens - 1, 4, tokens, seconds))
    sel.begin_request()
    sel.update(0, Observation(0, 4, 1, 1.0))  # this request: arm 0 once, 1 token in 1 s
    sel.update(1, Observation(0, 0, 1, 0.5))  # arm 1 once (never in the context)
    w, b, n = 2.0, 0.5, 2
    v0 = (w * 6 / 2 + 1) / (w + 1) / (5.0 / 3) * (1 + b * math.sqrt(math.log(n + 2) / (w + 1)))
    v1 = 1 / 1 / 0.5 * (1 + b * math.sqrt(math.log(n + 2) / (w + 1)))
    values = sel.values()
    assert values[0] == pytest.approx(v0) and values[1] == pytest.approx(v1) and values[2] == math.inf
    assert sel.rank() == [2, 1, 0] and sel.select() == 2


def test_request_selector_follows_its_own_request_over_the_context():
    """A context where arm 0 paid (4 tokens a step) teaches a prior only: in a request where arm
    0 yields one token a step it gives way to arm 1 (2 tokens at the same cost) within a few
    steps, where a selector learning per context (Thompson, UCB1) would keep its long history."""
    from flashspec.select import RequestSelector

    sel = RequestSelector(2, seed=0)
    for _ in range(200):  # earlier requests: arm 0 pays, arm 1 middling
        sel.update(0, Observation(3, 4, 4, 1.0))
        sel.update(1, Observation(1, 4, 2, 1.0))
    sel.begin_request()
    choices = []
    for _ in range(30):
        arm = sel.select()
        choices.append(arm)
        sel.update(arm, Observation(0 if arm == 0 else 1, 4, 1 if arm == 0 else 2, 1.0))
    assert choices[0] == 0  # the prior says arm 0 first
    switched = choices.index(1)
    assert switched <= 8 and choices[switched:].count(1) >= len(choices[switched:]) - 2


def test_request_selector_folds_a_request_in_when_the_next_begins():
    """begin_request moves the request's counts into the context's and starts the next request
    from zero; Selection.for_request calls it for every request (and the state round-trips)."""
    from flashspec.select import RequestSelector, Selection

    sel = RequestSelector(2, seed=1)
    sel.update(1, Observation(2, 4, 3, 0.5))
    assert sel.steps == [0, 1] and sel.context_steps == [0, 0]
    sel.begin_request()
    assert sel.steps == [0, 0] and sel.context_steps == [0, 1] and sel.context_tokens == [0, 3]
    assert [c + n for c, n in zip(sel.context_steps, sel.steps)] == [0, 1] and sel.seconds == [0.0, 0.5]
    again = selector_from_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert again.rank() == sel.rank() and again.context_tokens == [0, 3]
    selection = Selection("request", 2, seed=0)
    first = selection.for_request("code")
    first.update(0, Observation(0, 4, 1, 1.0))
    assert selection.for_request("code") is first and first.context_steps == [1, 0] and first.steps == [0, 0]


@pytest.mark.parametrize("options,message", [
    ({"prior_steps": 0}, "prior_steps must be > 0"),
    ({"bonus": -0.1}, "bonus must be >= 0"),
    ({"reward": "acceptance"}, "needs reward='throughput'"),
])
def test_bad_request_selector_options(options, message):
    with pytest.raises(ValueError, match=message):
        make_selector("request", 3, **options)
