"""Bandit simulation: the regret of every selector on Bernoulli arms (``flashspec bench bandit``).

Each arm ``i`` pays a Bernoulli(``μ_i``) reward: the selector sees one drafted token that is
accepted with probability ``μ_i``, i.e. ``Observation(accepted=r, proposed=1, tokens=r + 1,
seconds=1)`` with ``r ∈ {0, 1}``, and every selector is built with ``reward="acceptance"``, so
its reward is exactly ``r`` (Thompson: the Beta-Bernoulli model). The regret is the
*pseudo*-regret ``Σ_t (max_i μ_i(t) − μ_{arm_t}(t))``, which depends on the rewards only
through the choices. Seed ``s`` fixes both the arms' rewards (a stream of uniforms shared by
all selectors: common random numbers) and the selector's own RNG.

Scenarios (``run``), ``T`` steps, ``K`` arms:

* ``stationary``: means :func:`stationary_means` — for K = 3, ``(0.9, 0.7, 0.4)``: gaps
  ``Δ = (0.2, 0.5)``, UCB1 bound (Auer et al. 2002) ``8 Σ ln T / Δ_i + (1 + π²/3) Σ Δ_i =
  518.8`` at T = 10,000: the same kind of problem as the reference figures "T = 10,000,
  K = 3: UCB1 regret 100.2 (bound ≈ 526), Thompson 18.9" (three Bernoulli arms, the same T,
  gaps whose bound is within 1.5 % of it; UCB1's regret depends on the gaps only). The means
  read as per-token acceptance rates of three drafters (strong model, weaker model, n-gram).
* ``reversed``: those means until ``T/2``, then reversed (``(0.4, 0.7, 0.9)``): the best arm
  becomes the worst and the worst the best.
* ``shift``: those means until ``T/2``, then reversed *and* lowered by 0.3 (floored at 0):
  ``(0.1, 0.4, 0.6)`` — a harder workload for every drafter that also re-ranks them. Here
  the new best arm is worse than the old best arm used to be, so the old arm's lifetime
  mean keeps a UCB1 or a Thompson sampler on it for thousands of steps; the windowed and
  discounted selectors forget it within their memory (~1000 steps).

Beside each non-stationary scenario: the bound of a UCB1 restarted at the switch (``B(T/2)``
for each half), a reference no plain UCB1 enjoys.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..select import Observation, make_selector
from .results import pyplot, save_figure, write_results

__all__ = [
    "DEFAULT_SELECTORS",
    "make_scenarios",
    "REFERENCE",
    "run",
    "simulate",
    "stationary_means",
    "ucb1_bound",
    "plot",
    "summarize",
]

DEFAULT_SELECTORS = (
    "ucb1",
    "thompson",
    "discounted-ucb",
    "sliding-window-ucb",
    "epsilon-greedy",
    "fixed",
    "oracle",
)
# The published figures this simulation is compared with (T = 10,000, K = 3).
REFERENCE = {"steps": 10_000, "arms": 3, "ucb1": 100.2, "thompson": 18.9, "ucb1_bound": 526.0}
CURVE_POINTS = 200


def stationary_means(arms: int) -> list[float]:
    """The stationary scenario's means: 0.9, 0.7, then ``arms − 2`` values evenly spaced
    from 0.4 down to 0.1 (K = 3: ``(0.9, 0.7, 0.4)``; K = 1: ``(0.9,)``)."""
    if isinstance(arms, bool) or not isinstance(arms, (int, np.integer)) or arms < 1:
        raise ValueError(f"arms must be an integer >= 1, got {arms!r}.")
    head = [0.9, 0.7][:arms]
    tail = np.linspace(0.4, 0.1, arms - 2).round(6).tolist() if arms > 2 else []
    return head + tail


def ucb1_bound(means: Sequence[float], steps: int | np.ndarray) -> float | np.ndarray:
    """Auer, Cesa-Bianchi & Fischer (2002), Theorem 1: the expected regret of UCB1 after ``n``
    plays is at most ``8 Σ_{i: Δ_i > 0} ln n / Δ_i + (1 + π²/3) Σ_i Δ_i``."""
    means = np.asarray(means, dtype=float)
    gaps = means.max() - means
    gaps = gaps[gaps > 0]
    n = np.maximum(np.asarray(steps, dtype=float), 1.0)
    value = 8.0 * np.log(n) * np.sum(1.0 / gaps) + (1.0 + math.pi**2 / 3.0) * np.sum(gaps)
    return float(value) if np.ndim(value) == 0 else value


def make_scenarios(steps: int, arms: int) -> dict[str, dict[str, Any]]:
    """The three scenarios of :func:`run` (module docstring): name → means, switch_at,
    switched_means."""
    means = stationary_means(arms)
    reversed_means = means[::-1]
    shifted = [round(max(m - 0.3, 0.0), 6) for m in reversed_means]
    half = steps // 2
    return {
        "stationary": {"means": means, "switch_at": None, "switched_means": None},
        "reversed": {"means": means, "switch_at": half, "switched_means": reversed_means},
        "shift": {"means": means, "switch_at": half, "switched_means": shifted},
    }


def _check_means(means: Any, name: str) -> np.ndarray:
    values = np.asarray(means, dtype=float)
    if values.ndim != 1 or values.size < 1:
        raise ValueError(f"{name} must be a non-empty sequence of numbers.")
    if not np.all((values >= 0) & (values <= 1)):
        raise ValueError(f"{name} are Bernoulli means and must lie in [0, 1], got {values.tolist()}.")
    return values


def simulate(
    selector_name: str,
    means: Sequence[float],
    steps: int,
    seed: int,
    switch_at: int | None = None,
    switched_means: Sequence[float] | None = None,
    **options: Any,
) -> np.ndarray:
    """Cumulative pseudo-regret (length ``steps``, float64) of one run of ``selector_name``
    on Bernoulli arms with ``means``, which become ``switched_means`` from step
    ``switch_at`` on (0-based) when both are given. ``options`` go to the selector
    (``make_selector(name, K, reward="acceptance", seed=seed, **options)``; the oracle is
    given the true means and told the switch)."""
    before = _check_means(means, "means")
    k = before.size
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}.")
    if (switch_at is None) != (switched_means is None):
        raise ValueError("switch_at and switched_means go together.")
    after = before
    if switch_at is not None:
        after = _check_means(switched_means, "switched_means")
        if after.size != k:
            raise ValueError(f"switched_means has {after.size} arms, means {k}.")
        if isinstance(switch_at, bool) or not isinstance(switch_at, (int, np.integer)) or not 0 <= switch_at <= steps:
            raise ValueError(f"switch_at must be an integer in [0, steps], got {switch_at!r}.")
    else:
        switch_at = steps
    options = {"reward": "acceptance", "seed": seed, **options}
    if selector_name == "oracle":
        options["means"] = before.tolist()
    selector = make_selector(selector_name, k, **options)

    uniforms = np.random.default_rng([seed, 0x5EED]).random(steps).tolist()
    # One uniform u_t per step, shared by all selectors run with this seed: the chosen arm
    # pays r_t = 1{u_t < μ_arm} (common random numbers across selectors).
    loss_before = (before.max() - before).tolist()
    loss_after = (after.max() - after).tolist()
    mu_before, mu_after = before.tolist(), after.tolist()
    regret = np.empty(steps)
    observations = (Observation(0, 1, 1, 1.0), Observation(1, 1, 2, 1.0))
    for t in range(steps):
        if t == switch_at and selector_name == "oracle":
            selector.set_means(mu_after)
        arm = selector.select()
        if t < switch_at:
            loss, mu = loss_before[arm], mu_before[arm]
        else:
            loss, mu = loss_after[arm], mu_after[arm]
        regret[t] = loss
        selector.update(arm, observations[uniforms[t] < mu])
    return np.cumsum(regret)


def _options(name: str, arms: int) -> dict[str, Any]:
    """The options a selector runs with in the simulation (its defaults, reward="acceptance")."""
    extra = {"means": stationary_means(arms)} if name == "oracle" else {}
    config = make_selector(name, arms, reward="acceptance", **extra)._config()
    config.pop("seed", None)
    return config


def _curve_index(steps: int, points: int = CURVE_POINTS) -> np.ndarray:
    """Indices (0-based steps) at which curves are kept: evenly spaced, always the last."""
    return np.unique(np.linspace(0, steps - 1, min(points, steps)).round().astype(int))


def _scenario(scenario: str, spec: dict[str, Any], means: list[float], steps: int, seeds: int,
              selectors: Sequence[str], bar: Any) -> dict[str, Any]:
    """One scenario's entry of :func:`run`: the UCB1 bound (and its curve) and every selector's
    regret over the seeds (final mean ± sd, curves at :func:`_curve_index`)."""
    index = _curve_index(steps)
    t_axis = (index + 1).tolist()  # number of steps played
    entry: dict[str, Any] = {**spec, "curve_t": t_axis}
    if spec["switch_at"] is None:
        entry["ucb1_bound"] = ucb1_bound(means, steps)
        entry["bound_curve"] = ucb1_bound(means, np.asarray(t_axis)).round(3).tolist()
    else:
        s = spec["switch_at"]
        entry["ucb1_bound_restarted"] = ucb1_bound(means, s) + ucb1_bound(spec["switched_means"], steps - s)
        t = np.asarray(t_axis, dtype=float)
        curve = np.where(
            t <= s,
            ucb1_bound(means, t),
            ucb1_bound(means, s) + ucb1_bound(spec["switched_means"], np.maximum(t - s, 1.0)),
        )
        entry["bound_curve"] = curve.round(3).tolist()
    entry["selectors"] = {}
    for name in selectors:
        if bar is not None:
            bar.set_postfix_str(f"{scenario}: {name}")
        curves = np.empty((seeds, steps))
        for seed in range(seeds):
            curves[seed] = simulate(name, means, steps, seed, spec["switch_at"], spec["switched_means"])
            if bar is not None:
                bar.update(1)
        final = curves[:, -1]
        sd = float(final.std(ddof=1)) if seeds > 1 else 0.0
        sel = {
            "regret_mean": float(final.mean()),
            "regret_sd": sd,
            "curve_mean": curves[:, index].mean(axis=0).round(3).tolist(),
            "curve_sd": (curves[:, index].std(axis=0, ddof=1) if seeds > 1 else np.zeros(index.size))
            .round(3)
            .tolist(),
        }
        if spec["switch_at"] is not None:
            s = spec["switch_at"]
            at_switch = curves[:, s - 1] if s > 0 else np.zeros(seeds)
            sel["regret_before_switch_mean"] = float(at_switch.mean())
            sel["regret_after_switch_mean"] = float((final - at_switch).mean())
            sel["regret_after_switch_sd"] = float((final - at_switch).std(ddof=1)) if seeds > 1 else 0.0
        entry["selectors"][name] = sel
    return entry


def run(
    steps: int = 10_000,
    arms: int = 3,
    seeds: int = 20,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    progress: bool = True,
    selectors: Sequence[str] = DEFAULT_SELECTORS,
) -> dict[str, Any]:
    """The three scenarios × ``selectors`` × seeds ``0 .. seeds − 1``; returns (and writes to
    ``json_path``) the results; draws the regret curves to ``plot_path`` (PNG)."""
    for name, value, low in (("steps", steps, 2), ("arms", arms, 1), ("seeds", seeds, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    scenarios = make_scenarios(steps, arms)
    means = stationary_means(arms)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "steps": steps,
        "arms": arms,
        "seeds": seeds,
        "reward": "acceptance: Bernoulli(mean) per step, Observation(accepted=r, proposed=1, tokens=r+1, seconds=1)",
        "regret": "pseudo-regret: sum over steps of (best mean - mean of the chosen arm)",
        "reference": REFERENCE,
        "selector_options": {name: _options(name, arms) for name in selectors},
        "scenarios": {},
    }
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    total = len(scenarios) * len(selectors) * seeds
    bar = tqdm(total=total, desc="bandit simulation", unit="run", disable=not progress) if tqdm else None
    try:
        for scenario, spec in scenarios.items():
            results["scenarios"][scenario] = _scenario(scenario, spec, means, steps, seeds, selectors, bar)
    finally:
        if bar is not None:
            bar.close()
    results["seconds"] = round(time.perf_counter() - started, 2)
    if json_path is not None:
        write_results(json_path, results)
    if plot_path is not None:
        plot(results, plot_path)
    return results


def summarize(results: dict[str, Any]) -> str:
    """A Markdown table: final regret (mean ± sd) per selector and scenario, the bounds, and
    the regret added after the switch in the non-stationary scenarios."""
    scenarios = results["scenarios"]
    names = list(next(iter(scenarios.values()))["selectors"])
    head = "| selector | " + " | ".join(scenarios) + " |"
    lines = [
        f"Bernoulli bandits, T={results['steps']}, K={results['arms']}, {results['seeds']} seeds: "
        "final pseudo-regret, mean ± sd (after the switch in brackets)",
        "",
        head,
        "|" + "---|" * (len(scenarios) + 1),
    ]
    for name in names:
        cells = []
        for entry in scenarios.values():
            sel = entry["selectors"][name]
            cell = f"{sel['regret_mean']:.1f} ± {sel['regret_sd']:.1f}"
            if "regret_after_switch_mean" in sel:
                cell += f" ({sel['regret_after_switch_mean']:.1f})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    bounds = [
        f"{e['ucb1_bound']:.1f}" if "ucb1_bound" in e else f"{e['ucb1_bound_restarted']:.1f} (restarted)"
        for e in scenarios.values()
    ]
    lines.append("| UCB1 bound | " + " | ".join(bounds) + " |")
    ref = results["reference"]
    lines += [
        "",
        f"Reference (T={ref['steps']}, K={ref['arms']}): UCB1 {ref['ucb1']}, Thompson {ref['thompson']}, "
        f"bound ≈ {ref['ucb1_bound']:.0f}. Means: "
        + "; ".join(
            f"{k} {tuple(e['means'])}" + (f" → {tuple(e['switched_means'])} at t={e['switch_at']}" if e["switch_at"] else "")
            for k, e in scenarios.items()
        ),
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str | Path) -> None:
    """Regret curves (mean ± sd band over seeds) per selector, one panel per scenario, with
    the UCB1 bound (restarted at the switch in the non-stationary scenarios); a symmetric-log
    y axis so that the oracle's 0 and the fixed arm's linear regret both show."""
    plt = pyplot(" (or pass no plot path)")
    scenarios = results["scenarios"]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 6), squeeze=False)
    for ax, (scenario, entry) in zip(axes[0], scenarios.items()):
        t = np.asarray(entry["curve_t"])
        for name, sel in entry["selectors"].items():
            mean = np.asarray(sel["curve_mean"])
            sd = np.asarray(sel["curve_sd"])
            (line,) = ax.plot(t, mean, label=f"{name} ({sel['regret_mean']:.1f} ± {sel['regret_sd']:.1f})")
            ax.fill_between(t, np.maximum(mean - sd, 0), mean + sd, color=line.get_color(), alpha=0.2, lw=0)
        if scenario == "stationary":
            label = f"UCB1 bound ({entry['ucb1_bound']:.0f})"
        else:
            label = f"UCB1 bound if restarted at the switch ({entry['ucb1_bound_restarted']:.0f})"
            ax.axvline(entry["switch_at"], color="grey", lw=0.8, ls=":")
        ax.plot(t, entry["bound_curve"], color="black", ls="--", lw=1, label=label)
        means = ", ".join(f"{m:g}" for m in entry["means"])
        title = f"{scenario}: means ({means})"
        if entry["switched_means"] is not None:
            title += " → (" + ", ".join(f"{m:g}" for m in entry["switched_means"]) + f") at t={entry['switch_at']}"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("cumulative pseudo-regret")
        ax.set_yscale("symlog", linthresh=10)
        ax.set_xlim(0, results["steps"])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    fig.suptitle(
        f"Bernoulli bandits: T={results['steps']}, K={results['arms']}, {results['seeds']} seeds (mean ± sd)",
        fontsize=10,
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
