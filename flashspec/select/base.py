"""What every selector shares: the observation, the reward, validation, the lock, the RNG
and the state dictionary. The algorithms live in one small module each (SPEC.md, §bandits)."""

from __future__ import annotations

import json
import math
import operator
import random
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

__all__ = ["Observation", "Selector", "BaseSelector", "REWARDS"]

REWARDS = ("throughput", "acceptance")
STATE_FORMAT = 1


def _count(value: Any, name: str) -> int:
    """A non-negative integer (Python or numpy), else a ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}.") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}.")
    return value


def _real(value: Any, name: str) -> float:
    """A finite real number, else a ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")
    return value


def positive(value: Any, name: str) -> float:
    value = _real(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}.")
    return value


@dataclass(frozen=True)
class Observation:
    """What one step with the chosen arm achieved.

    accepted: drafts accepted in the step (summed over rows);
    proposed: drafts proposed (``γ × active rows``); ``accepted <= proposed``;
    tokens: tokens emitted (committed) in the step;
    seconds: the step's wall time, ``> 0``.
    """

    accepted: int
    proposed: int
    tokens: int
    seconds: float

    def __post_init__(self) -> None:
        accepted = _count(self.accepted, "accepted")
        proposed = _count(self.proposed, "proposed")
        if accepted > proposed:
            raise ValueError(f"accepted ({accepted}) cannot exceed proposed ({proposed}).")
        tokens = _count(self.tokens, "tokens")
        seconds = positive(self.seconds, "seconds")
        object.__setattr__(self, "accepted", accepted)
        object.__setattr__(self, "proposed", proposed)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "seconds", seconds)

    @property
    def acceptance(self) -> float:
        """``accepted / proposed`` (a ValueError when nothing was proposed)."""
        if self.proposed == 0:
            raise ValueError("reward='acceptance' needs proposed >= 1 (nothing was proposed in this step).")
        return self.accepted / self.proposed

    @property
    def throughput(self) -> float:
        """Tokens per second of step time."""
        return self.tokens / self.seconds


@runtime_checkable
class Selector(Protocol):
    """Chooses an arm (an index into the engine's list of (drafter, γ) configurations) for
    each step. The choice may depend on the past only (SPEC.md: then the output law is the
    target's whatever is chosen)."""

    def select(self) -> int:
        """The arm for the next step."""

    def update(self, arm: int, observation: Observation) -> None:
        """What ``arm`` achieved in a step it was chosen for."""


class BaseSelector:
    """Common machinery. Subclasses implement ``_select``, ``_update`` and the state hooks.

    Args:
        num_arms: how many arms (``>= 1``).
        reward: ``"throughput"`` (tokens / seconds, the default) or ``"acceptance"``
            (accepted / proposed).
        scale: throughput only: the normaliser used by algorithms that need rewards in
            ``[0, 1]`` is ``M = max(scale, largest throughput seen so far)``; ``None`` means
            the running maximum alone.
        seed: seeds the selector's own ``random.Random`` (ties, exploration, posterior draws).
    """

    kind: ClassVar[str] = "base"
    uses_reward: ClassVar[bool] = True

    def __init__(
        self, num_arms: int, *, reward: str = "throughput", scale: float | None = None, seed: int | None = None
    ) -> None:
        if isinstance(num_arms, bool):
            raise ValueError(f"num_arms must be an integer >= 1, got {num_arms!r}.")
        try:
            num_arms = operator.index(num_arms)
        except TypeError:
            raise ValueError(f"num_arms must be an integer >= 1, got {num_arms!r}.") from None
        if num_arms < 1:
            raise ValueError(f"num_arms must be >= 1, got {num_arms}.")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}.")
        if scale is not None:
            scale = positive(scale, "scale")
        if seed is not None:
            if isinstance(seed, bool):
                raise ValueError(f"seed must be an integer or None, got {seed!r}.")
            try:
                seed = operator.index(seed)
            except TypeError:
                raise ValueError(f"seed must be an integer or None, got {seed!r}.") from None
        self.num_arms = num_arms
        self.reward = reward
        self.scale = scale
        self.seed = seed
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self.pulls = [0] * num_arms  # lifetime updates per arm (diagnostics)
        self.selections = [0] * num_arms  # lifetime select() results per arm
        self._max_reward = 0.0  # largest raw throughput seen (the running maximum)

    # -- the interface ---------------------------------------------------------------------

    def select(self) -> int:
        """The arm for the next step."""
        with self._lock:
            arm = self._select()
            self.selections[arm] += 1
            return arm

    def begin_request(self) -> None:
        """A new request begins (``Selection.for_request`` calls this): a no-op for selectors
        that learn across requests alike; the request selector folds the last one in."""

    def update(self, arm: int, observation: Observation) -> None:
        """Record what ``arm`` achieved in one step."""
        arm = self._check_arm(arm)
        if not isinstance(observation, Observation):
            raise ValueError(f"update needs an Observation, got {observation!r}.")
        obs = observation
        reward = self._reward(obs) if self.uses_reward else 0.0  # validate before any change
        with self._lock:
            if self.uses_reward and self.reward == "throughput" and reward > self._max_reward:
                self._max_reward = reward
            self.pulls[arm] += 1
            self._update(arm, obs, reward)

    @property
    def total_updates(self) -> int:
        with self._lock:
            return sum(self.pulls)

    # -- rewards -----------------------------------------------------------------------

    def _reward(self, obs: Observation) -> float:
        """The raw reward: tokens per second, or the fraction of drafts accepted."""
        return obs.acceptance if self.reward == "acceptance" else obs.throughput

    @property
    def normaliser(self) -> float:
        """``M`` with ``reward / M`` in ``[0, 1]``: 1 for acceptance; for throughput
        ``max(scale, running maximum)`` (1 while nothing positive has been seen)."""
        if self.reward == "acceptance":
            return 1.0
        m = max(self.scale or 0.0, self._max_reward)
        return m if m > 0 else 1.0

    # -- helpers for subclasses ----------------------------------------------------------

    def _check_arm(self, arm: Any) -> int:
        if isinstance(arm, bool):
            raise ValueError(f"arm must be an integer index, got {arm!r}.")
        try:
            arm = operator.index(arm)
        except TypeError:
            raise ValueError(f"arm must be an integer index, got {arm!r}.") from None
        if not 0 <= arm < self.num_arms:
            raise ValueError(f"arm {arm} is out of range for {self.num_arms} arm(s).")
        return arm

    def _unobserved(self, counts: Sequence[float]) -> int | None:
        """An arm without observations, if any: the one selected least often so far, the
        lowest index among those (a round robin that also works when updates lag)."""
        best = None
        for i, n in enumerate(counts):
            if n == 0 and (best is None or self.selections[i] < self.selections[best]):
                best = i
        return best

    def _argmax(self, values: Sequence[float]) -> int:
        """Index of the largest value; exact ties broken by the selector's RNG."""
        top = max(values)
        ties = [i for i, v in enumerate(values) if v == top]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    # -- state ---------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        """Constructor options (JSON values) that define the algorithm."""
        return {"reward": self.reward, "scale": self.scale, "seed": self.seed}

    def _get_stats(self) -> dict[str, Any]:
        return {}

    def _set_stats(self, stats: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (JSON-serialisable): configuration,
        statistics and the RNG state (so a restored selector makes the same future choices)."""
        with self._lock:
            version, internal, gauss_next = self._rng.getstate()
            return {
                "kind": self.kind,
                "format": STATE_FORMAT,
                "num_arms": self.num_arms,
                "config": json.loads(json.dumps(self._config())),
                "counters": {
                    "pulls": list(self.pulls),
                    "selections": list(self.selections),
                    "max_reward": self._max_reward,
                },
                "stats": json.loads(json.dumps(self._get_stats())),
                "rng": [version, list(internal), gauss_next],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of a selector of the same kind, number of arms and
        configuration. The seed may differ: the RNG state itself is restored (and the seed
        recorded in ``state`` is adopted), so the future choices are those the saved selector
        would have made."""
        if not isinstance(state, dict):
            raise ValueError("state must be a dict from state_dict().")
        if state.get("kind") != self.kind:
            raise ValueError(f"state is for selector {state.get('kind')!r}, this one is {self.kind!r}.")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown state format {state.get('format')!r} (expected {STATE_FORMAT}).")
        if state.get("num_arms") != self.num_arms:
            raise ValueError(f"state has {state.get('num_arms')} arms, this selector {self.num_arms}.")
        mine = json.loads(json.dumps(self._config()))
        theirs = dict(state.get("config", {}))
        mine.pop("seed", None)
        seed = theirs.pop("seed", None)
        if mine != theirs:
            raise ValueError(f"state configuration {theirs} differs from this selector's {mine}.")
        try:
            counters = state["counters"]
            pulls = [_count(v, "pulls") for v in counters["pulls"]]
            selections = [_count(v, "selections") for v in counters["selections"]]
            max_reward = _real(counters["max_reward"], "max_reward")
            version, internal, gauss_next = state["rng"]
            rng = random.Random()
            rng.setstate((version, tuple(int(v) for v in internal), gauss_next))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed selector state: {exc!r}.") from None
        if len(pulls) != self.num_arms or len(selections) != self.num_arms:
            raise ValueError("malformed selector state: per-arm counters of the wrong length.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"malformed selector state: seed {seed!r}.")
        with self._lock:
            try:
                self._set_stats(state.get("stats", {}))  # validates everything before assigning
            except (KeyError, TypeError, IndexError) as exc:
                raise ValueError(f"malformed selector state: {exc!r}.") from None
            self.pulls, self.selections, self._max_reward = pulls, selections, max_reward
            self._rng = rng
            self.seed = seed  # the stream continued is the one that seed started

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "BaseSelector":
        """A new selector continuing from ``state``."""
        obj = cls(state["num_arms"], **cls._options_from_state(state))
        obj.load_state_dict(state)
        return obj

    @classmethod
    def _options_from_state(cls, state: dict[str, Any]) -> dict[str, Any]:
        return dict(state.get("config", {}))

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}(num_arms={self.num_arms}, {options})"

    # -- to implement ----------------------------------------------------------------------

    def _select(self) -> int:  # called under the lock
        raise NotImplementedError

    def _update(self, arm: int, obs: Observation, reward: float) -> None:  # under the lock
        raise NotImplementedError
