"""Capturing a tree step's graphs before any request (SPEC.md §7, "Warm tree layouts").

A tree step replays one CUDA graph per layout of its parts (:mod:`~flashspec.decode.tree_graph`);
the first step of a layout captures it, inside whatever request meets it first. ``gammas="auto"``
may choose any of its budget's candidate allocations, so :func:`warm_trees` runs every one of them
once, in one scripted call per batch size and sampling mode, before the requests come.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checks import check_int
from ..select.tree_budget import Allocation, TreeBudget
from .request import MAX_DRAFT_TOKENS
from .tree_loop import check_tree_engine

__all__ = ["PROMPT_TOKENS", "SAMPLED", "warm_trees"]

PROMPT_TOKENS = 64  # as the chain warm-up's prompt (flashspec.decode.warmup)
NEW_TOKENS = 32  # per warm-up call: short calls, so that the buffers have a request's usual size
SAMPLED = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}  # a sampled request's layouts (laws staged)


class _Script(TreeBudget):
    """A budget that plays ``allocations`` in order (then the target alone) and learns nothing."""

    def __init__(self, gamma_max: Sequence[int], allocations: list[Allocation]) -> None:
        super().__init__(gamma_max, explore_every=None)
        self.script, self.played = allocations, 0

    def choose(self, context: Any = None) -> Allocation:
        self.played += 1
        if self.played <= len(self.script):
            return self.script[self.played - 1]
        return tuple(0 for _ in self.gamma_max)

    def observe(self, *args: Any, **kwargs: Any) -> None:
        pass


def layouts(gamma_max: Sequence[int]) -> list[Allocation]:
    """The allocations a ``gammas="auto"`` budget of ``gamma_max`` may choose: its candidates (with
    more than it evaluates at once, every drafter alone at each of its values and every drafter at
    its γ_max), the target-only step first."""
    budget = TreeBudget(gamma_max)
    if budget.candidates is not None:
        return list(budget.candidates)
    zeros = tuple(0 for _ in gamma_max)
    out = [zeros, tuple(gamma_max)]
    for i, values in enumerate(budget.values):
        out += [zeros[:i] + (v,) + zeros[i + 1:] for v in values if v]
    return list(dict.fromkeys(out))


def warm_trees(engine: Any, *, batch_sizes: Sequence[int] = (1,), gamma_max: Sequence[int] | None = None,
               expand: Mapping[str, Any] | None = None, sampling: Sequence[Mapping[str, Any]] = ({}, SAMPLED),
               extra: Sequence[Sequence[int]] = ()) -> float:
    """Run every layout ``engine.generate_tree(gammas="auto", expand=expand)`` may step through (and
    the ``extra`` allocations, e.g. fixed draft lengths to be served) at each of ``batch_sizes``
    rows and with each of ``sampling``'s keywords (default: greedy, and :data:`SAMPLED`; a graph is
    keyed by the sampling parameters), so that each one's graph is captured now; returns the seconds
    taken (0 where the engine replays no graphs: a CPU). ``gamma_max``: the budget's (default: each
    drafter's largest γ, as ``gammas="auto"`` takes it). The engine's budget and guard memory are put
    back afterwards: nothing is learned here. It swaps ``engine.tree_budget`` while it runs: call it
    before other threads use the engine, as the engine's own warm-up is."""
    if not engine._graphs.enabled:
        return 0.0
    for rows in batch_sizes:
        check_int("batch_sizes", rows, 1, 1024)
    top = check_tree_engine(engine, None if gamma_max is None else list(gamma_max), 4)
    script = layouts(top)
    for allocation in extra:
        allocation = tuple(allocation)
        if len(allocation) != len(top) or any(isinstance(g, bool) or not isinstance(g, int)
                                              or not 0 <= g <= MAX_DRAFT_TOKENS for g in allocation):
            raise ValueError(f"extra allocations need one draft length per drafter ({len(top)}), each from 0 to "
                             f"{MAX_DRAFT_TOKENS}; got {allocation!r}.")
        if allocation not in script:
            script.append(allocation)
    deepest = tuple(max([t, *(a[i] for a in map(tuple, extra))]) for i, t in enumerate(top))  # room for each
    ids = torch.randint(0, engine.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    kept = getattr(engine, "tree_budget", None), getattr(engine, "tree_guard_memory", None)
    started = time.perf_counter()
    try:
        for rows in batch_sizes:
            for options in sampling:
                engine.tree_budget = played = _Script(deepest, script)
                while played.played < len(script):  # a call ends when its rows are full; the next goes on
                    engine.generate_tree([ids] * rows, gammas="auto", expand=expand, slack=None, eos_token_id=[],
                                         max_new_tokens=NEW_TOKENS, seed=0, **options)
    finally:
        engine.tree_budget, engine.tree_guard_memory = kept
    return time.perf_counter() - started
