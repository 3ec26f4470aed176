"""The learning-rate schedule of drafter training, over one run or several (SPEC.md §11.3).

A linear warm-up over the first 1/:data:`WARMUP` of the schedule, then a cosine down to
:data:`FLOOR` of the peak. A schedule may span several runs (``train-drafter --total-steps N``,
then ``--resume DIR`` in later runs): each run covers its own slice of it, and the checkpoint
records where the slice ended, so that runs in separate sessions add up to one schedule instead
of warming up and annealing each time. A resumed run starts with fresh optimizer moments, so its
first :data:`REWARM` steps ramp the rates up from near zero to the schedule's value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import check_int

__all__ = ["FLOOR", "REWARM", "WARMUP", "Schedule"]

WARMUP = 20  # the learning rates rise linearly over the first 1/20 of the schedule
FLOOR = 0.1  # then fall on a cosine to this fraction of their peak
REWARM = 50  # a resumed run's first steps: the rates ramp up while Adam's moments fill again


@dataclass(frozen=True)
class Schedule:
    """One run's slice of a schedule of ``total`` steps: ``steps`` of them, after ``start`` done
    by earlier runs. ``max_seconds``: the run ends on the clock if that comes first, its slice
    then followed by elapsed time (a time-capped run still ends its slice annealed)."""

    total: int
    steps: int
    start: int = 0
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        check_int("total steps", self.total, 1)
        check_int("steps", self.steps, 1)
        check_int("start", self.start, 0)
        if self.start >= self.total:
            raise ValueError(f"The schedule of {self.total} steps is complete ({self.start} done): give a larger "
                             "total (--total-steps) to train further.")

    def run_progress(self, step: int, elapsed: float) -> float:
        """The share of this run's slice done after ``step`` steps and ``elapsed`` seconds."""
        progress = step / self.steps
        if self.max_seconds is not None:
            progress = max(progress, elapsed / self.max_seconds)
        return min(1.0, progress)

    def position(self, step: int, elapsed: float) -> float:
        """Where the whole schedule stands, in steps."""
        return self.start + self.run_progress(step, elapsed) * self.steps

    def fraction(self, step: int, elapsed: float) -> float:
        """The learning rates' fraction of their peak for the step after ``step`` steps."""
        progress = min(1.0, self.position(step, elapsed) / self.total)
        warm = 1 / WARMUP
        if progress < warm:
            value = max(progress, 1 / self.total) / warm
        else:
            done = (progress - warm) / (1 - warm)
            value = FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * done))
        if self.start and step < REWARM:
            value *= (step + 1) / REWARM
        return value

    def record(self, step: int, elapsed: float) -> dict[str, float | int]:
        """What a checkpoint keeps of it: the total and where this run left it."""
        return {"total_steps": self.total, "position": round(self.position(step, elapsed))}
