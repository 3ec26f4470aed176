"""A tree step's draft tree from the drafters' parts, and what each part would have had accepted
(SPEC.md §7, "Draft trees in the decode loop", "Top-k expansion of a feature drafter").

A part is a drafter's chain (``γ`` tokens, with the laws they were drawn from when sampling) or its
top-k expansion (``N`` chosen nodes with parents inside the part). Greedy steps merge equal chosen
siblings across parts; sampled steps join the parts unmerged, each from the root. Every tree is
built with the unchecked constructors: valid by construction, and nothing is read back to the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..draft_tree import DraftTree, TreeVerifyResult, merge_chosen, tree_from_chains
from ..drafters.base import Drafter
from ..drafters.expansion import ExpandedDraft, ExpandsTrees, TreeExpansion
from ..verify import VerifyResult

__all__ = ["Part", "check_expand", "expanded_part", "greedy_tree", "part_counts", "sampled_tree", "step_tree"]


@dataclass
class Part:
    """One drafter's part of a step's tree: ``tokens [B, n]``; for a chain, ``laws [B, n, V]`` when
    its tokens were drawn (else point masses); for an expansion, ``parents [B, n]`` (``-1``: the
    root, else a node of the part), ``depths [B, n]`` and the deepest level ``depth``."""

    tokens: torch.Tensor
    laws: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    depth: int = 0

    @property
    def nodes(self) -> int:
        return self.tokens.shape[1]


def check_expand(drafters: Sequence[Drafter], expand: Any, gammas: Sequence[int]) -> dict[int, TreeExpansion]:
    """``expand`` (``{drafter name: TreeExpansion or (topk, nodes)}``, or None) as ``{drafter index:
    TreeExpansion}``, checked against the drafters and their depths ``gammas`` (with ``"auto"``,
    their largest); ``ValueError`` sentences otherwise."""
    if expand is None:
        return {}
    if not isinstance(expand, Mapping):
        raise ValueError(f"expand must map drafter names to TreeExpansion(topk, nodes); got {expand!r}.")
    names = [d.name for d in drafters]
    out: dict[int, TreeExpansion] = {}
    for name, option in expand.items():
        if name not in names:
            raise ValueError(f"expand names {name!r}, which is not a drafter of this engine "
                             f"({', '.join(map(repr, names))}).")
        i = names.index(name)
        if not isinstance(drafters[i], ExpandsTrees):
            raise ValueError(f"Drafter {name!r} cannot expand a draft tree; top-k expansion needs a feature or "
                             "EAGLE-3 head (feature:DIR, eagle3:DIR), or the n-gram drafter (several continuations).")
        if isinstance(option, tuple) and len(option) == 2:
            option = TreeExpansion(*option)
        if not isinstance(option, TreeExpansion):
            raise ValueError(f"expand[{name!r}] must be a TreeExpansion(topk, nodes) or a (topk, nodes) pair; "
                             f"got {option!r}.")
        option.check(gammas[i], drafters[i].draft_vocab_size, name)
        out[i] = option
    return out


def expanded_part(name: str, tree: ExpandedDraft, depth: int) -> Part:
    """A drafter's expansion (its tokens' shape already checked) as a part, once its parents and
    depths have the tokens' shape and integer type (checked on the host: nothing is read)."""
    for field in ("parents", "depths"):
        value = getattr(tree, field, None)
        if (not isinstance(value, torch.Tensor) or value.shape != tree.tokens.shape or value.dtype != torch.long
                or value.device != tree.tokens.device):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"Drafter {name!r} returned an expansion whose {field} are {shape}; they must be a "
                             f"torch.long tensor of its tokens' shape {tuple(tree.tokens.shape)}.")
    return Part(tree.tokens.long(), parents=tree.parents, depths=tree.depths, depth=depth)


def sampled_tree(chains: list[torch.Tensor], laws: list[torch.Tensor | None]) -> DraftTree:
    """The tree of a sampled step: each drafter's chain ``[B, γ_i]`` its own branch from the root, in
    drafter order, with the law each token was drawn from (``laws[i] [B, γ_i, V]``), or as point
    masses where the drafter gives none (n-gram, datastore). Drawn siblings are never merged: a
    repeated token is tested against the residual (SPEC.md §2, "Duplicates")."""
    return step_tree([Part(c, q) for c, q in zip(chains, laws)], sample=True)


def greedy_tree(chains: list[torch.Tensor]) -> DraftTree:
    """The tree of a greedy step: the chains (point masses) merged where they agree
    (:func:`~flashspec.draft_tree.tree_from_chains`; chain ``i``'s token ``d`` is node ``i·L + d``,
    ``L`` the longest γ)."""
    depth = max(c.shape[1] for c in chains)
    if all(c.shape[1] == depth for c in chains):
        return tree_from_chains(torch.stack(chains, dim=1), check=False)
    padded = torch.stack([torch.nn.functional.pad(c, (0, depth - c.shape[1])) for c in chains], dim=1)
    # Filled on the device, not copied from the host: the tree is built inside a step's CUDA graph.
    lengths = torch.cat([torch.full((padded.shape[0], 1), c.shape[1], dtype=torch.long, device=padded.device)
                         for c in chains], dim=1)
    return tree_from_chains(padded, lengths, check=False)


def step_tree(parts: list[Part], sample: bool) -> DraftTree:
    """The step's tree: the parts one after the other, in drafter order, each hanging from the root.
    Greedy: equal chosen siblings merged (chains alone: :func:`greedy_tree`'s layout); sampled: no
    merging, drawn chains with their laws, everything else a point mass."""
    if not sample and all(p.parents is None for p in parts):
        return greedy_tree([p.tokens for p in parts])
    tokens = torch.cat([p.tokens for p in parts], dim=1)
    batch, device = tokens.shape[0], tokens.device
    parents, offset = [], 0
    for p in parts:  # a chain's node d hangs from node d − 1; an expansion's parents move by its offset
        if p.parents is None:
            local = torch.arange(-1, p.nodes - 1, device=device).expand(batch, -1)
        else:
            local = p.parents
        parents.append(torch.where(local >= 0, local + offset, -1))
        offset += p.nodes
    tree_parents = torch.cat(parents, dim=1)
    if not sample:
        return merge_chosen(DraftTree.unchecked(tokens, tree_parents))
    given = [p.laws for p in parts if p.laws is not None]
    if not given:
        return DraftTree.unchecked(tokens, tree_parents)
    vocab = given[0].shape[-1]
    laws = [p.laws.float() if p.laws is not None else torch.zeros(batch, p.nodes, vocab, device=device) for p in parts]
    drawn = [torch.full(p.tokens.shape, p.laws is not None, dtype=torch.bool, device=device) for p in parts]
    return DraftTree.unchecked(tokens, tree_parents, torch.cat(laws, dim=1), torch.cat(drawn, dim=1))


def part_counts(parts: list[Part], offsets: list[int], result: TreeVerifyResult | VerifyResult, taken: torch.Tensor,
                sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per part: per row, its nodes on the committed path (``[M, B]``; −1 where it was never tested),
    and the most committed tokens of a row that its drafter's cache lacks (``[M]``). Greedy counts
    how deep the committed tokens (``taken`` per row) run along the part: a chain's longest prefix
    equal to them, an expansion's deepest node on them — what the part alone would have had
    committed. Sampling counts the part's kept nodes (at ``offsets`` in the tree) that were committed,
    in the rows where its first node was tested (no earlier part kept: the walk tests the root's
    children in order). A chain drafter's cache holds its matched prefix but its last draft; an
    expanding one's holds none of the step's tokens."""
    device = taken.device
    if not parts:
        return torch.zeros(0, taken.shape[0], dtype=torch.long, device=device), taken.new_zeros(0)
    lengths, unseen = [], []
    for part, offset in zip(parts, offsets):
        k = part.nodes
        if part.parents is None:
            column = torch.arange(k, device=device)
            match = (part.tokens == result.tokens[:, :k]) & (column < taken[:, None])
            deepest = match.long().cumprod(dim=1).sum(dim=1)
            unseen.append((taken - deepest.clamp(max=k - 1)).max())
        else:
            deepest = _deepest_on_path(part, result.tokens, taken)
            unseen.append(taken.max())
        if sample:
            slot = torch.arange(result.path.shape[1], device=device)
            mine = (result.path >= offset) & (result.path < offset + k) & (slot < taken[:, None])
            tested = (result.num_accepted == 0) | (result.path[:, 0] >= offset)
            lengths.append(torch.where(tested, mine.sum(dim=1), -1))
        else:
            lengths.append(deepest)
    return torch.stack(lengths), torch.stack(unseen)


def _deepest_on_path(part: Part, committed: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """``[B]``: the depth of the part's deepest node whose path is the first committed tokens
    (``committed [B, ≥ depth]``, ``taken [B]`` of them real); 0 when none is."""
    depths, parents = part.depths, part.parents
    at = committed.gather(1, (depths - 1).clamp(min=0))  # the committed token at each node's depth
    on = torch.zeros_like(part.tokens, dtype=torch.bool)
    for d in range(1, part.depth + 1):  # parents lie one level up: level by level
        above = torch.where(parents >= 0, on.gather(1, parents.clamp(min=0)), True)
        on = on | ((depths == d) & (part.tokens == at) & (depths <= taken[:, None]) & above)
    return torch.where(on, depths, 0).amax(dim=1)
