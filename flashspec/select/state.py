"""An engine's learning state (SPEC.md §8): the selectors that choose arms, per request context.

One object holds it all: the shared selector, the state every new context starts from, and
the selector of each context seen so far. ``engine.selection`` is one; saving, loading and
switching learned state all go through it:

* ``engine.selection.save(path)`` / ``engine.selection.load(path)`` — JSON, across restarts;
* ``engine.selection = engine.new_selection("thompson", seed=0)`` — start a different learner;
  keep the old object to switch back (``saved = engine.selection``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from ..checks import check_int
from .base import Selector
from .registry import make_selector, selector_from_state_dict

__all__ = ["MAX_CONTEXTS", "Selection"]

# Per-context selectors kept at most; the least recently used label is forgotten beyond that, so a
# long-running process that labels requests by user or route does not grow without bound.
MAX_CONTEXTS = 1024


class Selection:
    """The arms' selectors of one engine.

    Args:
        selector: a selector name (:data:`flashspec.select.SELECTORS`) or an object with
            ``select``/``update``.
        num_arms: the engine's number of (drafter, γ) arms; 0 for target-only (the name and
            options are still checked, and no selector is made).
        share: ``True`` — requests share what is learned (one selector per ``context``
            label; ``None`` is the default label); ``False`` — each request starts afresh from
            the initial state.
        max_contexts: how many ``context`` labels keep a selector of their own (least recently
            used forgotten first; a forgotten label starts again from the initial state).
        options: the named selector's options (``seed``, ``reward``, ...).
    """

    def __init__(self, selector: str | Selector, num_arms: int, *, share: bool = True,
                 max_contexts: int = MAX_CONTEXTS, **options: Any) -> None:
        check_int("max_contexts", max_contexts, 1)
        self.num_arms = num_arms
        self.max_contexts = max_contexts
        self.share = bool(share)
        if num_arms:
            self.selector: Selector | None = make_selector(selector, num_arms, **options)
        else:  # target-only: nothing to choose (the name and options are still checked)
            make_selector(selector, 1, **options)
            self.selector = None
        self.initial_state = _state_of(self.selector)  # what a new context (or request) starts from
        self.contexts: OrderedDict[Hashable, Selector] = OrderedDict()  # least recently used first

    def for_request(self, context: Hashable = None) -> Selector | None:
        """The selector a request labelled ``context`` uses (None: target-only), told that a
        new request begins (``begin_request``, where it has one)."""
        selector = self._for_request(context)
        begin = getattr(selector, "begin_request", None)
        if callable(begin):
            begin()
        return selector

    def _for_request(self, context: Hashable) -> Selector | None:
        if self.selector is None:
            return None
        if not self.share:
            if self.initial_state is None:
                raise ValueError("share_selector=False needs a selector with state_dict() to copy from.")
            return selector_from_state_dict(self.initial_state)
        if context is None:
            return self.selector
        if context not in self.contexts:
            if self.initial_state is None:
                raise ValueError("A context needs a selector with state_dict() to copy from.")
            self.contexts[context] = selector_from_state_dict(self.initial_state)
            while len(self.contexts) > self.max_contexts:
                self.contexts.popitem(last=False)
        self.contexts.move_to_end(context)
        return self.contexts[context]

    def state_dict(self) -> dict[str, Any]:
        """Everything the selectors learned, as JSON-serialisable values."""
        contexts = {json.dumps(k): _state_of(v) for k, v in self.contexts.items()}
        return {"default": _state_of(self.selector), "contexts": contexts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (e.g. after a restart)."""
        if not isinstance(state, dict) or "default" not in state or not isinstance(state.get("contexts", {}), dict):
            raise ValueError("Not a selector state: expected the dict that state_dict() returns.")
        contexts = OrderedDict()
        for key, value in state.get("contexts", {}).items():
            try:
                label = _hashable(json.loads(key))
            except (TypeError, ValueError):
                raise ValueError(f"Not a selector state: context label {key!r} is not the JSON that "
                                 "state_dict() writes.") from None
            contexts[label] = selector_from_state_dict(value)
        if self.selector is not None and state["default"] is not None:
            self.selector.load_state_dict(state["default"])
        self.contexts = contexts

    def save(self, path: str) -> None:
        """Write :meth:`state_dict` as JSON."""
        with open(path, "w") as f:
            json.dump(self.state_dict(), f)

    def load(self, path: str) -> None:
        """Continue from a file written by :meth:`save`."""
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except OSError as error:
            raise ValueError(f"Could not read a selector state from {path!r}: {error}") from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise ValueError(f"{path!r} is not a saved selector state (the JSON file Selection.save writes); "
                             f"reading it failed: {error}") from None
        try:
            self.load_state_dict(state)
        except ValueError as error:
            raise ValueError(f"{path!r} is not a saved selector state of this engine: {error}") from None


def _state_of(selector: Any) -> dict[str, Any] | None:
    state_dict = getattr(selector, "state_dict", None)
    return state_dict() if callable(state_dict) else None


def _hashable(value: Any) -> Hashable:
    """A context label back from JSON: lists (tuples once) become tuples again."""
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
