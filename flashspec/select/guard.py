"""The never-slower guard: a request's steps may draft only while the request stays within
``slack`` of what decoding with the target alone would have taken (SPEC.md §8, "The target-only
arm and the never-slower guard").

The engine makes one :class:`Guard` per request (or per running batch) when it has a target-only
arm. Before each step it asks :meth:`Guard.admit` whether the arm the selector chose may run, and
after each poll it tells :meth:`Guard.observe` what every polled step achieved. The guard never
reads a tensor and never sees the step's random numbers: its choices depend on the past only,
so the output law stays the target's (SPEC.md §8, "Selection never changes the output law").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_SLACK", "GRACE_STEPS", "Guard", "check_slack"]

DEFAULT_SLACK = 0.03  # δ: a request may be up to 3 % slower than the target alone (plus the grace)
GRACE_STEPS = 1  # g: and one target-only step more


def check_slack(slack: Any) -> float | None:
    """``slack`` as a float (a finite number >= 0) or None (no guard), else a ValueError."""
    if slack is None:
        return None
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not math.isfinite(slack) or slack < 0:
        raise ValueError(f"slack is how much slower than the target alone a request may get while the engine "
                         f"explores (0.03 = 3 %): a finite number >= 0, or None for no guard; got {slack!r}.")
    return float(slack)


class Guard:
    """Admits a step's arm only while the request keeps its never-slower budget.

    Args:
        gammas: every arm's draft length (``gammas[baseline] == 0``).
        baseline: the index of the target-only arm.
        slack: δ, the fraction by which a request may be slower than the target alone.
        grace: g, target-only steps of extra allowance (so that a first drafting step can run).
        priors: per arm, the cost of one of its steps in target-only steps, as measured before
            (:meth:`ratios` of an earlier request); an arm without one is assumed to cost
            ``1 + γ/2``.
    """

    def __init__(self, gammas: Sequence[int], baseline: int, slack: float = DEFAULT_SLACK,
                 grace: int = GRACE_STEPS, priors: dict[int, float] | None = None) -> None:
        self.gammas = list(gammas)
        if not 0 <= baseline < len(self.gammas) or self.gammas[baseline] != 0:
            raise ValueError(f"The guard's baseline arm {baseline} must be a target-only arm (γ = 0) of "
                             f"{len(self.gammas)} arm(s).")
        self.baseline = baseline
        self.slack = check_slack(slack)
        if self.slack is None:
            raise ValueError("A guard needs a slack (a number >= 0).")
        self.grace = grace
        self.priors = {a: float(r) for a, r in (priors or {}).items() if 0 <= a < len(self.gammas)}
        self.pending: deque[int] = deque()  # admitted, not yet observed (in step order)
        self.refused = 0  # steps the selector's choice was replaced by the target-only arm
        self._start()

    def _start(self) -> None:
        """An empty budget: nothing observed yet."""
        self.seconds = 0.0  # S: every observed step
        self.tokens = 0  # N
        self.base_seconds = 0.0  # S₀: observed target-only steps
        self.base_tokens = 0  # N₀
        self.base_steps = 0  # n₀
        self.rows = 1  # n̂: tokens of the last observed target-only step (its active rows)
        self.arm_seconds = [0.0] * len(self.gammas)  # per arm: observed seconds, steps
        self.arm_steps = [0] * len(self.gammas)

    def reset(self) -> None:
        """Start a new budget (a running batch whose rows all left: its next requests are new
        work). Steps still pending stay pending."""
        self._start()

    def cost(self, arm: int) -> float:
        """ĉ_a: the estimated seconds of one step of ``arm`` (needs a target-only observation)."""
        if self.arm_steps[arm]:
            return self.arm_seconds[arm] / self.arm_steps[arm]
        prior = self.priors.get(arm, 1 + self.gammas[arm] / 2)
        return prior * self.base_seconds / self.base_steps

    def admit(self, arm: int) -> int:
        """The arm this step runs: ``arm`` when its worst case keeps the budget, else the
        target-only arm (always, until a target-only step has been observed)."""
        if arm != self.baseline:
            if not self.base_steps or not self._affordable(arm):
                self.refused += 1
                arm = self.baseline
        self.pending.append(arm)
        return arm

    def _affordable(self, arm: int) -> bool:
        if not self.arm_steps[arm] and arm in self.pending:
            return False  # an arm never measured runs one step at a time until it is
        spent = self.seconds + sum(self.cost(p) for p in self.pending) + self.cost(arm)
        fewest = self.tokens + (len(self.pending) + 1) * self.rows
        rate = self.base_tokens / self.base_seconds  # r₀
        step = self.base_seconds / self.base_steps  # s₀
        return spent <= (1 + self.slack) * fewest / rate + self.grace * step

    def observe(self, arm: int, tokens: int, seconds: float, rows: int) -> None:
        """A polled step: ``arm`` committed ``tokens`` over ``rows`` active rows in ``seconds``.
        Steps that had no active row (queued after the last one finished) only leave the pending
        list."""
        if self.pending:
            self.pending.popleft()
        if rows == 0:
            return
        self.seconds += seconds
        self.tokens += tokens
        self.arm_seconds[arm] += seconds
        self.arm_steps[arm] += 1
        if arm == self.baseline:
            self.base_seconds += seconds
            self.base_tokens += tokens
            self.base_steps += 1
            self.rows = max(tokens, 1)

    def ratios(self) -> dict[int, float]:
        """Per measured arm, its mean step cost in target-only steps (priors for the next request)."""
        if not self.base_steps:
            return {}
        step = self.base_seconds / self.base_steps
        return {a: self.arm_seconds[a] / self.arm_steps[a] / step for a in range(len(self.gammas))
                if self.arm_steps[a] and a != self.baseline}
