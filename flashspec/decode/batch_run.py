"""The decode loop over a running batch's fixed slots (SPEC.md §12): the same stages as
``generate``'s :class:`~flashspec.decode.loop._Run`; only where rows come from (a join feeds one
row alone) and what they sample with (each row its own parameters and generator) differ.
:class:`~flashspec.decode.batch.Batch` is the API over it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..drafters.base import CapturesJoins, JoinsRows
from ..models.graphs import Graphs, window_widths
from ..sampling import SamplingParams
from ..stats import GenerationStats
from ..verify import VerifyResult, verify
from .commit import commit_tokens
from .loop import _Run
from .workspace import FAULTS, Plan

__all__ = ["GREEDY", "BatchFull", "BatchRun", "Row", "RowUpdate"]

GREEDY = SamplingParams()  # every greedy row verifies alike, whatever temperature it was given


class BatchFull(RuntimeError):
    """Every slot of the batch holds a request."""


@dataclass
class RowUpdate:
    """What one request gained at a step: ``tokens`` (new ids, possibly none), whether it is
    ``finished``, and why: ``"stop"`` (an EOS id), ``"length"`` (``max_new_tokens``) or
    ``"error"`` (a fault of this row alone; ``error`` holds the sentence)."""

    handle: int
    tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Row:
    """Host-side record of the request in one slot."""

    handle: int
    params: SamplingParams
    generator: torch.Generator
    prompt_length: int
    max_new_tokens: int
    reported: int = 0  # generated tokens already handed out by step()
    finished: bool = False


class BatchRun(_Run):
    """The decode loop's state over fixed slots whose rows come and go (the same stages as
    ``generate``'s :class:`~flashspec.decode.loop._Run`; only row admission and sampling differ)."""

    def __init__(self, plan: Plan, stats: GenerationStats, eos: Sequence[int], max_length: int) -> None:  # noqa: D107
        self._bind(plan, stats, GREEDY, None, eos)
        ws, device = self.ws, self.ws.tokens.device
        ws.prompt_length.fill_(1)  # a free slot: one pending token, never active
        ws.length.fill_(1)
        ws.max_new_tokens.zero_()
        ws.active.fill_(False)
        # The host bound on row lengths starts at the batch's max_length, which no row ever passes,
        # so a row that joins never raises it; the drafters' catch-up windows, sized from how far
        # rows grew since their last proposal (self.growth), stay those of the rows already there
        # (SPEC.md §4, §12).
        self.max_length = max_length
        self.rng = None  # each row has its own (rows[b].generator)
        self.rows: list[Row | None] = [None] * self.batch
        # The distinct sampling parameters of the occupied slots, and which slots use each
        # (masks [S] bool, one buffer row per parameter set, filled in place so that a captured
        # step reads them: the graph key is the list of parameters, not the slots, SPEC.md §12).
        self.param_sets: tuple[SamplingParams, ...] = ()
        self._masks = torch.zeros(self.batch, self.batch, dtype=torch.bool, device=device)
        # Joins replay graphs captured at warm-up, one per (slot, padded width), reading these
        # buffers: the start position (0) and the column of the logits (P − 1) (SPEC.md §12,
        # "Joins are graphs too"). Their own Graphs: the steps' limit does not bound them.
        self.join_graphs = Graphs(enabled=plan.graphs.enabled)
        self._join_start = torch.zeros(1, dtype=torch.long, device=device)
        self._join_last = torch.zeros(1, 1, dtype=torch.long, device=device)
        for drafter in plan.drafters:
            drafter.begin(self.batch)

    # ------------------------------------------------------------------ per-row sampling
    def regroup(self) -> None:
        """Rows by sampling parameters (after every admission and departure): the parameter
        sets in a canonical order, and each set's slots in ``_masks``."""
        groups: dict[SamplingParams, list[int]] = {}
        for b, row in enumerate(self.rows):
            if row is not None:
                groups.setdefault(row.params, []).append(b)
        self.param_sets = tuple(sorted(groups, key=repr))
        masks = torch.zeros_like(self._masks, device="cpu")
        for g, params in enumerate(self.param_sets):
            masks[g, groups[params]] = True
        self._masks.copy_(masks)

    def graph_key(self, k: int, has_probs: bool, reuse: int | None) -> tuple:
        """Steps replay one graph per draft length and parameter sets (whichever slots use them)."""
        return k, has_probs, self.param_sets, reuse, self.plan.acceptance

    def _draw_random(self) -> None:
        """Each occupied row's random numbers from its own generator (SPEC.md §12)."""
        for b, row in enumerate(self.rows):
            if row is not None:
                self.ws.random[b].uniform_(generator=row.generator)

    def _draft_params(self) -> SamplingParams:
        """The rows' parameters when they all agree, else greedy drafts (deterministic proposals,
        verified with a one-hot ``q``: exact for every row, SPEC.md §2)."""
        return self.param_sets[0] if len(self.param_sets) == 1 else GREEDY

    def _verify(self, logits: torch.Tensor, drafts: torch.Tensor, probs: torch.Tensor | None,
                uniforms: torch.Tensor) -> VerifyResult:
        """Verify every row with each parameter set and keep, per row, the result of its own
        set (``_masks``; SPEC.md §12): row ``b``'s result reads only its own logits, drafts,
        ``q`` and uniforms, so the other sets' results for it are simply not used. Free slots
        accept nothing (their commit is skipped anyway: inactive)."""
        num_accepted = torch.zeros(self.batch, dtype=torch.long, device=logits.device)
        tokens = torch.zeros(self.batch, drafts.shape[1] + 1, dtype=torch.long, device=logits.device)
        for g, params in enumerate(self.param_sets):
            part = verify(logits, drafts, probs, params, uniforms, acceptance=self.plan.acceptance)
            mask = self._masks[g]
            num_accepted = torch.where(mask, part.num_accepted, num_accepted)
            tokens = torch.where(mask[:, None], part.tokens, tokens)
        return VerifyResult(num_accepted, tokens)

    # ------------------------------------------------------------------ rows joining
    def join(self, b: int, prompt: list[int], row: Row) -> None:
        """Put ``prompt`` in free slot ``b``, feed it alone and commit its first token (the
        prefill of ``generate``, for one row)."""
        ws, device = self.ws, self.ws.tokens.device
        width = len(prompt)
        ws.tokens[b].zero_()
        ws.tokens[b, :width] = torch.tensor(prompt, device=device)
        ws.prompt_length[b] = width
        ws.length[b] = width
        ws.generated[b] = 0
        ws.max_new_tokens[b] = row.max_new_tokens
        ws.active[b] = True
        one = slice(b, b + 1)
        zeros = torch.zeros(1, dtype=torch.long, device=device)
        # Fed at a warmed width (SPEC.md §12, "Prefill widths"): the positions past the prompt are
        # zeros whose cache entries are overwritten before any query reads them (§3).
        fed = self.prefill_width(width)
        started = time.perf_counter()
        self._join_last.fill_(width - 1)
        key = ("join", b, fed)
        logits = self.join_graphs.run(key if key in self.join_graphs else None, lambda: self._join_forward(b, fed))
        finite = bool(torch.isfinite(logits).all())  # (a read-back: the prefill's time is known here)
        if self.plan.guard is not None:  # the scale of an unmeasured catch-up's cost (SPEC.md §8)
            self.plan.guard.prefill(time.perf_counter() - started, width)
        if not finite:
            ws.active[b] = False
            raise ValueError(f"Generation stopped at the prefill: {FAULTS[1]}.")
        ws.random[b].uniform_(generator=row.generator)
        result = verify(logits, ws.draft_tokens[one, :0], None, row.params, self.verify_uniforms[one, :1])
        commit_tokens(ws.tokens[one], ws.length[one], ws.active[one], ws.generated[one], ws.max_new_tokens[one],
                      ws.eos, result.tokens, zeros)
        self.rows[b] = row
        self.regroup()
        self.max_length = max(self.max_length, width + 1)
        history = self.history()
        for drafter in self.plan.drafters:
            if isinstance(drafter, JoinsRows):
                drafter.prefill_row(history, b, **({} if fed == width else {"width": fed}))

    def _join_forward(self, b: int, fed: int) -> torch.Tensor:
        """The target's prefill of slot ``b`` over ``tokens[b, :fed]`` through a view of its cache
        row, logits ``[1, 1, V]`` at the column in ``_join_last`` (graph-safe: buffers only)."""
        ws, one = self.ws, slice(b, b + 1)
        features = {} if ws.hidden is None else {"hidden_out": {n: h[one] for n, h in ws.hidden.items()}}
        with self.plan.target.only_row(b):
            return self.plan.target.prefill(ws.tokens[one, :fed], self._join_start, None, logits_at=self._join_last,
                                            **features)

    def capture_joins(self, longest: int) -> None:
        """Pad joins to §7's prefill widths up to ``longest`` (the batch's ``max_length``: no
        prompt is longer) and capture the join of every slot at each, the target's and each
        drafter's that can (``capture_joins``), with every slot free (SPEC.md §12, "Joins are
        graphs too"). Called by :meth:`Batch.warmup` when the steps are graphs."""
        self.prefill_widths = tuple(window_widths(min(longest, self.ws.tokens.shape[1]), 16))
        self._join_last.zero_()
        for b in range(self.batch):
            for fed in self.prefill_widths:
                self.join_graphs.run(("join", b, fed), lambda b=b, fed=fed: self._join_forward(b, fed), warm=True)
        history = self.history()
        for drafter in self.plan.drafters:
            if isinstance(drafter, CapturesJoins):
                drafter.capture_joins(history, self.prefill_widths)

    # The widths a joining prompt is fed at (set by Batch.warmup on CUDA, SPEC.md §12): a prompt
    # is padded to the narrowest of them that holds it; () or a longer prompt: its own length.
    prefill_widths: tuple[int, ...] = ()

    def prefill_width(self, width: int) -> int:
        """The width a prompt of ``width`` tokens is fed at."""
        return next((w for w in self.prefill_widths if w >= width), width)

    def leave(self, b: int) -> None:
        """Free slot ``b`` (its row stops generating at once)."""
        self.ws.active[b] = False
        self.rows[b] = None
        self.regroup()

    # ------------------------------------------------------------------ faults of one row
    def take_fault(self) -> tuple[int, str] | None:
        """A fault noted on the device, as (slot, sentence), cleared so that it fails that row
        alone; None when there is none."""
        step, row, kind = self.ws.fault.tolist()
        if not step:
            return None
        self.ws.fault.zero_()
        return row, f"Generation stopped at a decode step: {FAULTS[kind]}."

    def after_poll(self) -> None:
        """Restart the per-step log (a batch runs for ever; the log holds one poll's steps).

        ``max_length`` keeps the loop's own arithmetic (+ k + 1 per step, never tightened), and
        ``growth`` keeps its steps across polls: drafters size their re-fed windows from how far
        rows grew since their last proposal (SPEC.md §4), and a count that restarted here, or a
        bound that shrank when a long row left, would make them skip committed tokens."""
        self.ws.steps_taken.zero_()
        self.chosen.clear()
        self.proposed.clear()
        self.caught_up.clear()
        self.cold.clear()
        self.polled = 0
        self.stats.step_log.clear()
