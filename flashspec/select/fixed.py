"""The fixed selector: always the same arm; and the scripted one: a given sequence of arms."""

from __future__ import annotations

from typing import Any

from .base import BaseSelector

__all__ = ["FixedSelector", "ScriptedSelector"]


class FixedSelector(BaseSelector):
    """Always ``arm`` (the first by default). Updates are validated and counted, nothing
    else. ``num_arms`` defaults to ``arm + 1`` for callers that do not know it."""

    kind = "fixed"
    uses_reward = False

    def __init__(self, num_arms: int | None = None, arm: int = 0, **options: Any) -> None:
        if num_arms is None:
            if isinstance(arm, bool) or not isinstance(arm, int) or arm < 0:
                raise ValueError(f"arm must be an integer index >= 0, got {arm!r}.")
            num_arms = arm + 1
        super().__init__(num_arms, **options)
        self.arm = self._check_arm(arm)

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "arm": self.arm}

    def _select(self) -> int:
        return self.arm

    def _update(self, arm, obs, reward) -> None:
        pass


class ScriptedSelector:
    """Plays ``arms`` in a loop, whatever happens: a warm-up's choices (every arm, and each arm
    after gaps of another's steps, SPEC.md §4), which depend on nothing."""

    def __init__(self, num_arms: int, arms: list[int]) -> None:
        if not arms or any(not 0 <= a < num_arms for a in arms):
            raise ValueError(f"A script needs arms in [0, {num_arms}); got {arms!r}.")
        self.arms, self._next = list(arms), 0

    def select(self, context: Any = None) -> int:
        arm = self.arms[self._next % len(self.arms)]
        self._next += 1
        return arm

    def update(self, arm: int, observation: Any) -> None:
        pass
