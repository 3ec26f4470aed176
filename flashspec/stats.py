"""What a ``generate`` call returns: the new tokens, their text and what the decode did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DrafterStats", "StepRecord", "GenerationStats", "GenerationOutput"]


@dataclass
class DrafterStats:
    """Steps a drafter (or an arm) was chosen for, and its drafts proposed and accepted."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass
class StepRecord:
    """One decode step as the lagged poll saw it (what per-step latency and arm plots need)."""

    arm: str | None  # "drafter@γ"; None for a target-only step
    accepted: int  # drafts accepted, summed over rows
    rows: int  # rows still generating
    committed: int  # tokens committed, summed over rows
    seconds: float  # host clock on the CPU, CUDA events on a GPU
    cold: bool = False  # it compiled code or captured a CUDA graph: a one-off cost (SPEC.md §8)


@dataclass
class GenerationStats:
    """What one ``generate`` call did. Times are wall-clock seconds on the host."""

    new_tokens: int = 0
    steps: int = 0
    row_steps: int = 0  # sum over steps of the rows still generating
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    forward_seconds: float = 0.0  # time inside model forwards (target and drafters), decode steps
    decode_seconds: float = 0.0  # time of the decode steps, prefill excluded
    decode_tokens: int = 0  # tokens committed by decode steps (the prefill's first token excluded)
    per_drafter: dict[str, DrafterStats] = field(default_factory=dict)
    per_arm: dict[str, DrafterStats] = field(default_factory=dict)  # "drafter@γ"
    selector_seconds: float = 0.0  # host time in select() and update() (and the guard's admit())
    cold_steps: int = 0  # steps that compiled code or captured a CUDA graph (none once the engine is warm)
    guard_refused: int = 0  # steps the never-slower guard ran target-only instead of a chosen (or choosable) arm (SPEC §8)
    step_log: list[StepRecord] = field(default_factory=list)  # one per decode step, in order

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens a row gains per decode step (accepted drafts + the target's token)."""
        return self.decode_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of the whole call (prefill included)."""
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def overhead_fraction(self) -> float:
        """Share of decode-step time spent outside model forwards (engine overhead). Measured
        with host clocks: meaningful on the CPU; on CUDA forwards return at launch."""
        return 1.0 - self.forward_seconds / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_tokens_per_step": self.mean_tokens_per_step,
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "overhead_fraction": self.overhead_fraction,
            "per_drafter": {k: vars(v) for k, v in self.per_drafter.items()},
            "per_arm": {k: vars(v) for k, v in self.per_arm.items()},
            "selector_seconds": self.selector_seconds,
            "guard_refused": self.guard_refused,
            "cold_steps": self.cold_steps,
        }


@dataclass
class GenerationOutput:
    """The result of ``generate``."""

    sequences: list[list[int]]  # new tokens per row, ending with EOS when it was produced
    stats: GenerationStats
    text: list[str] | None = None
