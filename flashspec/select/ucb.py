"""Upper-confidence-bound selectors: UCB1 (Auer et al. 2002) and, for workloads whose best
arm changes, discounted UCB and sliding-window UCB (Garivier & Moulines 2011).

All three play every arm once first, then the arm with the largest index
``mean_i / M + sqrt(c · ln(n) / N_i)`` (exact ties broken by the selector's RNG), where the
rewards are normalised to ``[0, 1]`` by ``M`` (1 for acceptance; for throughput the running
maximum, see :class:`~flashspec.select.base.BaseSelector`) and ``c`` is ``exploration``
(2 = Auer's UCB1, the default; 1 for the two non-stationary variants). They differ in
what ``mean_i``, ``N_i`` and ``n`` are computed from.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from .base import BaseSelector, _count, _real, positive

__all__ = ["UCB1Selector", "DiscountedUCBSelector", "SlidingWindowUCBSelector"]

DEFAULT_EXPLORATION = 2.0  # UCB1 as in Auer et al. (2002), for which the regret bound holds
# The non-stationary variants: a memory of about 1000 steps (window, or 1 / (1 − γ)) and half
# of UCB1's exploration: they re-learn every arm within each memory span, so exploration
# is their steady cost (SPEC.md, §bandits: the trade-off measured in the simulation).
DEFAULT_WINDOWED_EXPLORATION = 1.0
DEFAULT_WINDOW = 1000
DEFAULT_DISCOUNT = 0.999


class _UCB(BaseSelector):
    def __init__(self, num_arms: int, *, exploration: float = DEFAULT_EXPLORATION, **options: Any) -> None:
        super().__init__(num_arms, **options)
        self.exploration = positive(exploration, "exploration")

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "exploration": self.exploration}

    def _index_argmax(self, counts, sums, n: float) -> int:
        unplayed = self._unobserved(counts)
        if unplayed is not None:
            return unplayed
        m = self.normaliser
        log_n = math.log(n) if n > 1 else 0.0
        c = self.exploration * log_n
        index = [s / (k * m) + math.sqrt(c / k) for k, s in zip(counts, sums)]
        return self._argmax(index)


class UCB1Selector(_UCB):
    """UCB1: ``mean_i`` and ``N_i`` over all of arm ``i``'s observations, ``n`` = all
    observations."""

    kind = "ucb1"

    def __init__(self, num_arms: int, **options: Any) -> None:
        super().__init__(num_arms, **options)
        self.counts = [0] * self.num_arms
        self.sums = [0.0] * self.num_arms

    def _select(self) -> int:
        return self._index_argmax(self.counts, self.sums, sum(self.counts))

    def _update(self, arm: int, obs, reward: float) -> None:
        self.counts[arm] += 1
        self.sums[arm] += reward

    def _get_stats(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sums": list(self.sums)}

    def _set_stats(self, stats: dict[str, Any]) -> None:
        counts = [_count(v, "counts") for v in stats["counts"]]
        sums = [_real(v, "sums") for v in stats["sums"]]
        if len(counts) != self.num_arms or len(sums) != self.num_arms:
            raise ValueError("malformed selector state: per-arm statistics of the wrong length.")
        self.counts, self.sums = counts, sums


class DiscountedUCBSelector(_UCB):
    """Discounted UCB: every update first multiplies all arms' counts and reward sums by
    ``discount`` (γ), then adds 1 and the reward to the chosen arm:
    ``N_i = Σ_s γ^(t−s) 1{arm_s = i}``, ``mean_i = Σ_s γ^(t−s) r_s 1{arm_s = i} / N_i``,
    ``n = Σ_i N_i`` (≤ 1 / (1 − γ)). ``discount = 1`` is UCB1 (with the same ``exploration``).
    Defaults: γ = 0.999 (a memory of about 1 / (1 − γ) = 1000 steps), exploration 1."""

    kind = "discounted-ucb"

    def __init__(
        self,
        num_arms: int,
        *,
        discount: float = DEFAULT_DISCOUNT,
        exploration: float = DEFAULT_WINDOWED_EXPLORATION,
        **options: Any,
    ) -> None:
        super().__init__(num_arms, exploration=exploration, **options)
        discount = _real(discount, "discount")
        if not 0 < discount <= 1:
            raise ValueError(f"discount must be in (0, 1], got {discount}.")
        self.discount = discount
        self.weights = [0.0] * self.num_arms  # discounted counts N_i
        self.sums = [0.0] * self.num_arms  # discounted reward sums

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "discount": self.discount}

    def _select(self) -> int:
        return self._index_argmax(self.weights, self.sums, sum(self.weights))

    def _update(self, arm: int, obs, reward: float) -> None:
        g = self.discount
        if g != 1.0:
            self.weights = [w * g for w in self.weights]
            self.sums = [s * g for s in self.sums]
        self.weights[arm] += 1.0
        self.sums[arm] += reward

    def _get_stats(self) -> dict[str, Any]:
        return {"weights": list(self.weights), "sums": list(self.sums)}

    def _set_stats(self, stats: dict[str, Any]) -> None:
        weights = [_real(v, "weights") for v in stats["weights"]]
        sums = [_real(v, "sums") for v in stats["sums"]]
        if len(weights) != self.num_arms or len(sums) != self.num_arms or min(weights) < 0:
            raise ValueError("malformed selector state: discounted statistics of the wrong length or sign.")
        self.weights, self.sums = weights, sums


class SlidingWindowUCBSelector(_UCB):
    """Sliding-window UCB: ``mean_i`` and ``N_i`` from the last ``window`` (W) observations
    only (all arms together; an observation leaves the window exactly W updates later),
    ``n = min(t, W)`` with ``t`` the number of updates so far. An arm with no observation in
    the window is played before any index is compared. Defaults: W = 1000, exploration 1."""

    kind = "sliding-window-ucb"

    def __init__(
        self,
        num_arms: int,
        *,
        window: int = DEFAULT_WINDOW,
        exploration: float = DEFAULT_WINDOWED_EXPLORATION,
        **options: Any,
    ) -> None:
        super().__init__(num_arms, exploration=exploration, **options)
        window = _count(window, "window")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}.")
        self.window = window
        self.history: deque[tuple[int, float]] = deque()  # (arm, raw reward), oldest first
        self.counts = [0] * self.num_arms  # observations of each arm in the window
        self.sums = [0.0] * self.num_arms  # their reward sums
        self._since_refresh = 0

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "window": self.window}

    def _select(self) -> int:
        return self._index_argmax(self.counts, self.sums, min(sum(self.pulls), self.window))

    def _update(self, arm: int, obs, reward: float) -> None:
        if len(self.history) == self.window:
            old_arm, old_reward = self.history.popleft()
            self.counts[old_arm] -= 1
            self.sums[old_arm] -= old_reward
        self.history.append((arm, reward))
        self.counts[arm] += 1
        self.sums[arm] += reward
        self._since_refresh += 1
        if self._since_refresh >= self.window:  # amortised O(1): no drift from add/subtract
            self._refresh()

    def _refresh(self) -> None:
        per_arm: list[list[float]] = [[] for _ in range(self.num_arms)]
        for a, r in self.history:
            per_arm[a].append(r)
        self.counts = [len(v) for v in per_arm]
        self.sums = [math.fsum(v) for v in per_arm]
        self._since_refresh = 0

    def _get_stats(self) -> dict[str, Any]:
        # The running sums are stored as they are (not recomputed on load), so that a
        # restored selector continues bit for bit.
        return {
            "history": [[a, r] for a, r in self.history],
            "sums": list(self.sums),
            "since_refresh": self._since_refresh,
        }

    def _set_stats(self, stats: dict[str, Any]) -> None:
        history: deque[tuple[int, float]] = deque()
        for entry in stats["history"]:
            arm, r = entry
            history.append((self._check_arm(arm), _real(r, "reward")))
        if len(history) > self.window:
            raise ValueError(f"malformed selector state: {len(history)} observations for a window of {self.window}.")
        sums = [_real(v, "sums") for v in stats["sums"]]
        since_refresh = _count(stats["since_refresh"], "since_refresh")
        counts = [0] * self.num_arms
        exact = [[] for _ in range(self.num_arms)]
        for a, r in history:
            counts[a] += 1
            exact[a].append(r)
        if len(sums) != self.num_arms or any(
            not math.isclose(s, math.fsum(v), rel_tol=1e-9, abs_tol=1e-9 * (1 + math.fsum(map(abs, v))))
            for s, v in zip(sums, exact)
        ):
            raise ValueError("malformed selector state: window sums do not match the window's observations.")
        self.history, self.counts, self.sums, self._since_refresh = history, counts, sums, since_refresh
