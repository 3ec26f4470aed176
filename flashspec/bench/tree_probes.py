"""The parts of a draft-tree step, each timed on its own, for ``flashspec bench tree-anatomy``
(:mod:`flashspec.bench.tree_anatomy`; SPEC.md §7, "Tree steps are graphs too").

* :class:`StepProbe`: during ``generate_tree`` calls, each drafter's proposal and the step's work
  after the proposals (the engine's ``graphs.run`` of a ``("tree", ...)`` key: on CUDA a graph
  replay, elsewhere the same function run eagerly), each timed on the host clock with the device
  synchronised right before and right after it — so a time holds the device's work, not only its
  launch. Synchronising inside the step changes the step's own time, so the probed calls' step
  times are not used; only the probe's timings of warm steps are kept (a cold step captured a
  graph or compiled: SPEC.md §8).
* :func:`replay_seconds`: the step's CUDA graph replayed alone (CUDA events).
* :func:`tree_forward_seconds`: the target's ``tree_forward`` alone over a tree of the step's parts,
  in a CUDA graph of its own on CUDA (the host clock elsewhere).
* :func:`drafter_forward_seconds`: a drafter's model forwards alone, at the widths of one proposal.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..drafters.feature import FeatureDrafter
from ..drafters.model import ModelDrafter
from ..models.graphs import Graphs
from ..models.static import StaticLM
from ..models.tree import tree_forward
from ..stats import StepRecord
from ..tuning.timing import cached_forward_seconds, forward_seconds, median_round_seconds, synchronize
from .gpu import _FedForward

__all__ = ["StepProbe", "drafter_forward_seconds", "has_network", "host_seconds", "replay_seconds",
           "tree_forward_seconds"]

_MISSING = object()


def host_seconds(fn: Callable[[], Any], device: torch.device, rounds: int) -> float:
    """The median of ``rounds`` host-clock calls of ``fn`` after an untimed one, the device
    synchronised around each."""
    fn()
    times = []
    for _ in range(rounds):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class StepProbe:
    """Times each drafter's proposal and each tree step's work after the proposals while
    :meth:`watching` (see the module docstring); :meth:`keep` after each call keeps its warm
    steps' timings. ``proposals[name]`` and ``after`` hold seconds; ``keys`` counts the graph
    keys the steps ran."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.device = engine, engine.target.device
        self.proposals: dict[str, list[float]] = {d.name: [] for d in engine.drafters}
        self.after: list[float] = []
        self.keys: Counter[Hashable] = Counter()
        self._pending: dict[str, list[float]] = {name: [] for name in self.proposals}
        self._pending_after: list[float] = []

    def _timed(self, fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
        device = self.device

        def call(*args: Any, **kwargs: Any) -> Any:
            synchronize(device)
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            synchronize(device)
            into.append(time.perf_counter() - started)
            return out

        return call

    @contextmanager
    def watching(self) -> Iterator[StepProbe]:
        """Wrap the drafters' ``propose`` and ``expand`` and the engine's ``graphs.run`` (instance
        attributes over the class's methods), put back on leaving."""
        patched: list[tuple[Any, str, Any]] = []

        def patch(obj: Any, name: str, new: Any) -> None:
            patched.append((obj, name, vars(obj).get(name, _MISSING)))
            setattr(obj, name, new)

        graphs = self.engine._graphs
        run = graphs.run
        timed_run = self._timed(run, self._pending_after)

        def probed_run(key: Hashable, fn: Callable[[], Any], warm: bool = False) -> Any:
            if not (isinstance(key, tuple) and key and key[0] == "tree"):
                return run(key, fn, warm)
            self.keys[key] += 1
            return timed_run(key, fn, warm)

        try:
            for drafter in self.engine.drafters:
                for method in ("propose", "expand"):
                    if callable(getattr(drafter, method, None)):
                        patch(drafter, method, self._timed(getattr(drafter, method), self._pending[drafter.name]))
            patch(graphs, "run", probed_run)
            yield self
        finally:
            for obj, name, before in reversed(patched):
                if before is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, before)

    def keep(self, log: Sequence[StepRecord]) -> None:
        """Keep the timings of the call whose steps are ``log`` where the step was warm (one
        proposal per drafter and one run of the step's work per step; where the counts differ,
        every timing is kept), and start the next call afresh."""
        warm = [not r.cold for r in log]
        for name, times in [*self._pending.items(), ("", self._pending_after)]:
            kept = [t for t, w in zip(times, warm) if w] if len(times) == len(warm) else list(times)
            (self.proposals[name] if name else self.after).extend(kept)
            times.clear()

    def key(self) -> Hashable | None:
        """The graph key the probed steps ran most (one per allocation and sampling parameters)."""
        return self.keys.most_common(1)[0][0] if self.keys else None


def replay_seconds(graphs: Graphs, key: Hashable | None, rounds: int) -> float | None:
    """Median seconds of one replay of the CUDA graph captured for ``key`` (CUDA events, rounds of
    about 20 ms, ``rounds`` of them); None where no graph was captured (no CUDA graphs here).
    A tree step's graph is safe to replay once its call has ended: every row is finished, so it
    scores, verifies and copies the last step's tree again and commits nothing."""
    if key is None or not graphs.enabled or key not in graphs:
        return None

    def never() -> Any:
        raise AssertionError(f"no graph for {key!r}")

    return median_round_seconds(lambda _: graphs.run(key, never), rounds=rounds)


def _chains(sizes: Sequence[int], batch: int, device: torch.device) -> torch.Tensor:
    """``parents [B, Σ sizes]``: each part a chain from the root, one after the other."""
    parents, offset = [], 0
    for n in sizes:
        local = torch.arange(-1, n - 1)
        parents.append(torch.where(local >= 0, local + offset, -1))
        offset += n
    return torch.cat(parents).to(device).expand(batch, -1).contiguous()


def tree_forward_seconds(engine: Any, sizes: Sequence[int], context: int, rounds: int) -> float:
    """Seconds of the target's :func:`~flashspec.models.tree.tree_forward` over a tree whose parts
    have ``sizes`` nodes (each a chain from the root: a forward's work depends on its width, not on
    the tree's shape, since its mask is dense), rooted at position ``context``, over the engine's
    cache as its last call left it (rows and capacity: the step's) and with its feature buffers
    where drafters read them. On CUDA captured in a graph of its own and replayed; elsewhere the
    host clock. It writes the root's keys, values and features at ``context``, nothing a finished
    call still needs."""
    lm: StaticLM = engine.target_lm
    device = next(lm.model.parameters()).device
    batch, capacity, vocab = lm.batch, lm.capacity, lm.base.embed_tokens.num_embeddings
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, sum(sizes) + 1), generator=generator).to(device)
    parents = _chains(sizes, batch, device)
    start = torch.full((batch,), min(context, capacity - 2), dtype=torch.long, device=device)
    workspace = getattr(engine, "_buffers", None)
    hidden = None if workspace is None else workspace.hidden
    features = {} if hidden is None else {"hidden_out": hidden}

    def forward() -> torch.Tensor:
        return tree_forward(lm, tokens, parents, start, check=False, **features)[0]

    if device.type != "cuda":
        return host_seconds(forward, device, rounds)
    graphs = Graphs(enabled=True)
    try:
        graphs.run("tree forward", forward)  # eager, then captured
        return median_round_seconds(lambda _: graphs.run("tree forward", forward), rounds=rounds)
    finally:
        graphs.clear()


def _network(drafter: Any) -> tuple[Any, int] | None:
    """A drafter's network as :func:`forward_seconds` times it, with the width of a proposal's first
    forward (a model drafter's steady catch-up of 2 tokens, a feature head's narrowest window);
    None for a drafter with no network of its own over FlashSpec's static cache."""
    if isinstance(drafter, FeatureDrafter):
        return (_FedForward(drafter), drafter.MIN_WINDOW) if isinstance(drafter.lm, StaticLM) else None
    if isinstance(drafter, ModelDrafter):
        lm = getattr(drafter, "_lm", None)
        return (lm, 2) if isinstance(lm, StaticLM) else None
    return None


def has_network(drafter: Any) -> bool:
    """Whether a drafter's proposal runs a model (a model drafter, a feature or EAGLE-3 head)."""
    return isinstance(drafter, (FeatureDrafter, ModelDrafter))


def drafter_forward_seconds(drafter: Any, gamma: int, width: int, batch: int, context: int, rounds: int,
                            memo: dict[tuple[int, int], float]) -> float | None:
    """Seconds of the model forwards of one proposal of ``drafter`` at depth ``gamma``: its first
    forward (see :func:`_network`), then ``gamma − 1`` forwards of ``width`` tokens (1 for a chain,
    ``topk`` for an expansion's levels), at ``context`` cached positions — graph replays on CUDA
    (:func:`~flashspec.tuning.timing.forward_seconds`), the host clock elsewhere. 0 for a drafter
    without a model (n-gram, datastore); None for one whose network cannot be run alone here.
    ``memo`` keeps each (drafter, width)'s time across calls. The drafter's cache is overwritten
    past ``context``; its next request re-feeds what it reads."""
    if not has_network(drafter):
        return 0.0
    network = _network(drafter)
    if network is None:
        return None
    lm, first = network

    def seconds(w: int) -> float:
        if (id(drafter), w) not in memo:
            if next(lm.model.parameters()).device.type == "cuda":
                memo[id(drafter), w] = forward_seconds(lm, batch, w, context)
            else:
                memo[id(drafter), w] = cached_forward_seconds(lm, batch, w, context, repeats=rounds)
        return memo[id(drafter), w]

    return seconds(first) + (gamma - 1) * (seconds(width) if gamma > 1 else 0.0)
