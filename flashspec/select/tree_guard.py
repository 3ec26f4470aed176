"""The never-slower guard for draft trees: a tree step may draft only while the call stays within
``slack`` of what the target alone would have taken (SPEC.md §7, "The never-slower guard for
trees").

The tree loop reads its step's values back at every step, so unlike the chain loop's guard
(:mod:`flashspec.select.guard`) nothing is pending when the next step is chosen. An allocation's
yield is estimated from full information: every step in which its drafters ran informs it, with
each drafter's would-be accepted length — a lower bound of what a tree of those chains commits.
The guard never reads a tensor and never sees a step's random numbers: its choices depend on
the past only, so the output law stays the target's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from .guard import GRACE_STEPS, KEPT_REQUESTS, OUTLIER, YIELD_PRIOR_STEPS, YIELD_WINDOW, bucket, check_slack
from .tree_budget import Allocation

__all__ = ["RANKED", "TreeGuard", "TreeGuardMemory"]

RANKED = 8  # drafting allocations of the budget's ranking tried after its choice is refused


class TreeGuardMemory:
    """What tree guards carry from call to call (kept on the engine: ``engine.tree_guard_memory``):
    per drafter, the seconds per position of its last :data:`KEPT_REQUESTS` measured catch-up
    proposals; per allocation, how many of its steps were taken for stalls; the last
    :data:`YIELD_WINDOW` drafting steps' full information (what the yields are estimated from)."""

    def __init__(self) -> None:
        self._rates: dict[int, deque[float]] = {}
        self.stalls: dict[Allocation, int] = {}
        # (drafters that ran, per drafter per row the would-be length, rows' committed tokens)
        self.history: deque[tuple[frozenset[int], list[list[int]], list[int]]] = deque(maxlen=YIELD_WINDOW)

    def add(self, drafter: int, seconds: float, width: int) -> None:
        """A catch-up proposal of ``width`` positions took ``seconds`` (steady part included)."""
        if width > 0 and math.isfinite(seconds) and seconds >= 0:
            self._rates.setdefault(drafter, deque(maxlen=KEPT_REQUESTS)).append(seconds / width)

    def rate(self, drafter: int) -> float | None:
        """The median seconds per position of the drafter's kept catch-ups, or None."""
        kept = self._rates.get(drafter)
        return statistics.median(kept) if kept else None


class TreeGuard:
    """Admits a tree step's allocation only while the call keeps its never-slower budget.

    Args:
        drafters: how many drafters an allocation covers.
        slack: δ, the fraction by which the call may be slower than the target alone.
        ratio: ``allocation -> ρ``, its step's cost in target-only steps as the budget's cost
            model predicts (used before this call measured the allocation).
        measured: ``allocation -> bool``, whether the cost model measured it (else it is a probe,
            counted at one target step). Default: always.
        memory: the engine's :class:`TreeGuardMemory`.
        layer_ratios: per drafter, λ: its layers over the target's (1 when not given).
        grace: g, target-only steps of extra allowance.
    """

    def __init__(self, drafters: int, slack: float, ratio: Callable[[Allocation], float],
                 memory: TreeGuardMemory | None = None, layer_ratios: Mapping[int, float] | None = None,
                 grace: int = GRACE_STEPS, measured: Callable[[Allocation], bool] | None = None) -> None:
        self.slack = check_slack(slack)
        if self.slack is None:
            raise ValueError("A guard needs a slack (a number >= 0).")
        self.drafters, self.ratio, self.grace = drafters, ratio, grace
        self.memory = memory if memory is not None else TreeGuardMemory()
        self.measured = measured if measured is not None else (lambda allocation: True)
        self.layer_ratios = dict(layer_ratios or {})
        self.seconds = 0.0  # S
        self.tokens = 0  # N
        self.base_seconds, self.base_tokens, self.base_steps = 0.0, 0, 0  # S₀, N₀, n₀
        self.rows = 1  # n̂
        self.steady: dict[Allocation, list[float]] = {}  # this call's counted steps without a catch-up
        self.history = self.memory.history  # the last drafting steps, this call's and earlier ones'
        self.prefill_seconds: float | None = None  # T_p
        self.prefill_tokens = 1  # L_p
        self.refused = 0  # steps whose first choice the guard refused

    # ------------------------------------------------------------------ estimates
    def prefill(self, seconds: float, tokens: int) -> None:
        """The call's prefill: ``seconds`` over ``tokens`` positions per row (the scale of a catch-up
        never measured)."""
        self.prefill_seconds, self.prefill_tokens = float(seconds), max(int(tokens), 1)

    def base(self) -> tuple[float, float] | None:
        """``(r₀, s₀)``: tokens per second and seconds per step of the counted target-only steps."""
        if not self.base_steps or self.base_seconds <= 0:
            return None
        return self.base_tokens / self.base_seconds, self.base_seconds / self.base_steps

    def cost(self, allocation: Allocation) -> float | None:
        """ĉ(γ): this call's median steady step of ``allocation``, else ρ(γ) · s₀, else (a probe:
        the cost model never measured it) s₀; None before s₀."""
        base = self.base()
        if base is None:
            return None
        if not any(allocation):
            return base[1]
        kept = self.steady.get(allocation)
        if kept:
            return statistics.median(kept)
        if not self.measured(allocation):
            return base[1]
        return self.predicted(allocation)

    def predicted(self, allocation: Allocation) -> float | None:
        """ρ(γ) · s₀: the cost model's prediction for ``allocation`` (a prior where unmeasured)."""
        base = self.base()
        return None if base is None else max(float(self.ratio(allocation)), 0.0) * base[1]

    def expected_yield(self, allocation: Allocation) -> float:
        """ŷ(γ): tokens per active row a step of ``allocation`` is counted at (a lower bound from
        the engine's last drafting steps that ran all its drafters, drawn towards 1; SPEC.md §7)."""
        drafting = [i for i, g in enumerate(allocation) if g]
        if not drafting:
            return 1.0
        total, informing = 0.0, 0
        for ran, lengths, taken in self.history:
            if not all(i in ran for i in drafting):
                continue
            rows = [b for b, t in enumerate(taken) if t > 0]
            if not rows:
                continue
            per_row = [min(taken[b], 1 + max(min(max(lengths[i][b], 0), allocation[i]) for i in drafting))
                       for b in rows]
            total += sum(per_row) / len(per_row)
            informing += 1
        return (total + YIELD_PRIOR_STEPS) / (informing + YIELD_PRIOR_STEPS)

    def catch_up_cost(self, drafter: int, width: int) -> float | None:
        """x̂_i(W): seconds drafter ``drafter``'s catch-up of ``width`` positions adds (0 for none);
        None when nothing prices it yet (no prefill reported)."""
        if width <= 0:
            return 0.0
        top = bucket(width)
        rate = self.memory.rate(drafter)
        if rate is not None:
            return rate * top
        if self.prefill_seconds is None:
            return None
        per = self.prefill_seconds / self.prefill_tokens
        return self.layer_ratios.get(drafter, 1.0) * max(self.prefill_seconds, top * per)

    def estimate(self, allocation: Allocation, widths: Mapping[int, int]) -> float | None:
        """ĉ(γ) + Σ x̂_i(W_i): a step's estimated seconds with its catch-ups; None if unpriced."""
        cost = self.cost(allocation)
        if cost is None:
            return None
        for i, g in enumerate(allocation):
            if g:
                extra = self.catch_up_cost(i, widths.get(i, 0))
                if extra is None:
                    return None
                cost += extra
        return cost

    def fits(self, allocation: Allocation, widths: Mapping[int, int]) -> bool:
        """Whether a step of ``allocation`` keeps the budget (SPEC.md §7's inequality)."""
        if not any(allocation):
            return True
        base, estimate = self.base(), self.estimate(allocation, widths)
        if base is None or estimate is None:
            return False
        rate, step = base
        allowed = (1 + self.slack) * (self.tokens + self.rows * self.expected_yield(allocation)) / rate
        return self.seconds + estimate <= allowed + self.grace * step

    # ------------------------------------------------------------------ the choice
    def choose(self, preferences: Iterable[Allocation], widths: Callable[[Allocation], Mapping[int, int]]
               ) -> Allocation:
        """The first allocation of ``preferences`` (the budget's choice, then its ranking) that keeps
        the budget, trying at most :data:`RANKED` drafting ones after the first; else target-only.
        ``widths(allocation)``: each drafting drafter's catch-up width (host arithmetic)."""
        first, tried = True, 0
        zeros: Allocation = (0,) * self.drafters
        for allocation in preferences:
            allocation = tuple(allocation)
            if not any(allocation):
                if first:
                    return allocation
                continue
            if self.fits(allocation, widths(allocation)):
                if not first:
                    self.refused += 1
                return allocation
            if first:
                first = False
            else:
                tried += 1
                if tried >= RANKED:
                    break
        if not first:
            self.refused += 1
        return zeros

    # ------------------------------------------------------------------ observations
    def observe(self, allocation: Sequence[int], seconds: float, tokens: int, rows: int,
                lengths: Sequence[Sequence[int]], taken: Sequence[int], widths: Mapping[int, int],
                drafting: Sequence[float], cold: bool = False) -> bool:
        """A step of ``allocation`` took ``seconds`` and committed ``tokens`` over ``rows`` active
        rows; ``lengths[i][b]`` drafter ``i``'s would-be accepted length (−1: not observed),
        ``taken[b]`` the row's committed tokens, ``widths`` the catch-ups it ran, ``drafting[i]``
        each proposal's seconds. ``cold``: it compiled or captured (counted nowhere). Returns
        whether its time is a steady measurement the budget's cost model may learn (not cold, not
        a stall)."""
        allocation = tuple(allocation)
        if cold or rows <= 0:
            return False
        ran = frozenset(i for i, g in enumerate(allocation) if g)
        stall = bool(ran) and self._stalled(allocation, seconds, widths)
        if ran:
            self.history.append((ran, [list(row) for row in lengths], list(taken)))
        for i, width in widths.items():
            if width > 0 and i in ran and not stall:
                self.memory.add(i, drafting[i], width)
        self.seconds += seconds
        self.tokens += tokens
        if not ran:
            self.base_seconds += seconds
            self.base_tokens += tokens
            self.base_steps += 1
            self.rows = max(rows, 1)
        elif not any(widths.get(i, 0) for i in ran) and not stall:
            self.steady.setdefault(allocation, []).append(seconds)
        return not stall

    def _stalled(self, allocation: Allocation, seconds: float, widths: Mapping[int, int]) -> bool:
        """Whether a drafting step is a stall: it cost more than :data:`OUTLIER` times what was
        expected of it (the larger of ĉ and the cost model's prediction, with its catch-ups) — until
        :data:`KEPT_REQUESTS` of the allocation's steps were taken for stalls over the engine's life,
        after which its cost is what it is."""
        expected, predicted = self.estimate(allocation, widths), self.predicted(allocation)
        if expected is None or predicted is None:
            return False
        extra = expected - (self.cost(allocation) or 0.0)
        if seconds <= OUTLIER * (max(expected - extra, predicted) + extra):
            return False
        stalls = self.memory.stalls.get(allocation, 0)
        if stalls >= KEPT_REQUESTS:
            return False
        self.memory.stalls[allocation] = stalls + 1
        return True
