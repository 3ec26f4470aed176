"""Choosing an arm (a (drafter, γ) configuration, mapped by the engine) for each step.

Every selector shares one interface (:class:`Selector`): ``select() -> arm``,
``update(arm, Observation(accepted, proposed, tokens, seconds))``, ``state_dict()`` /
``load_state_dict()`` (JSON values), a lock around all of them, and its own seeded
``random.Random`` (never the engine's token RNG). The math is in SPEC.md §8. An engine's
learning state — its selectors per request context — is one :class:`Selection` (module ``state``).

=====================  ==========================================  ==============
name                   class                                       module
=====================  ==========================================  ==============
``fixed``              :class:`FixedSelector`                      ``fixed``
``ucb1``               :class:`UCB1Selector`                       ``ucb``
``discounted-ucb``     :class:`DiscountedUCBSelector`              ``ucb``
``sliding-window-ucb`` :class:`SlidingWindowUCBSelector`           ``ucb``
``thompson``           :class:`ThompsonSelector`                   ``thompson``
``epsilon-greedy``     :class:`EpsilonGreedySelector`              ``epsilon``
``oracle``             :class:`OracleSelector`                     ``oracle``
``request``            :class:`RequestSelector`                    ``request``
=====================  ==========================================  ==============
"""

from __future__ import annotations

from .base import REWARDS, BaseSelector, Observation, Selector
from .epsilon import EpsilonGreedySelector
from .fixed import FixedSelector, ScriptedSelector
from .oracle import OracleSelector
from .registry import SELECTORS, make_selector, selector_from_state_dict
from .request import RequestSelector
from .state import Selection
from .thompson import ThompsonSelector
from .ucb import DiscountedUCBSelector, SlidingWindowUCBSelector, UCB1Selector

__all__ = [
    "REWARDS",
    "SELECTORS",
    "BaseSelector",
    "DiscountedUCBSelector",
    "EpsilonGreedySelector",
    "FixedSelector",
    "Observation",
    "OracleSelector",
    "RequestSelector",
    "ScriptedSelector",
    "Selection",
    "Selector",
    "SlidingWindowUCBSelector",
    "ThompsonSelector",
    "UCB1Selector",
    "make_selector",
    "selector_from_state_dict",
]
