"""ε-greedy: explore uniformly with probability ε, else play the best empirical mean."""

from __future__ import annotations

from typing import Any

from .base import BaseSelector, _count, _real

__all__ = ["EpsilonGreedySelector"]

DEFAULT_EPSILON = 0.1


class EpsilonGreedySelector(BaseSelector):
    """Plays every arm once first; then, with probability ``epsilon``, an arm drawn
    uniformly (the selector's RNG), otherwise the arm with the largest mean raw reward (ties
    broken by the RNG). ``epsilon = 0`` is greedy. No normalisation is needed: only the
    ranking of the means is used. Default ε = 0.1 (linear regret ≈ ε · T · mean gap: it
    never stops exploring; a simple, robust baseline)."""

    kind = "epsilon-greedy"

    def __init__(self, num_arms: int, *, epsilon: float = DEFAULT_EPSILON, **options: Any) -> None:
        super().__init__(num_arms, **options)
        epsilon = _real(epsilon, "epsilon")
        if not 0 <= epsilon <= 1:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}.")
        self.epsilon = epsilon
        self.counts = [0] * self.num_arms
        self.sums = [0.0] * self.num_arms

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "epsilon": self.epsilon}

    def _select(self) -> int:
        unplayed = self._unobserved(self.counts)
        if unplayed is not None:
            return unplayed
        if self.epsilon > 0 and self._rng.random() < self.epsilon:
            return self._rng.randrange(self.num_arms)
        return self._argmax([s / n for s, n in zip(self.sums, self.counts)])

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
