"""The request selector: each request's own best arm, with its context's past as a prior
(SPEC.md §8, "The algorithms", request).

Per arm: the expected tokens a step — this request's own mean, shrunk toward what the earlier
requests of its context saw with a weight of ``prior_steps`` steps — over the arm's mean
seconds a step, times an upper-confidence factor. Why per request: an arm's throughput
varies far more between prompts (n-gram pays 2.8x the target alone on a prompt that repeats
itself and nothing on one that does not) than between the steps of one prompt, so a
posterior per context keeps choosing an arm where it loses because it pays elsewhere.
Deterministic but for exact ties: :meth:`rank` is the whole order of preference, which the
never-slower guard walks when it cannot afford the first choice (SPEC.md §8, "Asking again").
"""

from __future__ import annotations

import math
from typing import Any

from .base import BaseSelector, _count, _real, positive

__all__ = ["RequestSelector"]

DEFAULT_PRIOR_STEPS = 4.0  # w: the context's mean weighs as much as this many of the request's own steps
DEFAULT_BONUS = 0.3  # b: the confidence factor 1 + b sqrt(ln(n + 2) / (w + n_i))


class RequestSelector(BaseSelector):
    """Per-request estimates with the context's past as a prior. Options: ``prior_steps``
    (w > 0, default 4), ``bonus`` (b >= 0, default 0.3); ``reward`` must be ``"throughput"``."""

    kind = "request"

    def __init__(self, num_arms: int, *, prior_steps: float = DEFAULT_PRIOR_STEPS, bonus: float = DEFAULT_BONUS,
                 **options: Any) -> None:
        super().__init__(num_arms, **options)
        if self.reward != "throughput":
            raise ValueError("The request selector compares arms by tokens per second: it needs "
                             "reward='throughput'.")
        self.prior_steps = positive(prior_steps, "prior_steps")
        self.bonus = _real(bonus, "bonus")
        if self.bonus < 0:
            raise ValueError(f"bonus must be >= 0, got {self.bonus}.")
        n = self.num_arms
        self.context_steps = [0] * n  # N_i: steps of the arm in the context's earlier requests
        self.context_tokens = [0] * n  # D_i: their tokens
        self.steps = [0] * n  # n_i: this request's steps of the arm
        self.tokens = [0] * n  # T_i: their tokens
        self.seconds = [0.0] * n  # every step's seconds (N_i + n_i of them), for the mean

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "prior_steps": self.prior_steps, "bonus": self.bonus}

    # -- requests ------------------------------------------------------------------------

    def begin_request(self) -> None:
        """A new request begins: fold the last one's steps into the context's."""
        with self._lock:
            for i in range(self.num_arms):
                self.context_steps[i] += self.steps[i]
                self.context_tokens[i] += self.tokens[i]
            self.steps = [0] * self.num_arms
            self.tokens = [0] * self.num_arms

    # -- values --------------------------------------------------------------------------

    def values(self) -> list[float]:
        """Every arm's value (expected tokens per second times the confidence factor); an arm
        never observed: infinity."""
        with self._lock:
            return self._values()

    def _values(self) -> list[float]:
        w, n = self.prior_steps, sum(self.steps)
        out = []
        for i in range(self.num_arms):
            own, past = self.steps[i], self.context_steps[i]
            if not (own or past):
                out.append(math.inf)
                continue
            if past:
                mean = (w * self.context_tokens[i] / past + self.tokens[i]) / (w + own)
            else:
                mean = self.tokens[i] / own
            confidence = 1 + self.bonus * math.sqrt(math.log(n + 2) / (w + own))
            out.append(mean / (self.seconds[i] / (own + past)) * confidence)
        return out

    def rank(self) -> list[int]:
        """The arms from the most to the least valuable (exact ties in the selector's RNG's
        order; arms never observed first, the least often selected of them first)."""
        with self._lock:
            return self._rank()

    def _rank(self) -> list[int]:
        values = self._values()
        keys = {i: self._rng.random() for i in range(self.num_arms)}
        return sorted(range(self.num_arms),
                      key=lambda i: (-values[i], self.selections[i] if values[i] == math.inf else 0, keys[i]))

    def _select(self) -> int:
        return self._rank()[0]

    def _update(self, arm: int, obs, reward: float) -> None:
        self.steps[arm] += 1
        self.tokens[arm] += obs.tokens
        self.seconds[arm] += obs.seconds

    # -- state ---------------------------------------------------------------------------

    NAMES = ("context_steps", "context_tokens", "steps", "tokens", "seconds")

    def _get_stats(self) -> dict[str, Any]:
        return {name: list(getattr(self, name)) for name in self.NAMES}

    def _set_stats(self, stats: dict[str, Any]) -> None:
        values = {name: [(_real if name == "seconds" else _count)(v, name) for v in stats[name]]
                  for name in self.NAMES}
        if any(len(v) != self.num_arms for v in values.values()) or min(values["seconds"], default=0) < 0:
            raise ValueError("malformed selector state: per-arm statistics of the wrong length or sign.")
        for name, v in values.items():
            setattr(self, name, v)
