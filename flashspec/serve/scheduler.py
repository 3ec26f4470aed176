"""The engine thread: admits queued requests into the running batch at step boundaries and hands
each request's tokens to its asyncio handler (SPEC.md §12).

Every engine call happens on this one thread (the engine is not thread-safe); handlers talk to it
through a bounded queue of :class:`Ticket` objects, and it answers through each ticket's
``asyncio.Queue`` (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..decode.batch import Batch, RowUpdate
from .metrics import Metrics

__all__ = ["QueueFull", "Scheduler", "ShuttingDown", "Ticket"]

log = logging.getLogger("flashspec.serve")


def admissible_warmup_lengths(lengths: Iterable[int], max_length: int) -> tuple[int, ...]:
    """``lengths`` clamped as :meth:`~flashspec.decode.batch.Batch.warmup` clamps them, to 1 …
    ``max_length - 2`` (the longest prompt a warm-up request of 2 new tokens fits), each kept
    once, in their first order: lengths that clamp alike would prefill the same shape twice."""
    top = max(1, max_length - 2)
    return tuple(dict.fromkeys(max(1, min(int(n), top)) for n in lengths))


class QueueFull(RuntimeError):
    """The waiting queue is full: answer 429."""


class ShuttingDown(RuntimeError):
    """The server is shutting down: answer 503 (a stream already answering ends with an error event)."""


SHUTTING_DOWN = "The server is shutting down; send the request again once it is back."


@dataclass
class Ticket:
    """One request between its handler and the engine thread."""

    ids: list[int]
    sampling: dict[str, Any]  # Batch.add's keyword arguments
    loop: asyncio.AbstractEventLoop
    # ("tokens", [...]) / ("done", reason) / ("error", msg) / ("shutdown", msg)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    handle: int | None = None
    cancelled: bool = False
    answered: bool = False  # the handler has its answer (a later cancel is not counted as one)
    first_token: float | None = None
    last_token: float | None = None

    def send(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    """Runs ``engine``'s :class:`~flashspec.decode.batch.Batch` in a background thread.

    ``slots``: batch-size cap; ``max_prefill_tokens``: the token budget — prompt tokens fed at one
    step boundary (a request with a longer prompt still joins, alone); ``max_queue``: requests
    waiting beyond the running batch (more: :class:`QueueFull`, HTTP 429); ``warmup_lengths``: the
    prompt lengths the start-up warm-up prefills, or a function of the opened batch's
    ``max_length`` that returns them; either way each is clamped to ``max_length - 2`` and run once
    (``warmed_lengths`` then holds those run).
    """

    def __init__(self, engine: Any, metrics: Metrics, *, slots: int = 8, max_length: int | None = None,
                 max_queue: int = 64, max_prefill_tokens: int = 2048, num_draft_tokens: int = 4,
                 warmup_lengths: Sequence[int] | Callable[[int], Sequence[int]] = (1,)) -> None:
        self.engine, self.metrics = engine, metrics
        self.options = dict(slots=slots, max_length=max_length, num_draft_tokens=num_draft_tokens)
        self.max_queue, self.max_prefill_tokens = max_queue, max_prefill_tokens
        self.warmup_lengths = warmup_lengths
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._cancels: list[Ticket] = []
        self._resets: list[threading.Event] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._drain_deadline: float | None = None  # when running requests are ended (shutdown)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.batch: Batch | None = None
        self.warmup_seconds = 0.0
        self.warmed_lengths: tuple[int, ...] = ()
        self._running: dict[int, Ticket] = {}
        self._seen = {"proposed": 0, "accepted": 0, "arms": {}}
        self._thread = threading.Thread(target=self._main, name="flashspec-engine", daemon=True)

    # ------------------------------------------------------------------ handler side
    def start(self) -> None:
        """Open the batch and warm it up on the engine thread; returns when it is ready."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, timeout: float = 30.0) -> None:
        """End the engine thread after its current step (waiting at most ``timeout`` seconds)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=timeout)

    def drain(self, grace: float) -> None:
        """Shut down gently: refuse new requests, answer the waiting ones with
        :class:`ShuttingDown` at once, and end the running ones ``grace`` seconds from now unless
        they finish first (called again, only a shorter grace counts)."""
        with self._wake:
            deadline = time.monotonic() + grace
            if self._drain_deadline is not None and self._drain_deadline <= deadline:
                return
            self._drain_deadline = deadline
            waiting, self._waiting = list(self._waiting), collections.deque()
            self.metrics.queue_depth.set(0)
            self._wake.notify()
        for ticket in waiting:
            ticket.send("shutdown", SHUTTING_DOWN)

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def capacity(self) -> int:
        """Requests the server takes at once: batch slots plus queue places."""
        return self.options["slots"] + self.max_queue

    def check(self, ids: list[int], sampling: dict[str, Any]) -> None:
        """Raise ``ValueError`` for a request the batch would refuse (pure: reads configs only;
        a prompt longer than the batch is refused before its ids are read one by one)."""
        assert self.batch is not None
        if len(ids) > self.batch.max_length:
            raise ValueError(f"The prompt ({len(ids)} tokens) plus max_new_tokens ({sampling['max_new_tokens']}) "
                             f"exceeds this server's maximum length of {self.batch.max_length} tokens.")
        self.batch.check(ids, **sampling)

    def submit(self, ticket: Ticket) -> None:
        with self._wake:
            if self._drain_deadline is not None:
                raise ShuttingDown(SHUTTING_DOWN)
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"The server's queue is full ({self.max_queue} requests waiting); retry shortly.")
            self._waiting.append(ticket)
            self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()

    def cancel(self, ticket: Ticket) -> None:
        """Stop ``ticket`` (a client that left, a stop string): its slot is freed at the next boundary."""
        with self._wake:
            if not ticket.cancelled:
                ticket.cancelled = True
                self._cancels.append(ticket)
                self._wake.notify()

    def reset_metrics(self, timeout: float = 30.0) -> bool:
        """Start the metrics afresh, on the engine thread at its next step boundary (so after
        everything the requests finished so far counted); False if that did not happen in time."""
        done = threading.Event()
        with self._wake:
            self._resets.append(done)
            self._wake.notify()
        return done.wait(timeout)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        first = True
        while not self._stopping:
            try:
                with self.engine.batch(**self.options) as batch:
                    self.batch = batch
                    self._seen = {"proposed": 0, "accepted": 0, "arms": {}}
                    if first:
                        lengths = self.warmup_lengths
                        if callable(lengths):
                            lengths = lengths(batch.max_length)
                        self.warmed_lengths = admissible_warmup_lengths(lengths, batch.max_length)
                        self.warmup_seconds = batch.warmup(self.warmed_lengths)
                        first = False
                        self._ready.set()
                    self._serve(batch)
            except BaseException as error:  # noqa: BLE001 — a failed step fails its requests, not the server
                if first:
                    self._startup_error = error
                    self._ready.set()
                    return
                log.exception("decode step failed; the running requests fail and the batch restarts")
                for ticket in self._running.values():
                    ticket.send("error", f"The decode step failed: {error}")
                    self.metrics.requests.labels("error").inc()
                self._running.clear()
                self.metrics.running.set(0)

    def _serve(self, batch: Batch) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    return
                cancels, self._cancels = self._cancels, []
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    cancels += self._end_running()
                for done in self._resets:
                    self.metrics.reset()
                    done.set()
                self._resets.clear()
                admitted: list[Ticket] = []
                budget = self.max_prefill_tokens
                while self._waiting and batch.free_slots - len(admitted) > 0:
                    ticket = self._waiting[0]
                    if admitted and len(ticket.ids) > budget:
                        break
                    self._waiting.popleft()
                    if ticket.cancelled:
                        continue
                    budget -= len(ticket.ids)
                    admitted.append(ticket)
                self.metrics.queue_depth.set(len(self._waiting))
                if not cancels and not admitted and not batch.running:
                    self._wake.wait(timeout=0.5)
                    continue
            for ticket in cancels:
                if ticket.handle is not None and self._running.pop(ticket.handle, None) is not None:
                    batch.cancel(ticket.handle)
                    if not ticket.answered:
                        self.metrics.requests.labels("cancelled").inc()
            for ticket in admitted:
                try:
                    ticket.handle = batch.add(ticket.ids, **ticket.sampling)
                except ValueError as error:  # this request alone
                    ticket.send("error", str(error))
                    self.metrics.requests.labels("error").inc()
                    continue
                self._running[ticket.handle] = ticket
                self.metrics.prompt_tokens.inc(len(ticket.ids))
            self.metrics.running.set(len(self._running))
            if admitted:
                self._dispatch(batch.flush())  # their first tokens now, not after the next step
            self._dispatch(batch.step())
            self.metrics.running.set(len(self._running))
            self._observe_stats(batch)

    def _end_running(self) -> list[Ticket]:
        """At the end of a shutdown's grace: tell every running request, and return their tickets to cancel."""
        ended = [t for t in self._running.values() if not t.cancelled]
        for ticket in ended:
            ticket.cancelled = ticket.answered = True
            ticket.send("shutdown", f"{SHUTTING_DOWN} The request was cut off at the end of the shutdown grace.")
        return ended

    def _dispatch(self, updates: list[RowUpdate]) -> None:
        """Send each request's new tokens and, when it finished, its end."""
        now = time.perf_counter()
        for update in updates:
            ticket = self._running.get(update.handle)
            if ticket is None:
                continue
            if update.tokens:
                self._observe(ticket, len(update.tokens), now)
                ticket.send("tokens", update.tokens)
            if update.finished:
                del self._running[update.handle]
                if update.error is not None:
                    ticket.send("error", update.error)
                    self.metrics.requests.labels("error").inc()
                else:
                    ticket.send("done", update.finish_reason)

    def _observe(self, ticket: Ticket, count: int, now: float) -> None:
        metrics = self.metrics  # (generated tokens are counted by the handler: only the text returned, app.py)
        if ticket.first_token is None:
            ticket.first_token = now
            metrics.ttft.observe(now - ticket.arrived)
            count -= 1
        elif ticket.last_token is not None:
            gap = (now - ticket.last_token) / count
            for _ in range(count):
                metrics.itl.observe(gap)
        ticket.last_token = now

    def _observe_stats(self, batch: Batch) -> None:
        stats, seen, metrics = batch.stats, self._seen, self.metrics
        metrics.proposed.inc(stats.proposed - seen["proposed"])
        metrics.accepted.inc(stats.accepted - seen["accepted"])
        seen["proposed"], seen["accepted"] = stats.proposed, stats.accepted
        for label, per in stats.per_arm.items():
            metrics.selections.labels(label).inc(per.steps - seen["arms"].get(label, 0))
            seen["arms"][label] = per.steps
        metrics.acceptance_rate.set(stats.acceptance_rate)
        metrics.tokens_per_step.set(stats.mean_tokens_per_step)
