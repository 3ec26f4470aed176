"""Continuous batching: requests join a running batch at step boundaries and leave it when done.

A :class:`Batch` is a step-level handle on the engine's one decode loop (:mod:`flashspec.decode.loop`):
it owns a :class:`~flashspec.decode.workspace.Workspace` of fixed *slots* (rows) and a fixed capacity, and
drives the loop's own stages — the same select → propose → score → verify → commit step, the
same lagged poll — over whichever slots hold a request. What differs from ``generate`` is only
where rows come from and what they sample with:

* :meth:`Batch.add` feeds one prompt into a free slot, alone (:meth:`StaticLM.only_row
  <flashspec.models.static.StaticLM.only_row>`), and draws its first token, while the other rows wait;
* every row has its own sampling parameters and its own random generator (seeded by its own
  ``seed``), so its random numbers do not depend on which other rows share the batch;
* :meth:`Batch.step` runs one speculative step over every slot, then reports each request's new
  tokens and whether it finished; :meth:`Batch.cancel` frees a slot at once.

Why no request's output law changes when others join or leave: SPEC.md §12.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..checks import check_int
from ..drafters.base import CatchesUp, JoinsRows
from ..models.loading import context_window
from ..models.static import StaticLM
from ..stats import DrafterStats, GenerationStats
from .batch_run import GREEDY, BatchFull, BatchRun, Row, RowUpdate
from .request import MAX_TOKENS_WITHOUT_WINDOW

__all__ = ["Batch", "BatchFull", "RowUpdate"]

class Batch:
    """A running batch over ``engine``'s models: :meth:`add` requests, :meth:`step`, :meth:`cancel`.

    Use it as a context manager (or call :meth:`close`): while it is open it holds the engine
    (``generate`` from another thread waits for :meth:`close`). Not thread-safe: call it from one
    thread. ``slots``: the most requests decoded together; ``max_length``: prompt + new tokens of
    any request (default: the model's context window, at most 4096); ``num_draft_tokens``: γ of
    arms that have none of their own.
    """

    def __init__(self, engine: Any, *, slots: int = 8, max_length: int | None = None,
                 num_draft_tokens: int = 4, eos_token_id: Any = None) -> None:
        check_int("slots", slots, 1, 1024)
        if not isinstance(engine.target_lm, StaticLM):
            raise ValueError("Continuous batching needs a target over FlashSpec's static cache "
                             f"(architectures {', '.join(StaticLM.ARCHITECTURES)}).")
        if engine.tensor_parallel is not None:
            raise ValueError("Continuous batching does not support tensor-parallel targets yet.")
        for d in engine.drafters:
            if isinstance(d, CatchesUp) and not (isinstance(d, JoinsRows) and d.joins_rows):
                raise ValueError(f"Drafter {d.name!r} cannot join a running batch: a drafter with a cache of its own "
                                 "must be able to feed one new row alone (prefill_row); model drafters need "
                                 "FlashSpec's static cache (architectures "
                                 f"{', '.join(StaticLM.ARCHITECTURES)}).")
        window = context_window(engine.target.config) or MAX_TOKENS_WITHOUT_WINDOW
        if max_length is None:
            max_length = min(window, 4096)
        check_int("max_length", max_length, 2, window, upto=f"the context window ({window})")
        self.engine, self.slots, self.max_length = engine, slots, max_length
        self.num_draft_tokens = num_draft_tokens
        self._eos_token_id = eos_token_id
        self.gamma = max(engine.arm_gammas(num_draft_tokens), default=num_draft_tokens)
        eos = engine.parse([0], **self._defaults(1, False, 1.0, 0, 1.0, None)).eos
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(engine.session())
        try:
            with torch.inference_mode():
                plan = engine.plan(rows=slots, length=max_length, num_draft_tokens=num_draft_tokens, num_eos=len(eos),
                                   running_batch=True)  # one guard: one budget for the batch's lifetime
                self.stats = GenerationStats(
                    per_drafter={d.name: DrafterStats() for d in engine.drafters},
                    per_arm={label: DrafterStats() for label in plan.labels})
                self._run = BatchRun(plan, self.stats, eos, max_length)
        except BaseException:
            self._stack.close()
            raise
        self._next_handle = 0
        self._slot_of: dict[int, int] = {}
        self.closed = False

    def _defaults(self, max_new_tokens: Any, do_sample: Any, temperature: Any, top_k: Any, top_p: Any,
                  seed: Any) -> dict[str, Any]:
        return dict(attention_mask=None, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                    top_k=top_k, top_p=top_p, num_draft_tokens=self.num_draft_tokens,
                    eos_token_id=self._eos_token_id, seed=seed, sync_every=1, context=None)

    # ------------------------------------------------------------------ the step API
    @property
    def running(self) -> int:
        """Requests in the batch (finished ones leave at the step that reports them)."""
        return len(self._slot_of)

    @property
    def free_slots(self) -> int:
        return self.slots - len(self._slot_of)

    def check(self, prompt: Any, *, max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0,
              top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Any:
        """Validate one request as ``generate`` would, plus this batch's ``max_length``; return the
        parsed :class:`~flashspec.decode.request.Request` (a ``ValueError`` names what is wrong)."""
        request = self.engine.parse(prompt, **self._defaults(max_new_tokens, do_sample, temperature, top_k, top_p, seed))
        if len(request.rows) != 1:
            raise ValueError(f"A batch request is one prompt; got {len(request.rows)}.")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1 for a request in a running batch.")
        if request.longest + request.max_new_tokens > self.max_length:
            raise ValueError(f"The prompt ({request.longest} tokens) plus max_new_tokens ({request.max_new_tokens}) "
                             f"exceeds this server's maximum length of {self.max_length} tokens.")
        return request

    @torch.inference_mode()
    def add(self, prompt: Any, **sampling: Any) -> int:
        """Join a request (``prompt`` and ``generate``'s ``max_new_tokens``, ``do_sample``,
        ``temperature``, ``top_k``, ``top_p``, ``seed``) at this step boundary: its prompt is fed
        and its first token drawn now. Returns its handle; raises :class:`BatchFull` when no slot
        is free and ``ValueError`` for a bad request."""
        self._check_open()
        request = self.check(prompt, **sampling)
        if not self.free_slots:
            raise BatchFull(f"All {self.slots} slots of the batch are taken.")
        slot = next(b for b, row in enumerate(self._run.rows) if row is None)
        generator = torch.Generator(device=self.engine.device)
        seed = request.seed
        generator.manual_seed(int(torch.randint(0, 2**62, ()).item()) if seed is None else seed)
        params = request.params if request.params.do_sample else GREEDY
        handle = self._next_handle
        self._next_handle += 1
        row = Row(handle, params, generator, request.longest, request.max_new_tokens)
        try:
            self._run.join(slot, request.rows[0], row)
        except BaseException:
            self._run.leave(slot)
            raise
        self._slot_of[handle] = slot
        return handle

    @torch.inference_mode()
    def step(self) -> list[RowUpdate]:
        """One speculative step over every request in the batch (none when the batch only holds
        rows finished at their prefill), then each request's new tokens. A finished request has
        left the batch when this returns; a fault in one row fails that request alone."""
        self._check_open()
        run = self._run
        if not self._slot_of:
            return []
        failed: dict[int, str] = {}
        running = bool(run.active.any())
        if not running:  # the batch emptied: its next rows are new work (SPEC.md §8)
            guard = run.plan.guard
            if guard is not None:  # what it measured carries over; the never-slower budget starts again
                self.engine.costs.learn(guard)
                guard.priors = dict(self.engine.arm_costs)
                guard.catch_up_priors = dict(self.engine.catch_up_costs)
                guard.reset()
            begin = getattr(run.plan.selector, "begin_request", None)
            if callable(begin):
                begin()  # and the request selector's request
        if running:
            run.step()
            started = time.perf_counter()
            fault = run.take_fault()
            if fault is not None:
                slot, message = fault
                failed[slot] = message
                run.ws.active[slot] = False
            run.poll()
            run.stats.decode_seconds += time.perf_counter() - started
            if run.plan.guard is not None:
                run.stats.guard_refused = run.plan.guard.refused + run.plan.guard.held
        updates = self._report(failed)
        run.after_poll()
        return updates

    @torch.inference_mode()
    def flush(self) -> list[RowUpdate]:
        """Each request's tokens gained since they were last handed out, without a step: called
        right after :meth:`add`, it hands out the first tokens drawn at the joins (and finishes
        the requests that ended there), so that a joining request's time to its first token
        does not include the next step of the whole batch (SPEC.md §12)."""
        self._check_open()
        return self._report({}) if self._slot_of else []

    def _report(self, failed: dict[int, str]) -> list[RowUpdate]:
        """The updates of every request in the batch (``failed``: slot → the sentence of its
        fault); a finished request leaves the batch."""
        run = self._run
        lengths, generated, active = (t.tolist() for t in (run.length, run.generated, run.active))
        updates = []
        for handle, slot in list(self._slot_of.items()):
            row = run.rows[slot]
            end = lengths[slot]
            start = row.prompt_length + row.reported
            tokens = run.tokens[slot, start:end].tolist() if end > start else []
            row.reported = generated[slot]
            if slot in failed:
                updates.append(RowUpdate(handle, tokens, True, "error", failed[slot]))
            elif not active[slot]:
                reason = "length" if generated[slot] >= row.max_new_tokens and not (
                    tokens and tokens[-1] in run.ws.eos.tolist()) else "stop"
                updates.append(RowUpdate(handle, tokens, True, reason))
            else:
                updates.append(RowUpdate(handle, tokens, False))
                continue
            self._free(handle)
        run.stats.new_tokens += sum(len(u.tokens) for u in updates)
        return updates

    def cancel(self, handle: int) -> bool:
        """Remove a request now (its slot is free for the next :meth:`add`); False if it had
        already left."""
        self._check_open()
        if handle not in self._slot_of:
            return False
        with torch.inference_mode():
            self._free(handle)
        return True

    def _free(self, handle: int) -> None:
        self._run.leave(self._slot_of.pop(handle))

    @torch.inference_mode()
    def warmup(self, prompt_lengths: Sequence[int] = (1,), pad: bool | None = None) -> float:
        """Run a throw-away request of each prompt length through a prefill and one step of every
        arm, at this batch's fixed shapes (slots, capacity), so that later requests pay no lazy
        initialisation or compilation for them; returns the seconds it took. On a CPU without
        ``compile`` nothing is compiled or captured: this only touches every code path once.

        ``pad``: from then on, feed each joining prompt at the narrowest warmed length that holds
        it, so that no prefill runs at a width the process has not run before (default: on CUDA,
        where the first forward of a new width pays for choosing and loading kernels; SPEC.md
        §12, "Prefill widths")."""
        if pad is not None and not isinstance(pad, bool):
            raise ValueError(f"pad must be True, False or None (default: on CUDA); got {pad!r}.")
        started = time.perf_counter()
        run = self._run
        widths = sorted({max(1, min(int(width), self.max_length - 2)) for width in prompt_lengths})
        run.prefill_widths = ()  # the warm-up's own prompts are fed at their lengths
        for width in widths:
            handle = self.add([0] * width, max_new_tokens=2)
            saved = run.ws.max_new_tokens.clone()
            arms = range(len(self.engine.arms)) if self.engine.arms else [None]
            for arm in arms:
                k = 0 if arm is None else run.plan.arm_gammas[arm]
                run.ws.max_new_tokens.copy_(saved)
                has_probs = run._propose(arm, k)
                reuse = run.states_layer
                run.plan.graphs.run(run.graph_key(k, has_probs, reuse),  # captured here, on CUDA
                                    lambda: run._score_verify_commit(k, has_probs, reuse))
                run.ws.length[self._slot_of[handle]] = width + 1  # forget what the step committed
                run.ws.generated[self._slot_of[handle]] = 1
                run.ws.active[self._slot_of[handle]] = True
            run.take_fault()
            self.cancel(handle)
            run.after_poll()
        if run.ws.tokens.is_cuda if pad is None else pad:
            if run.join_graphs.enabled:  # joins replay graphs at §7's prefill widths (SPEC.md §12)
                run.capture_joins(self.max_length)
            else:
                run.prefill_widths = tuple(widths)
        return time.perf_counter() - started

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("This batch is closed; open another with engine.batch(...).")

    def close(self) -> None:
        """Drop every request and hand the engine back (``generate`` may run again)."""
        if not self.closed:
            self.closed = True
            self._slot_of.clear()
            self._stack.close()

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
