"""The oracle: told the true mean reward of each arm, it always plays a best one. For
simulations (its regret is zero by construction), never for serving."""

from __future__ import annotations

from typing import Any, Sequence

from .base import BaseSelector, _real

__all__ = ["OracleSelector"]


class OracleSelector(BaseSelector):
    """Plays ``argmax(means)`` (the lowest index among equal means). A simulation that
    changes the arms' means calls :meth:`set_means` at the change."""

    kind = "oracle"
    uses_reward = False

    def __init__(self, num_arms: int, means: Sequence[float] | None = None, **options: Any) -> None:
        super().__init__(num_arms, **options)
        if means is None:
            raise ValueError("The oracle selector needs the true means: make_selector('oracle', K, means=[...]).")
        self.means = self._check_means(means)

    def _check_means(self, means: Sequence[float]) -> list[float]:
        try:
            values = [_real(m, "each mean") for m in means]
        except TypeError:
            raise ValueError(f"means must be a sequence of {self.num_arms} numbers.") from None
        if len(values) != self.num_arms:
            raise ValueError(f"means has {len(values)} entries for {self.num_arms} arm(s).")
        return values

    def set_means(self, means: Sequence[float]) -> None:
        """Tell the oracle the new true means (a non-stationary simulation)."""
        values = self._check_means(means)
        with self._lock:
            self.means = values

    def _select(self) -> int:
        top = max(self.means)
        return self.means.index(top)

    def _update(self, arm, obs, reward) -> None:
        pass

    def _get_stats(self) -> dict[str, Any]:
        return {"means": list(self.means)}

    def _set_stats(self, stats: dict[str, Any]) -> None:
        self.means = self._check_means(stats["means"])

    @classmethod
    def _options_from_state(cls, state: dict[str, Any]) -> dict[str, Any]:
        return {**state.get("config", {}), "means": state["stats"]["means"]}
