"""Choosing a draft tree's node budget at every step from full information (SPEC.md §7, "Choosing
the tree's node budget from full information").

A tree step runs drafter ``i`` at ``γ_i`` tokens (``0`` leaves it out of the tree; all zeros is a
target-only step). After the step every drafter that ran is scored by how far its chain matched
the committed tokens, whichever branch was kept — in greedy mode exactly what its chain alone would
have had accepted. :class:`TreeBudget` turns those counts into survival curves ``P(a_i ≥ d)`` per
drafter and request context (a Beta prior on each depth's hazard, counts discounted at every step
so that a change of text is followed), the step times into a cost model (seconds per node count
plus each drafter's proposal), and chooses the allocation of highest ``E[tokens] / E[seconds]``
among a small candidate set; every few steps it adds a drafter left out, so that it keeps being
measured.

A choice depends on past steps only (never on the step's random numbers), so the output law stays
the target's (SPEC.md §8, "Selection never changes the output law").
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ..checks import check_int
from .state import MAX_CONTEXTS

__all__ = ["Allocation", "TreeBudget"]

Allocation = tuple[int, ...]
"""One draft length per drafter, in the engine's order; 0: the drafter is left out of the tree."""

FORGET = 0.95  # recent counts, per step of a context: a memory of about 1 / (1 - 0.95) = 20 steps
LONG_FORGET = 0.999  # long-run counts: about 1,000 steps, what a drafter left out returns to
SHRINK = 2.0  # rows' worth of weight the long-run hazard has in a depth's estimate
EXPLORE_EVERY = 8  # every 8th step of a context adds its stalest left-out drafter at its γ_max
PRIOR = (1.0, 1.0)  # Beta(α₀, β₀) of each long-run hazard: a drafter never seen has P(a ≥ d) = 2^-d
WINDOW = 16  # cost samples kept per node count and per (drafter, γ); their median is the estimate
STEP_GAMMAS = (1, 2, 4)  # a drafter's candidate draft lengths besides 0 and its γ_max
MAX_CANDIDATES = 256  # more allocations than this: coordinate ascent over the same values (host time)
NEGLIGIBLE = 1e-9  # P(max ≥ d) below which deeper depths add nothing to E[tokens]


def _count(value: Any, name: str, low: int, high: int | None = None) -> int:
    """An integer in ``[low, high]`` (``bool`` refused), else a ValueError naming ``name``."""
    return check_int(name, value, low, high)


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}.")
    return float(value)


def _curve(samples: dict[int, deque[float]], x: int, offset: float) -> float | None:
    """The cost at ``x`` from recent samples per ``x``: their median where ``x`` was measured; else,
    with two or more measured points, the least-squares line through their medians (slope ≥ 0, at
    least half the cheapest median); else the one measured point scaled by ``(offset + x) /
    (offset + x₀)``; None when nothing was measured."""
    if not samples:
        return None
    if x in samples:
        return statistics.median(samples[x])
    points = [(k, statistics.median(v)) for k, v in sorted(samples.items())]
    if len(points) == 1:
        (k, m), = points
        return m * (offset + x) / (offset + k)
    mean_x = sum(k for k, _ in points) / len(points)
    mean_y = sum(m for _, m in points) / len(points)
    spread = sum((k - mean_x) ** 2 for k, _ in points)
    slope = max(sum((k - mean_x) * (m - mean_y) for k, m in points) / spread, 0.0)
    return max(mean_y + slope * (x - mean_x), 0.5 * min(m for _, m in points))


class _Counts:
    """One context's discounted counts, per drafter and depth ``d`` (index ``d − 1``): rows that
    reached ``d`` (their chain matched the committed tokens to depth ``d``) and rows at risk at ``d``
    (offered ``d``, matched to ``d − 1``, not cut short), recent and long-run; rows whose depth ``d``
    was observed at all (recent: how stale the drafter's estimate is)."""

    def __init__(self, gamma_max: Sequence[int]) -> None:
        self.reached = [[0.0] * g for g in gamma_max]
        self.at_risk = [[0.0] * g for g in gamma_max]
        self.long_reached = [[0.0] * g for g in gamma_max]
        self.long_at_risk = [[0.0] * g for g in gamma_max]
        self.observed = [[0.0] * g for g in gamma_max]
        self.steps = 0


class TreeBudget:
    """Chooses each tree step's allocation ``(γ_1, …, γ_M)``, ``γ_i ∈ {0} ∪ [1, γ_max_i]``, per
    request context (any hashable; None is one shared context), from what every drafter would have
    had accepted at every earlier step (SPEC.md §7).

    Args:
        gamma_max: each drafter's largest draft length, in the engine's order.
        forget: every recent count of a context is multiplied by this at each of its steps
            (``0 < f ≤ 1``; 1 never forgets).
        long_forget: the same for the long-run counts (``forget ≤ long_forget ≤ 1``).
        prior: ``(α₀, β₀) > 0``, the Beta prior of each depth's long-run hazard.
        shrink: the weight, in rows, of the long-run hazard in a depth's estimate (``> 0``).
        explore_every: every this many steps of a context, the drafter whose deepest depth was
            observed least lately (among those the best allocation does not run at their γ_max) is
            added at its γ_max; None never explores (a left-out drafter is then never measured again).
        window: step times kept per node count and per (drafter, γ).
        cost: ``allocation -> seconds`` in place of the learned cost model (e.g. from a
            calibration): the choices then depend on token counts only, so a seeded sampled run is
            reproducible bit for bit.
        max_contexts: contexts kept (the least recently used forgotten first).
    """

    def __init__(self, gamma_max: Sequence[int], *, forget: float = FORGET, long_forget: float = LONG_FORGET,
                 prior: tuple[float, float] = PRIOR, shrink: float = SHRINK,
                 explore_every: int | None = EXPLORE_EVERY, window: int = WINDOW,
                 cost: Callable[[Allocation], float] | None = None, max_contexts: int = MAX_CONTEXTS) -> None:
        if isinstance(gamma_max, (str, bytes)) or not isinstance(gamma_max, Sequence) or not gamma_max:
            raise ValueError(f"gamma_max must be a non-empty list of draft lengths, one per drafter; "
                             f"got {gamma_max!r}.")
        self.gamma_max: Allocation = tuple(_count(g, f"gamma_max[{i}]", 1) for i, g in enumerate(gamma_max))
        if isinstance(forget, bool) or not isinstance(forget, (int, float)) or not 0 < forget <= 1:
            raise ValueError(f"forget must be a number in (0, 1]; got {forget!r}.")
        if isinstance(long_forget, bool) or not isinstance(long_forget, (int, float)) \
                or not forget <= long_forget <= 1:
            raise ValueError(f"long_forget must be a number in [forget, 1] = [{forget}, 1]; got {long_forget!r}.")
        self.forget, self.long_forget = float(forget), float(long_forget)
        self.shrink = _positive(shrink, "shrink")
        if not isinstance(prior, (tuple, list)) or len(prior) != 2:
            raise ValueError(f"prior must be a pair (α₀, β₀) of numbers > 0; got {prior!r}.")
        self.prior = (_positive(prior[0], "prior α₀"), _positive(prior[1], "prior β₀"))
        self.explore_every = None if explore_every is None else _count(explore_every, "explore_every", 1)
        self.window = _count(window, "window", 1)
        self.max_contexts = _count(max_contexts, "max_contexts", 1)
        if cost is not None and not callable(cost):
            raise ValueError(f"cost must be a function of an allocation (its seconds), or None; got {cost!r}.")
        self.cost = cost
        # Per drafter, its candidate draft lengths: 0, the STEP_GAMMAS below γ_max, γ_max.
        self.values = [tuple(sorted({0, g, *(s for s in STEP_GAMMAS if s < g)})) for g in self.gamma_max]
        size = math.prod(len(v) for v in self.values)
        self.candidates: list[Allocation] | None = None  # None: too many, coordinate ascent
        if size <= MAX_CANDIDATES:
            self.candidates = sorted(itertools.product(*self.values), key=lambda a: (sum(a), a))
        self._contexts: OrderedDict[Hashable, _Counts] = OrderedDict()
        self._expansions: dict[int, tuple[int, int]] = {}  # drafter -> (topk, nodes): its part is an expansion
        self._verify: dict[int, deque[float]] = {}  # node count -> seconds of the step less its proposals
        self._propose: list[dict[int, deque[float]]] = [{} for _ in self.gamma_max]  # per drafter, γ -> seconds
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ node counts
    def expand(self, expansions: dict[int, tuple[int, int]]) -> None:
        """Drafter index → ``(topk, nodes)`` for the drafters whose part of the tree is a top-k
        expansion (SPEC.md §7): at depth γ such a part is :meth:`nodes_at` nodes, not γ. Replaces the
        earlier call's (cost samples stay: they are keyed by node count)."""
        checked = {}
        for i, pair in dict(expansions).items():
            _count(i, "drafter index", 0, len(self.gamma_max) - 1)
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"An expansion is a pair (topk, nodes); got {pair!r} for drafter {i}.")
            checked[i] = (_count(pair[0], "topk", 1), _count(pair[1], "nodes", 1))
        with self._lock:
            self._expansions = checked

    def nodes_at(self, drafter: int, gamma: int) -> int:
        """Drafter ``drafter``'s nodes at depth ``gamma``: ``gamma`` for a chain; for an expansion of
        ``(K, N)``, ``min(N, K + (γ − 1)·K²)`` (0 at γ = 0)."""
        if drafter not in self._expansions or gamma == 0:
            return gamma
        topk, nodes = self._expansions[drafter]
        return min(nodes, topk + (gamma - 1) * topk * topk)

    def node_count(self, allocation: Sequence[int]) -> int:
        """The tree's nodes for ``allocation`` (SPEC.md §7, "Cost")."""
        allocation = self._check(allocation)
        with self._lock:
            return self._node_count(allocation)

    def _node_count(self, allocation: Allocation) -> int:
        return sum(self.nodes_at(i, g) for i, g in enumerate(allocation))

    # ------------------------------------------------------------------ estimates
    def survival(self, drafter: int, context: Hashable = None) -> list[float]:
        """``P(a ≥ d)`` for ``d = 1 … γ_max``: the product over ``j ≤ d`` of each depth's hazard
        ``h_j = (w·H_j + reached_j) / (w + at_risk_j)`` (recent counts, shrunk toward the long-run
        hazard ``H_j = (α₀ + R_j) / (α₀ + β₀ + K_j)`` of the long-run counts; a Kaplan–Meier estimate,
        non-increasing in ``d``)."""
        with self._lock:
            return self._survival(self._counts(context, create=False), drafter)

    def _survival(self, counts: _Counts, drafter: int) -> list[float]:
        alpha, beta = self.prior
        out, s, w = [], 1.0, self.shrink
        for r, k, long_r, long_k in zip(counts.reached[drafter], counts.at_risk[drafter],
                                        counts.long_reached[drafter], counts.long_at_risk[drafter]):
            s *= (w * (alpha + long_r) / (alpha + beta + long_k) + r) / (w + k)
            out.append(s)
        return out

    def expected_tokens(self, allocation: Sequence[int], context: Hashable = None) -> float:
        """Tokens a row commits at a step of ``allocation``: ``1 + E[max_i a_i]``, the drafters'
        accepted lengths taken as independent (an estimate; SPEC.md §7)."""
        allocation = self._check(allocation)
        with self._lock:
            counts = self._counts(context, create=False)
            return self._expected(allocation, [self._survival(counts, i) for i in range(len(allocation))])

    @staticmethod
    def _expected(allocation: Allocation, curves: list[list[float]]) -> float:
        total = 1.0
        for d in range(1, max(allocation, default=0) + 1):
            miss = 1.0
            for g, curve in zip(allocation, curves):
                if g >= d:
                    miss *= 1.0 - curve[d - 1]
            total += 1.0 - miss
            if 1.0 - miss < NEGLIGIBLE:
                break
        return total

    def measured(self, allocation: Sequence[int]) -> bool:
        """Whether the cost model measured ``allocation``'s node count and each of its proposals
        (always, with a fixed ``cost``); else :meth:`seconds` is a prior."""
        allocation = self._check(allocation)
        with self._lock:
            if self.cost is not None or not any(allocation):
                return self.cost is not None or 0 in self._verify
            return self._node_count(allocation) in self._verify and all(
                g in self._propose[i] for i, g in enumerate(allocation) if g)

    def seconds(self, allocation: Sequence[int]) -> float:
        """The estimated seconds of a step of ``allocation``: ``cost(allocation)`` when given, else
        ``V(N) + Σ_{γ_i > 0} P_i(γ_i)``, ``N`` the tree's node count (SPEC.md §7)."""
        allocation = self._check(allocation)
        with self._lock:
            return self._seconds(allocation, {})

    def _seconds(self, allocation: Allocation, memo: dict[Any, float]) -> float:
        if self.cost is not None:
            return _positive(self.cost(allocation), "cost(allocation)")
        total = self._memo(memo, ("V", self._node_count(allocation)))
        for i, g in enumerate(allocation):
            if g:
                total += self._memo(memo, (i, g))
        return max(total, NEGLIGIBLE)

    def _memo(self, memo: dict[Any, float], key: tuple[Any, int]) -> float:
        if key not in memo:
            which, x = key
            if which == "V":
                value = _curve(self._verify, x, 2.0)
                memo[key] = (2 + x) / 2 if value is None else value  # in target steps before any measurement
            else:
                value = _curve(self._propose[which], x, 0.0)
                memo[key] = x / 2 * self._memo(memo, ("V", 0)) if value is None else value
        return memo[key]

    # ------------------------------------------------------------------ the choice
    def best(self, context: Hashable = None) -> Allocation:
        """The candidate allocation of highest ``E[tokens] / E[seconds]`` (ties: fewer nodes, then
        the smaller allocation), without exploration."""
        with self._lock:
            counts = self._counts(context, create=False)
            curves = [self._survival(counts, i) for i in range(len(self.gamma_max))]
            memo: dict[Any, float] = {}

            def rate(allocation: Allocation) -> float:
                return self._expected(allocation, curves) / self._seconds(allocation, memo)

            if self.candidates is not None:
                return max(self.candidates, key=rate)  # the first of the best: candidates go by node count
            current = tuple(0 for _ in self.gamma_max)  # coordinate ascent from the target-only step
            for _ in range(sum(len(v) for v in self.values)):
                before = current
                for i, values in enumerate(self.values):
                    options = sorted((current[:i] + (v,) + current[i + 1:] for v in values), key=lambda a: (sum(a), a))
                    current = max(options, key=rate)
                if current == before:
                    break
            return current

    def ranking(self, context: Hashable = None, limit: int = 8) -> list[Allocation]:
        """Up to ``limit`` drafting candidates by decreasing ``E[tokens] / E[seconds]`` (ties as
        :meth:`best`; with coordinate ascent, :meth:`best` alone): what a guard tries after refusing
        :meth:`choose`'s allocation (SPEC.md §7, "The never-slower guard for trees")."""
        if self.candidates is None:
            best = self.best(context)
            return [best] if any(best) else []
        with self._lock:
            counts = self._counts(context, create=False)
            curves = [self._survival(counts, i) for i in range(len(self.gamma_max))]
            memo: dict[Any, float] = {}
            rated = [(-self._expected(a, curves) / self._seconds(a, memo), n, a)
                     for n, a in enumerate(self.candidates) if any(a)]
        return [a for _, _, a in sorted(rated)[:limit]]

    def choose(self, context: Hashable = None) -> Allocation:
        """The allocation of the next step of ``context``: at its first step every drafter at its
        γ_max (a probe: full information at once); at every ``explore_every``-th step :meth:`best`
        with the stalest drafter it leaves below γ_max raised to its γ_max; else :meth:`best`."""
        with self._lock:
            counts = self._counts(context, create=False)
            if counts.steps == 0:
                return self.gamma_max
            best = self.best(context)
            every = self.explore_every
            if every is None or (counts.steps + 1) % every:
                return best
            short = [i for i, g in enumerate(best) if g < self.gamma_max[i]]
            if not short:
                return best
            stalest = min(short, key=lambda i: (counts.observed[i][-1], i))
            return best[:stalest] + (self.gamma_max[stalest],) + best[stalest + 1:]

    # ------------------------------------------------------------------ observations
    def observe(self, allocation: Sequence[int], lengths: Sequence[Sequence[int]], taken: Sequence[int],
                seconds: float, drafting: Sequence[float] | None = None, context: Hashable = None,
                timed: bool = True) -> None:
        """One step of ``allocation``: ``lengths[i][b]`` drafter ``i``'s would-be accepted length in
        row ``b`` (−1: not observed — the drafter did not run, or its branch was never tested),
        ``taken[b]`` the tokens row ``b`` committed (0: inactive), ``seconds`` the step's time and
        ``drafting[i]`` the seconds of drafter ``i``'s proposal (None: all 0, the whole step is
        charged to its node count). Only depths ``d ≤ γ_i`` are observed; a row cut short (EOS,
        budget) after matching all it committed says nothing of the depths past what it committed.
        ``timed=False``: the step's time is not a steady cost — it captured a CUDA graph or compiled code,
        or stalled (SPEC.md §7, §8) — so the cost model does not see it; its counts are kept."""
        allocation = self._check(allocation)
        seconds = _positive(seconds, "seconds")
        taken = [_count(t, "taken", 0) for t in taken]
        drafting = [0.0] * len(allocation) if drafting is None else [float(s) for s in drafting]
        if len(lengths) != len(allocation) or len(drafting) != len(allocation):
            raise ValueError(f"lengths and drafting need one entry per drafter ({len(allocation)}).")
        if any(not math.isfinite(s) or s < 0 for s in drafting):
            raise ValueError(f"drafting seconds must be finite and >= 0; got {drafting!r}.")
        rows: list[list[int]] = []
        for i, (g, row) in enumerate(zip(allocation, lengths)):
            row = [_count(p, f"lengths[{i}]", -1) for p in row]
            if len(row) != len(taken):
                raise ValueError(f"lengths[{i}] has {len(row)} rows; taken has {len(taken)}.")
            if any(p > g or p > t for p, t in zip(row, taken) if g and t and p >= 0):
                raise ValueError(f"lengths[{i}] exceed the drafter's γ ({g}) or the tokens committed: {row!r}.")
            rows.append(row)
        with self._lock:
            counts = self._counts(context, create=True)
            for table, factor in ((counts.reached, self.forget), (counts.at_risk, self.forget),
                                  (counts.observed, self.forget), (counts.long_reached, self.long_forget),
                                  (counts.long_at_risk, self.long_forget)):
                for depths in table:
                    depths[:] = [x * factor for x in depths]
            for i, g in enumerate(allocation):
                if not g:
                    continue
                for p, t in zip(rows[i], taken):
                    if t <= 0 or p < 0:
                        continue
                    seen = g if p < t else min(g, t)  # matched all it committed: censored past it
                    for d in range(seen):
                        counts.observed[i][d] += 1
                        if p >= d:
                            counts.at_risk[i][d] += 1
                            counts.long_at_risk[i][d] += 1
                            if p > d:
                                counts.reached[i][d] += 1
                                counts.long_reached[i][d] += 1
            counts.steps += 1
            if self.cost is None and timed:
                self._sample(self._verify, self._node_count(allocation), max(seconds - sum(drafting), NEGLIGIBLE))
                for i, g in enumerate(allocation):
                    if g:
                        self._sample(self._propose[i], g, drafting[i])

    def _sample(self, samples: dict[int, deque[float]], key: int, value: float) -> None:
        samples.setdefault(key, deque(maxlen=self.window)).append(value)

    # ------------------------------------------------------------------ helpers
    def steps(self, context: Hashable = None) -> int:
        """Steps of ``context`` observed so far (its exploration clock)."""
        with self._lock:
            return self._counts(context, create=False).steps

    def _check(self, allocation: Sequence[int]) -> Allocation:
        if isinstance(allocation, (str, bytes)) or not isinstance(allocation, Sequence) \
                or len(allocation) != len(self.gamma_max):
            raise ValueError(f"An allocation is one draft length per drafter ({len(self.gamma_max)}); "
                             f"got {allocation!r}.")
        return tuple(_count(g, f"allocation[{i}]", 0, top)
                     for i, (g, top) in enumerate(zip(allocation, self.gamma_max)))

    def _counts(self, context: Hashable, create: bool) -> _Counts:
        try:
            hash(context)
        except TypeError:
            raise ValueError(f"context must be hashable; got {context!r}.") from None
        counts = self._contexts.get(context)
        if counts is None:
            counts = _Counts(self.gamma_max)
            if not create:
                return counts
            self._contexts[context] = counts
            while len(self._contexts) > self.max_contexts:
                self._contexts.popitem(last=False)
        self._contexts.move_to_end(context)
        return counts
