"""The never-slower guard: a request's steps may draft only while the request stays within
``slack`` of what decoding with the target alone would have taken (SPEC.md §8, "The target-only
arm and the never-slower guard").

The engine makes one :class:`Guard` per request (or per running batch) when it has a target-only
arm. Before each step :meth:`Guard.choose` asks the selector for an arm and admits it, or asks
again, or runs the target alone; after each poll :meth:`Guard.observe` learns what every polled
step achieved. A step whose drafter must first catch up on tokens it missed (its first
proposal of a request feeds the prompt; after a gap it re-feeds what the other arms committed)
is priced with that catch-up. The guard never reads a tensor and never sees the step's random
numbers: its choices depend on the past only, so the output law stays the target's (SPEC.md §8,
"Selection never changes the output law").
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

__all__ = ["DEFAULT_SLACK", "GRACE_STEPS", "KEPT_REQUESTS", "OUTLIER", "RETRIES", "YIELD_PRIOR_STEPS", "YIELD_WINDOW",
           "CostMemory", "Guard", "bucket", "check_slack"]

DEFAULT_SLACK = 0.01  # δ: a request may be up to 1 % slower than the target alone (plus the grace; SPEC.md §8)
GRACE_STEPS = 1  # g: and one target-only step more
RETRIES = 2  # a refused choice: ask the selector this many more times before running the target alone
KEPT_REQUESTS = 4  # K: a cost carried over is the median of the last K requests that measured it
OUTLIER = 4.0  # a drafting step that cost more than this many times its estimate is a stall, not a throughput
YIELD_WINDOW = 16  # W: an arm's admitted steps count at the mean tokens per row of its last W steps ...
YIELD_PRIOR_STEPS = 2  # k: ... drawn towards one token per row (its fewest) as if k such steps came first


def check_slack(slack: Any) -> float | None:
    """``slack`` as a float (a finite number >= 0) or None (no guard), else a ValueError."""
    if slack is None:
        return None
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not math.isfinite(slack) or slack < 0:
        raise ValueError(f"slack is how much slower than the target alone a request may get while the engine "
                         f"explores (0.02 = 2 %): a finite number >= 0, or None for no guard; got {slack!r}.")
    return float(slack)


def bucket(width: int) -> int:
    """The catch-up width class of ``width``: the power of two at or above it."""
    return 1 << (max(int(width), 1) - 1).bit_length()


class Guard:
    """Admits a step's arm only while the request keeps its never-slower budget.

    Args:
        gammas: every arm's draft length (``gammas[baseline] == 0``).
        baseline: the index of the target-only arm.
        slack: δ, the fraction by which a request may be slower than the target alone.
        grace: g, target-only steps of extra allowance (so that a first drafting step can run).
        priors: per arm, the cost of one of its steady steps in target-only steps, as measured
            before (:meth:`ratios` of an earlier request); an arm without one is assumed to
            cost ``1 + γ/2``.
        arm_drafters: per arm, the index of its drafter (None: the target-only arm); arms of
            one drafter share its catch-up costs. Default: one drafter per arm.
        catch_up_priors: per ``(drafter, bucket)``, what a catch-up of that width class cost
            beyond the arm's steady step, in target-only steps (:meth:`catch_up_ratios` of an
            earlier request, or a calibration's).
        layer_ratios: per drafter, λ: the layers its catch-up runs over the target's (1 when
            not given); the prior of a catch-up never measured is λ times the target's prefill.
    """

    def __init__(self, gammas: Sequence[int], baseline: int, slack: float = DEFAULT_SLACK,
                 grace: int = GRACE_STEPS, priors: dict[int, float] | None = None,
                 arm_drafters: Sequence[int | None] | None = None,
                 catch_up_priors: dict[tuple[int, int], float] | None = None,
                 layer_ratios: dict[int, float] | None = None) -> None:
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
        if arm_drafters is None:
            arm_drafters = [None if a == baseline else a for a in range(len(self.gammas))]
        self.arm_drafters = list(arm_drafters)
        self.catch_up_priors = {k: float(v) for k, v in (catch_up_priors or {}).items()}
        self.layer_ratios = dict(layer_ratios or {})
        self.pending: deque[tuple[int, int]] = deque()  # (arm, catch-up width) admitted, not yet observed
        self.refused = 0  # steps the selector's choice was replaced by the target-only arm
        self.held = 0  # steps run target-only without asking the selector: no drafting arm fit the budget
        # The target's last prefill (T_p seconds over L_p tokens per row): the scale of the prior
        # of a catch-up never measured. None until the engine reports one.
        self.prefill_seconds: float | None = None
        self.prefill_tokens = 1
        self._start()

    def _start(self) -> None:
        """An empty budget: nothing observed yet."""
        self.seconds = 0.0  # S: every observed step
        self.tokens = 0  # N
        self.base_seconds = 0.0  # S₀: observed target-only steps
        self.base_tokens = 0  # N₀
        self.base_steps = 0  # n₀
        self.rows = 1  # n̂: tokens of the last observed target-only step (its active rows)
        self.arm_seconds = [0.0] * len(self.gammas)  # per arm: observed seconds, steps (steady steps)
        self.arm_steps = [0] * len(self.gammas)
        self.arm_samples: list[list[float]] = [[] for _ in self.gammas]  # per arm: its steady steps' seconds, sorted
        self.arm_medians = [0.0] * len(self.gammas)  # per arm: their median (ĉ_a once measured)
        self.arm_yields: list[deque[float]] = [deque(maxlen=YIELD_WINDOW) for _ in self.gammas]  # tokens per row
        self.catch_ups: dict[tuple[int, int], float] = {}  # (drafter, bucket): the last catch-up's extra seconds
        self.refused_arms: set[int] = set()  # arms refused in this budget (every drafting arm when held)

    def reset(self) -> None:
        """Start a new budget (a running batch whose rows all left: its next requests are new
        work). Steps still pending stay pending; what catch-ups cost is kept."""
        seen = self.catch_ups
        self._start()
        self.catch_ups = seen

    def prefill(self, seconds: float, tokens: int) -> None:
        """The target's prefill of ``tokens`` positions per row took ``seconds``: the scale of the
        prior of a catch-up never measured."""
        self.prefill_seconds, self.prefill_tokens = float(seconds), max(int(tokens), 1)

    # ------------------------------------------------------------------ estimates
    def _step(self) -> float:
        """s₀: the mean seconds of an observed target-only step."""
        return self.base_seconds / self.base_steps

    def cost(self, arm: int) -> float:
        """ĉ_a: the estimated seconds of one steady step of ``arm``, the median of its observed
        steady steps (one slow step does not make an arm look slow); before one, its prior
        (needs a target-only observation)."""
        if self.arm_steps[arm]:
            return self.arm_medians[arm]
        prior = self.priors.get(arm, 1 + self.gammas[arm] / 2)
        return prior * self._step()

    def tokens_per_row(self, arm: int) -> float:
        """ŷ_a: the tokens per active row an admitted step of ``arm`` is counted at: 1 (the fewest)
        for the target-only arm and an arm not observed in this request, else the mean of its
        last :data:`YIELD_WINDOW` observed steps drawn towards 1 by :data:`YIELD_PRIOR_STEPS`."""
        yields = self.arm_yields[arm]
        if arm == self.baseline or not yields:
            return 1.0
        return (sum(yields) + YIELD_PRIOR_STEPS) / (len(yields) + YIELD_PRIOR_STEPS)

    def _net(self, arm: int, width: int = 0) -> float:
        """What a step of ``arm`` adds to the budget's left side net of the target-only time its
        counted tokens buy: ĉ_a + x̂ − (1 + δ) n̂ ŷ_a / r₀."""
        rate = self.base_tokens / self.base_seconds  # r₀
        return (self.cost(arm) + self.catch_up_cost(arm, width)
                - (1 + self.slack) * self.rows * self.tokens_per_row(arm) / rate)

    def catch_up_cost(self, arm: int, width: int) -> float:
        """x̂: the estimated seconds a catch-up of ``width`` positions adds to a step of ``arm``:
        the last measured catch-up of this drafter in the same width class (scaled up to the
        class's top), else in the nearest wider class, else the widest narrower one scaled by
        the widths, else λ times the target's prefill at this width (infinite before a prefill
        was reported). SPEC.md §8, "Catch-ups"."""
        if not width or arm == self.baseline:
            return 0.0
        drafter, b = self.arm_drafters[arm], bucket(width)
        step = self._step()
        known = {k: r * step for (d, k), r in self.catch_up_priors.items() if d == drafter}
        known.update({k: s for (d, k), s in self.catch_ups.items() if d == drafter})
        wider = [k for k in known if k >= b]
        if wider:
            return known[min(wider)]
        if known:
            widest = max(known)
            return known[widest] * b / widest
        if self.prefill_seconds is None:
            return math.inf
        ratio = self.layer_ratios.get(drafter, 1.0)
        return ratio * max(self.prefill_seconds, b * self.prefill_seconds / self.prefill_tokens)

    # ------------------------------------------------------------------ choosing
    def choose(self, select: Callable[[], int], catch_up: Callable[[int], int],
               rank: Callable[[], Sequence[int]] | None = None) -> tuple[int, int]:
        """The arm this step runs and its catch-up width: the selector's choice (``select()``)
        when its worst case keeps the budget; else the selector is asked again, up to
        :data:`RETRIES` times — or, given ``rank`` (a deterministic selector's order of
        preference), the first affordable arm of ``rank()``; else the target-only arm (always,
        until a target-only step has been observed). ``catch_up(arm)``: the width the arm's
        drafter must catch up on first."""
        room = self._room() if self.base_steps else None
        if room is not None and room < self._cheapest():
            # Not even the cheapest drafting step fits the budget: run the target alone without
            # asking the selector, whose draws cost host time on every step while the budget is spent.
            self.held += 1
            self.refused_arms.update(a for a in range(len(self.gammas)) if a != self.baseline)
            self.pending.append((self.baseline, 0))
            return self.baseline, 0
        return self._choose(select, catch_up, room, rank)

    def _choose(self, select: Callable[[], int], catch_up: Callable[[int], int],
                room: float | None, rank: Callable[[], Sequence[int]] | None = None) -> tuple[int, int]:
        """:meth:`choose` after its short cut; ``room``: :meth:`_room` (None: no target-only step yet)."""
        first = arm = select()
        width = 0
        if arm != self.baseline:
            if room is None:
                arm = self.baseline
            else:
                # Asking again: a sampler's next draws, or the rest of a deterministic ranking.
                later = None
                for attempt in range(RETRIES + 1 if rank is None else len(self.gammas)):
                    if attempt and rank is None:
                        arm = select()
                    elif attempt:
                        later = later or iter([a for a in rank() if a != first])
                        arm = next(later, self.baseline)
                    if arm == self.baseline:
                        break
                    width = catch_up(arm)
                    if self._affordable(arm, width, room):
                        break
                else:
                    arm = self.baseline
        if arm == self.baseline:
            width = 0
            if first != self.baseline:
                self.refused += 1
                self.refused_arms.add(first)
        self.pending.append((arm, width))
        return arm, width

    def admit(self, arm: int, width: int = 0) -> int:
        """One given choice (no asking again): ``arm`` if its worst case keeps the budget, else
        the target-only arm."""
        return self._choose(lambda: arm, lambda a: width, self._room() if self.base_steps else None)[0]

    def _room(self) -> float:
        """What one more step may add net of its counted tokens (:meth:`_net`) within the budget
        (needs a target-only observation): (1 + δ) N / r₀ + g s₀ − S − Σ_{p ∈ P} net_p."""
        rate = self.base_tokens / self.base_seconds  # r₀
        committed = self.seconds + sum(self._net(p, w) for p, w in self.pending)
        return (1 + self.slack) * self.tokens / rate + self.grace * self._step() - committed

    def _cheapest(self) -> float:
        """The cheapest drafting arm's steady step net of its counted tokens (no catch-up): what
        every admitted choice adds at least, compared with :meth:`_room` before the selector is asked."""
        return min((self._net(a) for a in range(len(self.gammas)) if a != self.baseline), default=math.inf)

    def _affordable(self, arm: int, width: int, room: float) -> bool:
        if not self.arm_steps[arm] and any(p == arm for p, _ in self.pending):
            return False  # an arm never measured runs one step at a time until it is
        if width and any(w and self.arm_drafters[p] == self.arm_drafters[arm] for p, w in self.pending):
            return False  # likewise a catch-up: one at a time per drafter
        return self._net(arm, width) <= room

    # ------------------------------------------------------------------ learning
    def observe(self, arm: int, tokens: int, seconds: float, rows: int, catch_up: int = 0,
                cold: bool = False) -> bool:
        """A polled step: ``arm`` committed ``tokens`` over ``rows`` active rows in ``seconds``,
        after a catch-up of ``catch_up`` positions (0: a steady step). Steps that had no active
        row (queued after the last one finished) and cold steps (they compiled code or captured
        a graph: a one-off cost, SPEC.md §8 "Steady costs only") only leave the pending list.
        Returns whether the selector should learn from the step: not when it was cold, and not
        when a drafting step cost more than :data:`OUTLIER` times what the guard expected of it
        (a stall, not the arm's throughput; the guard's own budget and estimates still count it)."""
        if self.pending:
            self.pending.popleft()
        if rows == 0 or cold:
            return False
        typical = True
        if arm != self.baseline and self.base_steps:
            typical = seconds <= OUTLIER * (self.cost(arm) + self.catch_up_cost(arm, catch_up))
        if catch_up and arm != self.baseline and self.base_steps:
            extra = max(0.0, seconds - self.cost(arm))  # what the catch-up added to a steady step
            b = bucket(catch_up)
            self.catch_ups[(self.arm_drafters[arm], b)] = extra * b / catch_up
        else:
            self.arm_seconds[arm] += seconds
            self.arm_steps[arm] += 1
            samples = self.arm_samples[arm]
            bisect.insort(samples, seconds)
            middle = len(samples) // 2
            self.arm_medians[arm] = samples[middle] if len(samples) % 2 else (samples[middle - 1] + samples[middle]) / 2
        self.seconds += seconds
        self.tokens += tokens
        self.arm_yields[arm].append(tokens / rows)
        if arm == self.baseline:
            self.base_seconds += seconds
            self.base_tokens += tokens
            self.base_steps += 1
            self.rows = max(tokens, 1)
        return typical

    def ratios(self) -> dict[int, float]:
        """Per measured arm, its median steady step cost in target-only steps (priors for the
        next request, :class:`CostMemory`)."""
        if not self.base_steps:
            return {}
        step = self._step()
        return {a: self.arm_medians[a] / step for a in range(len(self.gammas))
                if self.arm_steps[a] and a != self.baseline}

    def catch_up_ratios(self) -> dict[tuple[int, int], float]:
        """Per ``(drafter, bucket)`` measured, the last catch-up's extra cost in target-only steps
        (priors for the next request)."""
        if not self.base_steps:
            return {}
        step = self._step()
        return {k: s / step for k, s in self.catch_ups.items()}


class CostMemory:
    """What the guards of earlier requests measured, carried to the next request's guard as its
    priors (SPEC.md §8, "What carries over"), in target-only steps: per arm its steady step
    (:meth:`Guard.ratios`) and per ``(drafter, width class)`` its catch-up
    (:meth:`Guard.catch_up_ratios`).

    Each estimate is the median of the last :data:`KEPT_REQUESTS` requests that measured it, so
    one request measured on a busy machine does not decide the next ones. A request whose guard
    refused an arm (the selector chose it, or no drafting arm fit the budget) without measuring
    it drops its oldest measurement, and its drafter's catch-ups likewise: an arm the guard keeps
    refusing returns to its starting prior — the seed (a calibration's measurement) or the
    guard's own cautious prior — and is tried again. Seeds never age."""

    def __init__(self, kept: int = KEPT_REQUESTS) -> None:
        self.kept = kept
        self._arms: dict[int, deque[float]] = {}
        self._catch_ups: dict[tuple[int, int], deque[float]] = {}
        self._arm_seeds: dict[int, float] = {}
        self._catch_up_seeds: dict[tuple[int, int], float] = {}

    @property
    def arm_costs(self) -> Mapping[int, float]:
        """Per arm, its carried steady step cost (read-only: seed with :meth:`seed_arm`)."""
        return MappingProxyType(self._estimates(self._arms, self._arm_seeds))

    @property
    def catch_up_costs(self) -> Mapping[tuple[int, int], float]:
        """Per ``(drafter, width class)``, its carried catch-up cost beyond a steady step."""
        return MappingProxyType(self._estimates(self._catch_ups, self._catch_up_seeds))

    def seed_arm(self, arm: int, ratio: float) -> None:
        """A measured steady step cost of ``arm`` (a calibration's), used while no request has."""
        self._arm_seeds[arm] = float(ratio)

    def seed_catch_up(self, key: tuple[int, int], ratio: float) -> None:
        """A measured catch-up cost of ``(drafter, width class)``, used while no request has."""
        self._catch_up_seeds[key] = float(ratio)

    def learn(self, guard: Guard) -> None:
        """What ``guard`` measured over its request (nothing when it ran no target-only step)."""
        if not guard.base_steps:
            return
        refused = guard.refused_arms - {guard.baseline}
        drafters = {guard.arm_drafters[a] for a in refused}
        self._learn(self._arms, guard.ratios(), sorted(refused))
        self._learn(self._catch_ups, guard.catch_up_ratios(), [k for k in self._catch_ups if k[0] in drafters])

    def _learn(self, history: dict[Any, deque[float]], measured: dict[Any, float], known: list[Any]) -> None:
        for key, ratio in measured.items():
            history.setdefault(key, deque(maxlen=self.kept)).append(ratio)
        for key in known:
            if key not in measured and history.get(key):
                history[key].popleft()  # not measured this time: its oldest measurement ages out
                if not history[key]:
                    del history[key]

    @staticmethod
    def _estimates(history: dict[Any, deque[float]], seeds: dict[Any, float]) -> dict[Any, float]:
        out = dict(seeds)
        out.update({key: statistics.median(values) for key, values in history.items() if values})
        return out
