"""Top-k expansion of a drafter into a draft tree: EAGLE-2's dynamic draft tree (SPEC.md §7, "Top-k
expansion of a feature drafter").

From the drafter's logits at the pending token, :func:`expand_tree` grows a tree depth by depth: the
``K`` frontier nodes of a depth are fed to the drafter at once (through the ``step`` it is given),
each offers its ``K`` most probable children, and the ``K`` children of highest *value* — the sum of
the log draft probabilities along their path — are the next frontier. The ``N`` candidates of
highest value over all depths are the tree (closed under ancestors: a child's value is never above
its parent's, and ties go to the earlier-made node). Every node is a point mass (a chosen token), so
the tree walk verifies it exactly (SPEC.md §2).

All tensor operations with shapes fixed by ``(D, K, N)``; nothing is read back to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..checks import check_int
from ..sampling import SamplingParams, process_logits
from .base import History

__all__ = ["MAX_NODES", "MAX_TOPK", "ExpandedDraft", "ExpandsTrees", "Step", "TreeExpansion", "candidates",
           "expand_tree"]

MAX_TOPK = 64  # children per fed node: K sorts of the draft vocabulary per depth
MAX_NODES = 256  # nodes of one drafter's tree: the target scores every node of the step's tree


def candidates(depth: int, topk: int) -> int:
    """How many nodes an expansion of depth ``depth`` with ``topk`` children per node makes:
    ``K + (D − 1)·K²``; the tree keeps at most that many."""
    return topk + (depth - 1) * topk * topk


@dataclass(frozen=True)
class TreeExpansion:
    """How a drafter expands its part of a step's draft tree: ``topk`` children per fed node (and
    frontier nodes per depth), ``nodes`` kept after the rerank. The depth is the drafter's γ."""

    topk: int
    nodes: int

    def __post_init__(self) -> None:
        check_int("topk", self.topk, 1, MAX_TOPK)
        check_int("nodes", self.nodes, 1, MAX_NODES)

    def check(self, depth: int, vocab: int, name: str) -> None:
        """``ValueError`` unless drafter ``name`` (draft vocabulary ``vocab``) can expand so at ``depth``."""
        if self.topk > vocab:
            raise ValueError(f"expand[{name!r}] asks for topk={self.topk}; the drafter's draft vocabulary has "
                             f"{vocab} tokens.")
        if self.nodes > candidates(depth, self.topk):
            raise ValueError(f"expand[{name!r}] asks for nodes={self.nodes}; a tree of depth {depth} (the drafter's "
                             f"γ) with topk={self.topk} makes at most {candidates(depth, self.topk)} "
                             f"(topk + (depth − 1)·topk²).")


@dataclass
class ExpandedDraft:
    """A drafter's expanded tree, ``[B, N]`` each: ``tokens`` (target ids), ``parents`` (``-1``:
    the root, the pending token; else an earlier node), ``depths`` (a child of the root is at 1) and
    ``values`` (the sum of the log draft probabilities along the node's path)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    values: torch.Tensor


@runtime_checkable
class ExpandsTrees(Protocol):
    """A drafter that can make a top-k draft tree for a tree step (SPEC.md §4, §7)."""

    draft_vocab_size: int

    def expand(self, history: History, depth: int, topk: int, nodes: int, params: SamplingParams) -> ExpandedDraft:
        ...


Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``step(tokens [B, K], parents [B, K], sees [B, K, M], depth) -> logits [B, K, V]``: feed the
frontier nodes of ``depth`` (their parents as fed slots, ``-1`` for the root; ``sees``: which of the
``M`` nodes fed before are their ancestors) and return the draft logits after each."""


def _log_law(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log draft probabilities (float32, ``≤ 0``, so that no child is worth more than its parent):
    greedy, ``log_softmax`` of the raw logits (T = 1); sampling, of the processed ones (SPEC.md §1;
    ``-inf`` where a token is removed)."""
    return torch.log_softmax(process_logits(logits, params), dim=-1).clamp(max=0.0)


def _best(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``values [..., n]`` and their indices, ties to the lower index."""
    ranked, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return ranked[..., :k], order[..., :k]


def expand_tree(root_logits: torch.Tensor, step: Step, depth: int, topk: int, nodes: int, params: SamplingParams,
                vocab: torch.Tensor | None = None) -> ExpandedDraft:
    """EAGLE-2's expansion (SPEC.md §7): ``root_logits [B, V]`` are the drafter's logits at the
    pending token, over its draft vocabulary (``vocab [V]``: the target id of each; None: the ids
    themselves); ``step`` feeds a depth's frontier. Returns the ``nodes`` best of the
    ``K + (D − 1)·K²`` candidates in the order they were made."""
    batch, device = root_logits.shape[0], root_logits.device
    k = topk

    def ids(index: torch.Tensor) -> torch.Tensor:
        return index if vocab is None else vocab[index]

    value, index = torch.topk(_log_law(root_logits, params), k, dim=-1)  # [B, K]: depth 1
    tokens, values = [ids(index)], [value]
    parents = [torch.full((batch, k), -1, dtype=torch.long, device=device)]
    levels = [torch.ones(batch, k, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device).expand(batch, k)  # candidate indices
    worth = value  # the frontier's values
    made = k
    fed = (depth - 1) * k
    slot_of = torch.full((batch, candidates(depth, k)), -1, dtype=torch.long, device=device)
    ancestors = torch.zeros(batch, fed, fed, dtype=torch.bool, device=device)  # among fed nodes
    for d in range(1, depth):
        every_parent, every_token = torch.cat(parents, dim=1), torch.cat(tokens, dim=1)
        slots = torch.arange((d - 1) * k, d * k, device=device)
        up = every_parent.gather(1, frontier)  # the frontier's parents (candidate indices; -1: the root)
        up_slot = torch.where(up >= 0, slot_of.gather(1, up.clamp(min=0)), -1)
        before = (d - 1) * k
        sees = ancestors[:, :, :before].gather(1, up_slot.clamp(min=0)[..., None].expand(-1, -1, before))
        sees = (sees | (torch.arange(before, device=device) == up_slot[..., None])) & (up_slot >= 0)[..., None]
        ancestors[:, slots, :before] = sees
        slot_of.scatter_(1, frontier, slots.expand(batch, k))
        logits = step(every_token.gather(1, frontier), up_slot, sees, d)  # [B, K, V]
        child, index = torch.topk(_log_law(logits, params), k, dim=-1)  # [B, K, K]
        child = worth[..., None] + child
        tokens.append(ids(index).flatten(1))
        values.append(child.flatten(1))
        parents.append(frontier[..., None].expand(-1, -1, k).flatten(1))
        levels.append(torch.full((batch, k * k), d + 1, dtype=torch.long, device=device))
        worth, best = _best(values[-1], k)
        frontier = made + best
        made += k * k
    every_value = torch.cat(values, dim=1)
    _, chosen = _best(every_value, nodes)
    chosen = chosen.sort(dim=1).values  # the order they were made: parents first
    rank = torch.full_like(every_value, -1, dtype=torch.long).scatter_(
        1, chosen, torch.arange(nodes, device=device).expand(batch, nodes))
    up = torch.cat(parents, dim=1).gather(1, chosen)
    tree_parents = torch.where(up >= 0, rank.gather(1, up.clamp(min=0)), -1)
    return ExpandedDraft(torch.cat(tokens, dim=1).gather(1, chosen), tree_parents,
                         torch.cat(levels, dim=1).gather(1, chosen), every_value.gather(1, chosen))
