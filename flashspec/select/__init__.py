"""Choosing a drafter for each step. This release ships the fixed selector; the bandits
(UCB1, Thompson sampling, windowed variants) plug in behind the same two methods."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Selector", "FixedSelector", "make_selector"]


class Selector(Protocol):
    def select(self) -> int:
        """Index of the drafter to use for the next step (may depend on the past only)."""

    def update(self, arm: int, num_accepted: int, num_proposed: int) -> None:
        """What the chosen drafter achieved in the step it was chosen for."""


class FixedSelector:
    """Always the same drafter (the first one by default)."""

    def __init__(self, arm: int = 0) -> None:
        self.arm = arm

    def select(self) -> int:
        return self.arm

    def update(self, arm: int, num_accepted: int, num_proposed: int) -> None:
        pass


def make_selector(selector: str | Selector) -> Selector:
    """A selector from its name, or the object itself."""
    if isinstance(selector, str):
        if selector == "fixed":
            return FixedSelector()
        raise ValueError(f"Unknown selector {selector!r}; available in this release: 'fixed'.")
    if not (hasattr(selector, "select") and hasattr(selector, "update")):
        raise ValueError("A selector must be a name or an object with select() and update().")
    return selector
