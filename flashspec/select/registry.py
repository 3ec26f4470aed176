"""Selectors by name: :data:`SELECTORS`, :func:`make_selector`, :func:`selector_from_state_dict`."""

from __future__ import annotations

from typing import Any

from .base import BaseSelector, Selector
from .epsilon import EpsilonGreedySelector
from .fixed import FixedSelector
from .oracle import OracleSelector
from .request import RequestSelector
from .thompson import ThompsonSelector
from .ucb import DiscountedUCBSelector, SlidingWindowUCBSelector, UCB1Selector

__all__ = ["SELECTORS", "make_selector", "selector_from_state_dict"]

SELECTORS: dict[str, type[BaseSelector]] = {
    cls.kind: cls
    for cls in (
        FixedSelector,
        UCB1Selector,
        ThompsonSelector,
        DiscountedUCBSelector,
        SlidingWindowUCBSelector,
        EpsilonGreedySelector,
        OracleSelector,
        RequestSelector,
    )
}


def make_selector(selector: str | Selector, num_arms: int | None = None, **options: Any) -> Selector:
    """A selector from its name (one of :data:`SELECTORS`) for ``num_arms`` arms, with the
    class's keyword ``options`` (``reward``, ``seed``, ``window``, ...); or ``selector`` itself
    when it is already an object with ``select`` and ``update``.

    ``num_arms`` may be omitted for ``"fixed"`` only (the release-1 call ``make_selector("fixed")``).
    """
    if isinstance(selector, str):
        cls = SELECTORS.get(selector)
        if cls is None:
            raise ValueError(f"Unknown selector {selector!r}; available: {', '.join(map(repr, SELECTORS))}.")
        if num_arms is None and cls is not FixedSelector:
            raise ValueError(f"make_selector({selector!r}) needs num_arms (the number of arms).")
        try:
            return cls(num_arms, **options)
        except TypeError as exc:  # an option this selector does not take
            raise ValueError(f"Bad option for selector {selector!r}: {exc}.") from None
    if not (callable(getattr(selector, "select", None)) and callable(getattr(selector, "update", None))):
        raise ValueError("A selector must be a name or an object with select() and update().")
    if options:
        raise ValueError("Selector options apply only when the selector is given by name.")
    own = getattr(selector, "num_arms", None)
    if num_arms is not None and own is not None and own != num_arms:
        raise ValueError(f"The selector has {own} arm(s) but {num_arms} were configured.")
    return selector


def selector_from_state_dict(state: dict[str, Any]) -> BaseSelector:
    """A new selector of the kind recorded in ``state`` that continues from it."""
    if not isinstance(state, dict) or state.get("kind") not in SELECTORS:
        raise ValueError("state must be a selector state_dict() with a known 'kind'.")
    return SELECTORS[state["kind"]].from_state_dict(state)
