"""How the benchmarks take their times: one small set of timers that every benchmark uses.

Host clock (any device, the device synchronised around the timed call):

* :func:`synchronize` waits for a CUDA device's queued work (nothing to do on the CPU);
* :func:`best_seconds`: the fastest of a few calls, the least disturbed estimate on a shared
  machine (other work only ever adds time);
* :func:`measured`: the wall time of a block and, on CUDA, its peak memory.

CUDA events (GPU time of queued work; these need a CUDA device):

* :func:`event_seconds`: the median over rounds of the time per call of a round of calls;
* :func:`median_round_seconds`: the same after a warm-up, with rounds sized to a target length;
* :func:`alternating`: that for several candidates whose rounds alternate (a, b, a, b, ...);
* :func:`graph_replay_seconds`: calls captured in one CUDA graph and replayed (no launch costs);
* :func:`forward_seconds`: one cached model forward, replayed from a CUDA graph as the engine
  runs it (SPEC.md §7).

Both: :func:`cached_forward_seconds` times one cached forward as the engine runs it on its device
(a graph replay for a ``StaticLM`` on CUDA, else the host clock after a prefill).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "alternating",
    "best_seconds",
    "cached_forward_seconds",
    "event_seconds",
    "forward_seconds",
    "graph_replay_seconds",
    "measured",
    "median_round_seconds",
    "synchronize",
]


# ----------------------------------------------------------------------------- host clock
def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued on it (CUDA; a no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls after an untimed one: on a shared machine other
    work only ever adds time, so the minimum is the least disturbed estimate."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return min(times)


@contextmanager
def measured(device: torch.device) -> Iterator[dict[str, Any]]:
    """Time the body: yields a dict that holds ``start`` (``time.perf_counter()`` when the body
    began) and, after it, ``seconds`` (its wall time, synchronised on CUDA) and, on CUDA,
    ``peak`` (``max_memory_allocated`` during it) and ``growth`` (``peak`` minus what was
    allocated when it began); both ``None`` elsewhere."""
    box: dict[str, Any] = {"peak": None, "growth": None}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    box["start"] = time.perf_counter()
    yield box
    if cuda:
        torch.cuda.synchronize(device)
    box["seconds"] = time.perf_counter() - box["start"]
    if cuda:
        box["peak"] = torch.cuda.max_memory_allocated(device)
        box["growth"] = box["peak"] - before


# ----------------------------------------------------------------------------- CUDA events
def event_seconds(fn: Callable[[int], Any], calls_per_round: int, rounds: int) -> float:
    """Median over ``rounds`` of the CUDA-event time of ``calls_per_round`` calls, per call (s).

    ``fn`` is given the call's index, counted over all rounds (``r * calls_per_round + i``), so
    that it can rotate through input sets."""
    times = []
    for r in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls_per_round):
            fn(r * calls_per_round + i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls_per_round)
    return statistics.median(times)


def median_round_seconds(fn: Callable[[int], Any], target_round_s: float = 0.02, rounds: int = 7) -> float:
    """Warm up, size the rounds to ~``target_round_s``, return the median seconds per call."""
    return alternating([fn], target_round_s, rounds)[0]


def alternating(fns: list[Callable[[int], Any]], target_round_s: float = 0.02, rounds: int = 7) -> list[float]:
    """Median seconds per call of each of ``fns``, their timed rounds alternating (a, b, a, b,
    ...), so that a host or GPU that slows down for a while slows every candidate alike.

    Each is warmed up and its rounds sized to ~``target_round_s`` first (5 to 200 calls)."""
    calls = []
    for fn in fns:
        for i in range(3):
            fn(i)
        torch.cuda.synchronize()
        estimate = event_seconds(fn, 3, 1)
        calls.append(int(min(200, max(5, target_round_s / max(estimate, 1e-7)))))
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for j, fn in enumerate(fns):  # round r continues where round r - 1 stopped (input sets rotate)
            times[j].append(event_seconds(lambda i, fn=fn, first=r * calls[j]: fn(first + i), calls[j], 1))
    return [statistics.median(t) for t in times]


def graph_replay_seconds(calls: list[Callable[[], Any]]) -> float:
    """Seconds per call when ``calls`` are captured in one CUDA graph and the graph is replayed
    (:func:`median_round_seconds` of the replays over ``len(calls)``): launch costs gone."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    try:
        return median_round_seconds(lambda _: graph.replay()) / len(calls)
    finally:
        del graph
        torch.cuda.empty_cache()


def forward_seconds(lm: Any, batch: int, width: int, context: int, iters: int = 50, layers: int | None = None) -> float:
    """Median seconds of one forward of a :class:`flashspec.models.static.StaticLM` over ``width`` new
    tokens of ``batch`` rows after ``context`` cached positions, replayed from a CUDA graph as
    the engine runs it (two untimed runs capture it); CUDA events, ``iters`` rounds of one.
    ``layers``: the first ``layers`` layers only, no head (a shallow drafter's shared part)."""
    from ..models.graphs import Graphs

    device = lm.model.device
    lm.reset(batch, context + width + 1)
    tokens = torch.randint(0, lm.model.config.vocab_size, (batch, width), device=device)
    start = torch.full((batch,), context, dtype=torch.long, device=device)
    graphs = Graphs(enabled=True)

    def forward() -> torch.Tensor:
        return lm.forward(tokens, start) if layers is None else lm.layer_states(tokens, start, layers)

    for _ in range(2):
        graphs.run("forward", forward)
    return event_seconds(lambda _: graphs.run("forward", forward), 1, iters)


def cached_forward_seconds(lm: Any, batch: int, width: int, context: int, repeats: int = 5,
                           capacity: int | None = None, generator: torch.Generator | None = None) -> float:
    """Seconds of one forward of ``lm`` (a :class:`flashspec.models.static.StaticLM` or ``CachedLM``) over
    ``width`` new random tokens of ``batch`` rows after ``context`` cached positions. A StaticLM
    on CUDA: :func:`forward_seconds` (a graph replay: timed eagerly, a batch-1 forward measures
    Python's kernel launches). Else: the cache reset to ``capacity`` positions (default
    ``context + width + 1``), ``context`` random tokens prefilled, then the best of ``repeats``
    host-clock calls. Either way ``lm``'s cache is reset and overwritten."""
    from ..models.static import StaticLM

    device = lm.model.device
    if device.type == "cuda" and isinstance(lm, StaticLM):
        return forward_seconds(lm, batch, width, context)
    vocab = lm.model.config.vocab_size
    lm.reset(batch, capacity if capacity is not None else context + width + 1)
    zero = torch.zeros(batch, dtype=torch.long, device=device)
    if context:
        prefix = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
        lm.forward(prefix, zero, logits_at=zero[:, None] + context - 1)
    new = torch.randint(0, vocab, (batch, width), generator=generator).to(device)
    return best_seconds(lambda: lm.forward(new, zero + context), device, repeats)
