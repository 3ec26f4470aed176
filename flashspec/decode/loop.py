"""The decode loop: select → propose → score → verify → commit → update (SPEC.md §7).

Glossary:

* **plan** — what the engine hands a loop: the target behind its cache, the drafters, the arms
  (drafter, γ), the CUDA graphs, the device buffers (:class:`Workspace`) and the selector of this
  request. The loop reads nothing else of the engine.
* **step** — one target forward over ``[pending token, γ drafts]`` per row; commits 1 … γ + 1
  tokens per active row (accepted drafts, then the target's own token).
* **poll** — every ``sync_every`` steps the host reads the per-step log back (the loop's only
  synchronisation), hands it to the statistics and the selector (the *update*, lagged), and
  learns whether any row is still generating.

* **fault** — a step whose target logits are not finite, whose draw found no probability mass,
  or whose drafter proposed ids outside the vocabulary. It is noted on the device (the first
  one: step, row, kind) and raised as a ``ValueError`` at the next poll (SPEC.md §5).

Nothing inside a step reads a tensor back to the host, so on CUDA the score-verify-commit work
of a step is one graph replay and the host runs ahead of the device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..drafters.base import CatchesUp, Drafter, Growth, History, TimesForwards
from ..models.graphs import compile_events, window_widths
from ..sampling import SamplingParams
from ..select import Observation
from ..stats import GenerationStats, StepRecord
from ..verify import VerifyResult, verify
from .chunks import chunked, chunked_step
from .commit import commit_tokens
from .drafts import check_draft
from .request import Request
from .workspace import FAULTS, Plan, raise_fault

PREFILL_GRAPH_ROWS = 8  # larger prefills run eagerly: each width's graph keeps its activations (SPEC.md §7)

__all__ = ["decode"]


def decode(plan: Plan, request: Request, stats: GenerationStats, progress: bool = False) -> list[list[int]]:
    """Run ``request`` to the end; fill ``stats``; return the new tokens of each row."""
    run = _Run(plan, request, stats)
    start = time.perf_counter()
    run.prefill()
    if plan.workspace.tokens.is_cuda:  # the first poll waits here anyway; the time is then the prefill's
        torch.cuda.synchronize(plan.workspace.tokens.device)
    stats.prefill_seconds = time.perf_counter() - start
    if plan.guard is not None:  # the scale of an unmeasured catch-up's cost (SPEC.md §8)
        seconds = stats.prefill_seconds if plan.tp is None else plan.tp.shared_floats([stats.prefill_seconds])[0]
        plan.guard.prefill(seconds, request.longest)
    forward_before = run.forward_seconds()
    with tqdm(total=run.budget, disable=not progress, desc="generating", unit="tok") as bar:
        # Every step commits at least one token per active row, so max_new_tokens - 1 steps
        # finish every row; the loop reads the device at most every sync_every steps, sooner
        # once the steps launched since the last poll could have finished the longest-remaining
        # row (SPEC.md §7, "Polls come sooner near the budget's end").
        reach, since_steps, since_tokens = None, 0, 0  # as of the last poll (None: none yet)
        for _ in range(request.max_new_tokens - 1):
            if reach is None or since_steps >= request.sync_every or since_tokens >= reach:
                snapshot = run.snapshot()
                ahead = plan.queue_ahead and (reach is None or since_tokens < reach)  # a row surely runs
                if ahead:
                    run.step()  # harmless if every row has finished: it commits nothing
                running = run.poll(snapshot)
                bar.update(run.generated_total - bar.n)
                if not running:
                    break
                reach, since_steps, since_tokens = run.least_left(), 0, 0
                if ahead:
                    since_steps, since_tokens = 1, run.most_committed()
                    continue
            run.step()
            since_steps += 1
            since_tokens += run.most_committed()
        run.poll()
        bar.update(run.generated_total - bar.n)
    stats.seconds = time.perf_counter() - start
    stats.decode_seconds = stats.seconds - stats.prefill_seconds
    stats.forward_seconds = run.forward_seconds() - forward_before
    if plan.guard is not None:
        stats.guard_refused = plan.guard.refused + plan.guard.held
    return run.sequences()


class _Run:
    """The state of one ``generate`` call: committed tokens, caches, counters.

    The tensors live in the plan's :class:`Workspace` and are updated in place, so the
    score-verify-commit work of a step can be replayed as a CUDA graph. Nothing inside a step
    reads a tensor back to the host; :meth:`poll` does, every ``sync_every`` steps, to stop and
    to hand statistics to the selector (lagged by up to ``sync_every`` steps).
    """

    def __init__(self, plan: Plan, request: Request, stats: GenerationStats) -> None:
        self._bind(plan, stats, request.params, request.context, request.eos)
        ws, rows = self.ws, request.rows
        # Rows past the request's (a fixed shape's padding, SPEC.md §7 "Warm shapes") hold one
        # token and are inactive from the start: never committed to, never returned.
        self.real_rows = len(rows)
        self.budget = self.real_rows * request.max_new_tokens
        for b, r in enumerate(rows):
            ws.tokens[b, : len(r)] = torch.tensor(r, device=ws.tokens.device)
        padding = [1] * (self.batch - self.real_rows)
        ws.prompt_length.copy_(torch.tensor([len(r) for r in rows] + padding))
        ws.length.copy_(ws.prompt_length)
        ws.max_new_tokens.fill_(request.max_new_tokens)
        ws.max_new_tokens[self.real_rows:] = 0
        ws.active.fill_(True)
        ws.active[self.real_rows:] = False
        # A host-side upper bound on length.max(): + k + 1 per step, never capped (the first
        # proposal's width; catch-up windows after that come from self.growth, SPEC.md §4, §11).
        self.max_length = request.longest
        self.rng = torch.Generator(device=ws.tokens.device)
        seed = request.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
            if plan.tp is not None:
                seed = plan.tp.shared_seed(seed)  # identical random numbers on every rank
        self.rng.manual_seed(seed)
        for drafter in plan.drafters:
            drafter.begin(self.batch)

    def _bind(self, plan: Plan, stats: GenerationStats, params: SamplingParams, context: Any,
              eos: Sequence[int]) -> None:
        """What every run keeps: the plan's buffers (zeroed: no row yet), the host's per-step
        records, the step clock and the catch-up growth."""
        ws = plan.workspace
        self.plan, self.params, self.stats, self.context = plan, params, stats, context
        self.gamma = ws.shape[2]
        self.batch = ws.shape[0]
        self.ws = ws
        ws.tokens.zero_()
        ws.generated.zero_()
        ws.eos.fill_(-1)
        ws.eos[: len(eos)] = torch.tensor(list(eos), dtype=torch.long)
        ws.log.zero_()
        ws.steps_taken.zero_()
        ws.fault.zero_()
        self.tokens, self.length, self.active, self.generated = ws.tokens, ws.length, ws.active, ws.generated
        self.draft_uniforms = ws.random[:, : self.gamma]
        self.verify_uniforms = ws.random[:, self.gamma :]
        self.vocab_size: int = plan.target.model.config.vocab_size
        # Target forwards also write their features where a drafter reads them (SPEC.md §11).
        self._features = {} if ws.hidden is None else {"hidden_out": ws.hidden}
        self.chosen: list[int | None] = []  # host: the arm chosen at each step
        self.caught_up: list[int] = []  # host: the width its drafter caught up on first (0: none)
        self._catching_up = 0
        self.proposed: list[int] = []  # host: drafts per active row at each step
        self.cold: list[bool] = []  # host: whether the step compiled code or captured a graph
        self.clock = _StepClock(ws.tokens.device)
        self.growth = Growth()  # per step, how far a row may have grown: drafters' catch-up windows (SPEC.md §4)
        self.polled = 0  # steps already handed to the stats and the selector
        self.generated_total = 0  # tokens generated so far, as of the last poll

    def prefill(self) -> None:
        """Feed every prompt once and draw the first new token from the target alone: on CUDA
        (one device) replayed from a graph at a padded width (SPEC.md §7, "The prefill is a
        graph too"), else eagerly at the prompts' width."""
        zeros = torch.zeros_like(self.length)
        graphs, capacity = self.plan.graphs, self.tokens.shape[1]

        def forward(width: int) -> torch.Tensor:
            # (A narrower width than the prompts' is only ever run to capture its graph: its
            # logits are never read, and clamping keeps its gather in bounds.)
            real = (torch.arange(width, device=self.tokens.device) < self.length[:, None]).long()
            last = (self.length - 1).clamp(max=width - 1)[:, None]
            return self.plan.target.prefill(self.tokens[:, :width], torch.zeros_like(self.length), real,
                                            logits_at=last, **self._features)

        if graphs.enabled and self.plan.tp is None and self.tokens.shape[0] <= PREFILL_GRAPH_ROWS:
            widths = window_widths(capacity, 16)
            width = next(w for w in widths if w >= self.max_length)
            logits = graphs.run_widths(widths, width, ("prefill",), forward, repeatable=True)  # feeds the same prompts
        else:
            logits = forward(self.max_length)
        finite = torch.isfinite(logits).flatten(1).all(dim=1)
        if not bool(finite.all()):  # the prefill reads back once anyway (its time is measured)
            row = int((~finite).long().argmax())
            raise ValueError(f"Generation stopped at the prefill, row {row}: {FAULTS[1]}.")
        no_drafts = self.ws.draft_tokens[:, :0]
        self._draw_random()
        result = self._verify(logits, no_drafts, None, self.verify_uniforms[:, :1])
        ws = self.ws
        commit_tokens(ws.tokens, ws.length, ws.active, ws.generated, ws.max_new_tokens, ws.eos, result.tokens, zeros)
        self.max_length += 1
        # Drafters are not prefilled: a drafter's first proposal feeds the prompt (its catch-up,
        # priced by the guard, SPEC.md §4, §8), so a request pays only for the drafters it runs.

    def step(self) -> None:
        """One speculative step: select → propose → score → verify → commit; the update
        happens lagged, in :meth:`poll`."""
        self.clock.mark()
        events = compile_events()
        arm, k = self._select()
        if chunked(self.plan.block_size, k):  # drafted, scored and verified in chunks (SPEC.md §2)
            chunked_step(self, arm, k)
        else:
            has_probs = self._propose(arm, k)
            reuse = self.states_layer
            self.plan.graphs.run(self.graph_key(k, has_probs, reuse),
                                 lambda: self._score_verify_commit(k, has_probs, reuse))
        self.chosen.append(arm)
        self.proposed.append(k)
        self.caught_up.append(self._catching_up)
        self.cold.append(compile_events() != events)  # it compiled or captured: a one-off cost (SPEC.md §8)
        self.max_length += k + 1
        self.growth.launched(k)

    def graph_key(self, k: int, has_probs: bool, reuse: int | None) -> tuple:
        """The key of this step's score-verify-commit graph: what the captured work depends on
        besides the workspace's tensors (SPEC.md §7)."""
        return k, has_probs, self.params, reuse, self.plan.acceptance

    def _select(self) -> tuple[int | None, int]:
        """The arm of this step and its draft length (no arm, 0 drafts: target-only)."""
        selector = self.plan.selector
        if selector is None:
            return None, 0
        started = time.perf_counter()
        if self.plan.guard is None:
            arm, self._catching_up = selector.select(), 0
        else:  # the selector's choice if it keeps the budget, else target-only (SPEC.md §8)
            arm, self._catching_up = self.plan.guard.choose(selector.select, self._catch_up,
                                                            getattr(selector, "rank", None))
        self.stats.selector_seconds += time.perf_counter() - started
        return arm, self.plan.arm_gammas[arm]

    def history(self) -> History:
        """What a drafter sees of the rows: tokens, lengths, the host's bounds, the features."""
        return History(self.tokens, self.length, self.active, self.max_length, self.ws.hidden, self.growth)

    def _catch_up(self, arm: int) -> int:
        """How many committed positions ``arm``'s drafter must feed before this step's drafts
        beyond a steady step's (``Drafter.catch_up``, SPEC.md §4; 0 without a cache)."""
        d = self.plan.arm_drafters[arm]
        drafter = None if d is None else self.plan.drafters[d]
        return drafter.catch_up(self.history()) if isinstance(drafter, CatchesUp) else 0

    # The layer count after which this step's drafter handed back the target's states
    # (ws.draft_states, SPEC.md §11 verify reuse), or None; set by _propose.
    states_layer: int | None = None

    def _propose(self, arm: int | None, k: int) -> bool:
        """Draw this step's random numbers and let the arm's drafter fill the draft buffers;
        returns whether the drafts come with their laws ``q``. Sets :attr:`states_layer`."""
        ws, tp = self.ws, self.plan.tp
        self._draw_random()
        self.states_layer = None
        if arm is None or self.plan.arm_drafters[arm] is None:  # target-only: no drafts
            return False
        history = self.history()
        drafter = self.plan.drafters[self.plan.arm_drafters[arm]]
        draft = drafter.propose(history, k, self._draft_params(), self.draft_uniforms[:, :k])
        self._check_draft(drafter, draft, k)
        self.plan.stage_drafts(ws.draft_tokens[:, :k], draft.tokens, self.vocab_size, self.active, ws.fault,
                               ws.steps_taken)
        has_probs = draft.probs is not None
        if has_probs:
            if ws.draft_probs is None:
                shape = (self.batch, self.gamma, draft.probs.shape[-1])
                ws.draft_probs = torch.empty(shape, dtype=draft.probs.dtype, device=draft.probs.device)
            ws.draft_probs[:, :k].copy_(draft.probs)
        # States for the verify to reuse (SPEC.md §11); never on tensor-parallel ranks, whose
        # drafters fed their own drafts, not necessarily rank 0's that every rank verifies.
        if getattr(draft, "states", None) is not None and tp is None:
            if ws.draft_states is None:
                shape = (self.batch, self.gamma, draft.states.shape[-1])
                ws.draft_states = torch.empty(shape, dtype=draft.states.dtype, device=draft.states.device)
            ws.draft_states[:, :k].copy_(draft.states)
            self.states_layer = draft.states_layer
        if tp is not None:
            # Rank 0's drafts for every rank: replicas of a drafter may differ in the last bit
            # (e.g. kernels autotuned per process), and the ranks must verify the same drafts.
            tp.broadcast_(ws.draft_tokens)
            if has_probs:
                tp.broadcast_(ws.draft_probs)
        return has_probs

    # The three places a step meets its rows' sampling: where a batch whose rows differ
    # (flashspec.decode.batch, SPEC.md §12) gives each row its own generator and parameters.
    def _draw_random(self) -> None:
        """This step's random numbers, ``ws.random [B, 2γ + 1]``: drafting, then verification."""
        self.ws.random.uniform_(generator=self.rng)

    def _draft_params(self) -> SamplingParams:
        """The sampling parameters drafters draw with (any law is exact: verification corrects it)."""
        return self.params

    def _verify(self, logits: torch.Tensor, drafts: torch.Tensor, probs: torch.Tensor | None,
                uniforms: torch.Tensor) -> VerifyResult:
        """Verify every row's drafts with the request's sampling parameters (SPEC.md §2)."""
        return verify(logits, drafts, probs, self.params, uniforms, acceptance=self.plan.acceptance)

    def _check_draft(self, drafter: Drafter, draft: Any, k: int) -> None:
        """A drafter's output has the protocol's shapes (checked on the host: no device read)."""
        check_draft(drafter, draft, k, self.batch, self.vocab_size, self.tokens.device, self.plan.target)

    def _score(self, k: int, reuse: int | None = None) -> torch.Tensor:
        """The target's logits ``[B, k + 1, V]`` over ``[pending, d_1 … d_k]`` (tensor code only).
        ``reuse = N``: the drafter already ran the first ``N`` layers for all but ``d_k`` and left
        their states in ``ws.draft_states``; run those layers for ``d_k`` alone, then the rest for
        every position from the states (SPEC.md §11, verify reuse)."""
        ws, target, start = self.ws, self.plan.target, self.length - 1
        drafts = ws.draft_tokens[:, :k]
        if reuse is None or k == 0:
            fed = torch.cat([self.tokens.gather(1, start[:, None]), drafts], dim=1)
            return target.forward(fed, start, self.active[:, None].expand_as(fed), **self._features)
        last = target.layer_states(drafts[:, -1:], start + k, layers=reuse, **self._features)
        states = torch.cat([ws.draft_states[:, :k], last.to(ws.draft_states.dtype)], dim=1)
        return target.resume(states, start, reuse, **self._features)

    def _score_verify_commit(self, k: int, has_probs: bool, reuse: int | None = None) -> None:
        """Score the drafts with the target (reusing a drafter's states after ``reuse`` layers,
        :meth:`_score`), verify them, commit the result (tensor code only)."""
        ws = self.ws
        drafts = ws.draft_tokens[:, :k]
        logits = self._score(k, reuse)
        probs = ws.draft_probs[:, :k] if has_probs else None
        result = self._verify(logits, drafts, probs, self.verify_uniforms[:, : k + 1])
        self.plan.commit_step(ws.tokens, ws.length, ws.active, ws.generated, ws.max_new_tokens, ws.eos,
                              result.tokens, result.num_accepted, ws.log, ws.steps_taken, logits, ws.fault)

    def least_left(self) -> int:
        """The fewest tokens the longest-remaining row still has to generate, from the tokens
        generated as of the last poll: at least the mean remaining budget ⌈R / B⌉ (host
        arithmetic only)."""
        return -(-(self.budget - self.generated_total) // self.real_rows)

    def most_committed(self) -> int:
        """The most tokens per row the last launched step can commit: its draft length + 1 (a
        target-only step exactly 1)."""
        return self.proposed[-1] + 1

    def snapshot(self) -> _Snapshot:
        """Start reading the per-step log, the stop flag and the token count back to the host:
        non-blocking copies on a GPU, finished by :meth:`poll`. Marks the end of the last step."""
        steps = len(self.chosen)
        self.clock.mark()
        marks = self.clock.take(steps - self.polled)
        ws = self.ws
        flags = torch.stack([self.active.any().long(), self.generated.sum()])
        packed = torch.cat([ws.log[self.polled : steps].flatten(), ws.fault, flags])
        if packed.is_cuda:
            packed = packed.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            ready = None
        return _Snapshot(steps, marks, packed, ready)

    def poll(self, snapshot: _Snapshot | None = None) -> bool:
        """Finish reading ``snapshot`` (taken now when not given; this waits for the device):
        update statistics and the selector; return whether any row is still generating."""
        snapshot = snapshot or self.snapshot()
        if snapshot.ready is not None:
            snapshot.ready.synchronize()  # the synchronisation
        values = snapshot.packed.tolist()
        *log, step, row, kind, running, self.generated_total = values
        raise_fault([step, row, kind])
        if snapshot.steps > self.polled:
            seconds = self.clock.seconds(snapshot.marks)
            if self.plan.tp is not None and self.plan.selector is not None:
                seconds = self.plan.tp.shared_floats(seconds)  # rank 0's clock: same rewards everywhere
            entries = [log[i : i + 3] for i in range(0, len(log), 3)]
            window = slice(self.polled, snapshot.steps)
            for arm, k, width, cold, (accepted, active_rows, committed), dt in zip(
                self.chosen[window], self.proposed[window], self.caught_up[window], self.cold[window], entries, seconds
            ):
                self.growth.polled(committed)
                self._record(arm, k, accepted, active_rows, committed, dt, width, cold)
            self.polled = snapshot.steps
        return bool(running)

    def _record(
        self, arm: int | None, k: int, accepted: int, active_rows: int, committed: int, seconds: float,
        catch_up: int = 0, cold: bool = False,
    ) -> None:
        """The update: one polled step into the statistics, the guard and the selector. A cold
        step (it compiled or captured) is recorded but teaches neither the guard nor the selector
        what the arm costs, and a stall (a step far costlier than the guard expected) does not
        teach the selector (SPEC.md §8, "Steady costs only")."""
        stats, plan = self.stats, self.plan
        teach = not cold
        if plan.guard is not None and arm is not None:
            teach = plan.guard.observe(arm, committed, seconds, active_rows, catch_up, cold=cold)
        if active_rows == 0:  # a step queued ahead after every row finished: it did nothing
            return
        label = None if arm is None else plan.labels[arm]
        stats.step_log.append(StepRecord(label, accepted, active_rows, committed, seconds, cold))
        stats.steps += 1
        stats.row_steps += active_rows
        stats.decode_tokens += committed
        stats.cold_steps += cold
        if arm is None:
            return
        if teach:
            observation = Observation(accepted, k * active_rows, committed, max(seconds, 1e-9))
            started = time.perf_counter()
            plan.selector.update(arm, observation)
            stats.selector_seconds += time.perf_counter() - started
        if plan.arm_drafters[arm] is None:  # the target-only arm
            stats.per_arm[label].steps += 1
            return
        drafter = plan.drafters[plan.arm_drafters[arm]]
        for per in (stats.per_drafter[drafter.name], stats.per_arm[label]):
            per.steps += 1
            per.proposed += k * active_rows
            per.accepted += accepted
        stats.proposed += k * active_rows
        stats.accepted += accepted

    def forward_seconds(self) -> float:
        """Host time inside model forwards so far (target and model drafters)."""
        return self.plan.target.forward_seconds + sum(d.forward_seconds for d in self.plan.drafters
                                                      if isinstance(d, TimesForwards))

    def sequences(self) -> list[list[int]]:
        out = []
        for b in range(self.real_rows):
            start, end = int(self.ws.prompt_length[b]), int(self.length[b])
            out.append(self.tokens[b, start:end].tolist())
        return out


class _StepClock:
    """Step durations without synchronising: host clocks on the CPU, CUDA events (read only
    after the poll's synchronisation) on a GPU. ``mark()`` at each step start and at each poll."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def take(self, steps: int) -> list[Any]:
        """The marks bounding the last ``steps`` steps (one per step start, then the poll's);
        the clock keeps the poll's mark only (the next step marks again)."""
        marks = self.marks[-(steps + 1):] if steps else []
        self.marks = self.marks[-1:]
        return marks

    def seconds(self, marks: list[Any]) -> list[float]:
        """Seconds between consecutive ``marks`` (CUDA events must have completed)."""
        if self.cuda:
            return [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


@dataclass
class _Snapshot:
    """A read-back in flight: the log of steps up to ``steps`` plus the stop flag and the
    number of generated tokens (``packed``, valid once ``ready`` has completed)."""

    steps: int
    marks: list[Any]
    packed: torch.Tensor
    ready: Any  # torch.cuda.Event, or None on the CPU
