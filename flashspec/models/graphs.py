"""Replaying a step's GPU work as one CUDA graph instead of hundreds of kernel launches.

A decode step at batch 1 launches hundreds of small kernels; on a fast GPU, launching them from
Python costs more than running them. :class:`Graphs` runs a tensor function eagerly the first
time it sees a key (that call *is* the real work: lazy initialisation and Triton compilation
happen there), captures it into a CUDA graph right after, and replays the graph on every later
call with that key.

The function must read and write only tensors whose storage outlives the graph (persistent
buffers, updated in place), must not read values back to the host, and must depend on Python
values only through the key. Captured outputs are the graph's own static tensors: they are
overwritten by the next replay of the same key.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch

__all__ = ["Graphs", "compile_events", "window_widths"]

_collected = False  # whether a capture in this process has run torch's gc.collect + empty_cache
_captures = 0  # CUDA graphs captured in this process


def compile_events() -> int:
    """How many one-off costs this process has paid so far: CUDA graphs captured and frames
    compiled by ``torch.compile``. A step during which this grows is a *cold* step: its time is
    not what the step costs from then on (SPEC.md §8, "Steady costs only"). Host arithmetic
    only: no device read."""
    frames = 0
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is not None:
        frames = dynamo.counters["stats"]["unique_graphs"]
    return _captures + frames


@contextlib.contextmanager
def _capture_without_collecting() -> Iterator[None]:
    """``torch.cuda.graph`` runs ``gc.collect()`` and ``torch.cuda.empty_cache()`` before every
    capture; in a large process (a server) that is a few hundred ms per graph, and a warm-up
    captures a hundred or more. As vLLM does, only the first capture of the process runs them."""
    global _collected
    if not _collected:
        _collected = True
        yield
        return
    with mock.patch("gc.collect", lambda *args, **kwargs: 0), mock.patch("torch.cuda.empty_cache", lambda: None):
        yield


def _count_capture() -> None:
    global _captures
    _captures += 1


def window_widths(capacity: int, smallest: int = 4) -> list[int]:
    """Every catch-up window a proposal over a cache of ``capacity`` positions may take: the
    powers of two from ``smallest`` below the capacity, then the capacity (SPEC.md §7, §11:
    one CUDA graph per width, all captured together)."""
    widths, width = [], smallest
    while width < capacity:
        widths.append(width)
        width *= 2
    return widths + [capacity]


class Graphs:
    """Capture-on-second-use CUDA graphs keyed by the caller; plain calls when disabled.
    ``limit``: the most graphs kept (None: no bound); a capture past it drops every graph."""

    def __init__(self, enabled: bool, limit: int | None = None) -> None:
        self.enabled = enabled
        self.limit = limit  # at most this many graphs: a capture past it drops them all first
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pool = torch.cuda.graph_pool_handle() if enabled else None
        self._reads: tuple[Any, ...] = ()  # what the captured graphs read (see reading)

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        """Whether a graph was captured for ``key``."""
        return key in self._graphs

    def run(self, key: Hashable | None, fn: Callable[[], Any], warm: bool = False) -> Any:
        """``fn()``, replayed from a CUDA graph when one was captured for ``key`` (never
        captured when ``key`` is None). ``warm``: replay a new graph once right after capturing
        it, so that no later call pays its first replay, which costs more than the others (on
        the H200, 1.3–1.7 ms more for a 1.5B model's prefill: BENCHMARKS.md, "The server"); only
        for an ``fn`` that is harmless to repeat."""
        if not self.enabled or key is None:
            return fn()
        entry = self._graphs.get(key)
        if entry is not None:
            graph, outputs = entry
            graph.replay()
            return outputs
        if self.limit is not None and len(self._graphs) >= self.limit:
            self.clear()
        result = fn()  # the real work of this call, eagerly; warms up kernels and libraries
        _count_capture()
        graph = torch.cuda.CUDAGraph()
        with _capture_without_collecting(), torch.cuda.graph(graph, pool=self._pool):
            outputs = fn()  # recorded, not executed
        self._graphs[key] = (graph, outputs)
        if warm:
            graph.replay()
        return result

    def run_widths(self, widths: Sequence[int], width: int, key: tuple, fn: Callable[[int], Any],
                   repeatable: bool = False) -> Any:
        """``fn(width)``, replayed from the graph keyed ``(width, *key)``. The first time ``key``
        meets these buffers, the graphs of every other width in ``widths`` are captured first
        (and warmed: replayed once, see :meth:`run`), so that no later call of another width
        captures one inside a request (SPEC.md §11, "Every proposal is a graph"). ``fn(w)`` must
        be harmless to run, even twice, for any ``w`` before ``fn(width)`` runs (the drafters'
        windows re-feed committed positions). ``repeatable``: ``fn(width)`` is harmless to
        repeat too (a prefill), so its graph is warmed as well."""
        if self.enabled:
            for other in widths:
                if other != width and (other, *key) not in self:
                    self.run((other, *key), lambda w=other: fn(w), warm=True)
        return self.run((width, *key), lambda: fn(width), warm=repeatable)

    def reading(self, *inputs: Any) -> None:
        """Say which buffers the next call's function reads (tensors, by storage; other values as
        they are): when they are not those the captured graphs read, every graph is dropped, since
        a replay would read memory that may have been freed."""
        key = tuple(t.data_ptr() if isinstance(t, torch.Tensor) else t for t in inputs)
        if key != self._reads:
            self.clear()
            self._reads = key

    def clear(self) -> None:
        """Drop every captured graph (their buffers go with them). The memory pool goes too:
        PyTorch frees a private pool once no graph uses it, and capturing into a freed pool's
        handle trips an internal assertion, so later captures get a fresh pool."""
        self._graphs.clear()
        if self.enabled:
            self._pool = torch.cuda.graph_pool_handle()
