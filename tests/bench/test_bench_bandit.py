"""The bandit simulation (flashspec.bench.bandit): regret figures and outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flashspec.bench.bandit import (
    REFERENCE,
    make_scenarios,
    run,
    simulate,
    summarize,
    stationary_means,
    ucb1_bound,
)

MEANS = stationary_means(3)


def test_stationary_problem_is_the_reference_kind():
    assert MEANS == [0.9, 0.7, 0.4]
    assert ucb1_bound(MEANS, 10_000) == pytest.approx(518.8, abs=0.05)
    assert abs(ucb1_bound(MEANS, 10_000) - REFERENCE["ucb1_bound"]) / REFERENCE["ucb1_bound"] < 0.015
    assert stationary_means(1) == [0.9]
    assert stationary_means(5) == [0.9, 0.7, 0.4, 0.25, 0.1]
    assert ucb1_bound([0.5], 100) == 0.0
    scenarios = make_scenarios(10_000, 3)
    assert scenarios["reversed"]["switched_means"] == [0.4, 0.7, 0.9]
    assert scenarios["shift"]["switched_means"] == [0.1, 0.4, 0.6]
    assert scenarios["shift"]["switch_at"] == 5_000


def test_oracle_has_zero_regret_and_fixed_the_exact_gap():
    for switch in (None, 300):
        switched = MEANS[::-1] if switch else None
        assert np.all(simulate("oracle", MEANS, 600, seed=1, switch_at=switch, switched_means=switched) == 0)
    fixed = simulate("fixed", MEANS, 600, seed=1, switch_at=300, switched_means=MEANS[::-1])
    assert fixed[299] == 0 and fixed[-1] == pytest.approx(300 * 0.5)


def test_simulation_is_reproducible_and_the_curve_monotone():
    a = simulate("thompson", MEANS, 500, seed=3)
    b = simulate("thompson", MEANS, 500, seed=3)
    assert np.array_equal(a, b) and a.shape == (500,)
    assert np.all(np.diff(a) >= 0)
    assert not np.array_equal(a, simulate("thompson", MEANS, 500, seed=4))


def test_ucb1_and_thompson_beat_the_reference():
    """The reference problem size itself (T = 10,000, K = 3), 10 seeds (~1 s)."""
    steps = REFERENCE["steps"]
    ucb1 = np.mean([simulate("ucb1", MEANS, steps, seed)[-1] for seed in range(10)])
    thompson = np.mean([simulate("thompson", MEANS, steps, seed)[-1] for seed in range(10)])
    assert ucb1 < REFERENCE["ucb1"]
    assert thompson < REFERENCE["thompson"]
    assert ucb1 < ucb1_bound(MEANS, steps)


def test_windowed_selectors_recover_where_ucb1_does_not():
    shift = make_scenarios(10_000, 3)["shift"]
    after = {}
    for name in ("ucb1", "sliding-window-ucb", "discounted-ucb"):
        curves = [simulate(name, MEANS, 10_000, seed, shift["switch_at"], shift["switched_means"]) for seed in range(3)]
        after[name] = np.mean([c[-1] - c[4_999] for c in curves])
    assert after["sliding-window-ucb"] < 0.5 * after["ucb1"]
    assert after["discounted-ucb"] < 0.5 * after["ucb1"]


def test_run_writes_json_and_plot(tmp_path):
    json_path, plot_path = tmp_path / "bandit.json", tmp_path / "bandit.png"
    results = run(steps=300, arms=3, seeds=2, json_path=json_path, plot_path=plot_path, progress=False)
    saved = json.loads(json_path.read_text())
    assert saved["scenarios"].keys() == {"stationary", "reversed", "shift"}
    stationary = saved["scenarios"]["stationary"]
    assert stationary["means"] == MEANS and stationary["ucb1_bound"] == pytest.approx(ucb1_bound(MEANS, 300))
    assert "ucb1_bound_restarted" in saved["scenarios"]["shift"]
    for entry in saved["scenarios"].values():
        assert len(entry["curve_t"]) == len(entry["bound_curve"]) and entry["curve_t"][-1] == 300
        assert set(entry["selectors"]) == set(results["selector_options"])
        for sel in entry["selectors"].values():
            assert {"regret_mean", "regret_sd", "curve_mean", "curve_sd"} <= set(sel)
            assert len(sel["curve_mean"]) == len(entry["curve_t"])
            assert sel["curve_mean"][-1] == pytest.approx(sel["regret_mean"], abs=1e-3)
        assert entry["selectors"]["oracle"]["regret_mean"] == 0
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = summarize(results)
    assert "| ucb1 |" in table and "| UCB1 bound |" in table and "(restarted)" in table


def test_one_arm_has_no_regret():
    results = run(steps=50, arms=1, seeds=1, progress=False, selectors=("ucb1", "thompson", "sliding-window-ucb"))
    for entry in results["scenarios"].values():
        assert all(sel["regret_mean"] == 0 for sel in entry["selectors"].values())


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: simulate("ucb1", [0.5, 1.2], 10, 0), r"lie in \[0, 1\]"),
        (lambda: simulate("ucb1", [], 10, 0), "non-empty"),
        (lambda: simulate("ucb1", [0.5, 0.2], 0, 0), "steps must be"),
        (lambda: simulate("ucb1", [0.5, 0.2], 10, 0, switch_at=5), "go together"),
        (lambda: simulate("ucb1", [0.5, 0.2], 10, 0, 5, [0.1]), "1 arms"),
        (lambda: simulate("ucb1", [0.5, 0.2], 10, 0, 11, [0.1, 0.2]), "switch_at"),
        (lambda: simulate("nope", [0.5, 0.2], 10, 0), "Unknown selector"),
        (lambda: run(steps=1, progress=False), "steps must be"),
        (lambda: run(arms=0, progress=False), "arms must be"),
        (lambda: run(seeds=0, progress=False), "seeds must be"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()
