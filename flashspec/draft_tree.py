"""Draft trees: several continuations verified in one target forward, with the target's exact law.

A :class:`DraftTree` holds, per row, ``N`` nodes in topological order: each a token, a parent
(``-1``: the root, the last committed token; else an earlier node) and a law — a point mass (the
token was chosen: a top-k expansion, an n-gram continuation) or the distribution it was drawn
from. :func:`depths` and :func:`ancestor_mask` give the positions and attention mask of the
forward that scores every node at once; :func:`verify_tree` walks the tree with SpecInfer's
multi-draft rule and returns the kept path and the new token (SPEC.md §2, "Tree verification").

Everything is batched tensor code over rows, one pass over the ``N`` nodes, with no read back to
the host; a chain (``parents[j] = j − 1``) gives :func:`flashspec.verify.verify`'s result bit for
bit with the same uniforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, probabilities, sample

__all__ = ["DraftTree", "TreeVerifyResult", "ancestor_mask", "depths", "merge_chosen", "tree_from_chains",
           "verify_tree"]

ROOT = -1
"""The parent index of the root's children."""
ABSENT = -2
"""The parent index :class:`DraftTree` gives a node a ragged row lacks."""


@dataclass(frozen=True)
class DraftTree:
    """``tokens [B, N]`` (long) and ``parents [B, N]`` (long: ``-1`` for the root, else an index
    ``< j``); ``laws [B, N, V]`` (float) where some node's token was drawn from a law, with
    ``drawn [B, N]`` (bool) saying which (the others are point masses); ``present [B, N]``
    (bool) for ragged rows (default: every node). Checked on construction, which reads the
    tensors back to the host; :meth:`unchecked` builds a tree known to be valid without reading
    anything (SPEC.md §2, "Construction checks")."""

    tokens: torch.Tensor
    parents: torch.Tensor
    laws: torch.Tensor | None = None
    drawn: torch.Tensor | None = None
    present: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tokens, parents = self.tokens, self.parents
        if tokens.dim() != 2 or parents.shape != tokens.shape:
            raise ValueError(f"tokens and parents must both be [B, N]; got {tuple(tokens.shape)} and "
                             f"{tuple(parents.shape)}.")
        if tokens.dtype != torch.long or parents.dtype != torch.long:
            raise ValueError("tokens and parents must be integer (torch.long) tensors.")
        if tokens.shape[1] == 0:
            raise ValueError("A draft tree needs at least one node.")
        if bool((tokens < 0).any()):
            raise ValueError("Token ids must be >= 0.")
        index = torch.arange(tokens.shape[1], device=parents.device)
        if bool(((parents < ROOT) | (parents >= index)).any()):
            raise ValueError("Each node's parent must be -1 (the root) or an earlier node (nodes in topological "
                             "order).")
        if (self.laws is None) != (self.drawn is None):
            raise ValueError("laws and drawn come together: the laws of the nodes drawn from one.")
        if self.drawn is not None:
            if self.drawn.shape != tokens.shape or self.drawn.dtype != torch.bool:
                raise ValueError(f"drawn must be a bool tensor of shape {tuple(tokens.shape)}.")
            if self.laws.dim() != 3 or self.laws.shape[:2] != tokens.shape:
                raise ValueError(f"laws must be [B, N, V] with [B, N] = {tuple(tokens.shape)}.")
            if bool((tokens >= self.laws.shape[2]).any()):
                raise ValueError(f"Token ids must be below the laws' vocabulary size {self.laws.shape[2]}.")
        if self.present is not None:
            if self.present.shape != tokens.shape or self.present.dtype != torch.bool:
                raise ValueError(f"present must be a bool tensor of shape {tuple(tokens.shape)}.")
            orphan = self.present & (parents >= 0) & ~self.present.gather(1, parents.clamp(min=0))
            if bool(orphan.any()):
                raise ValueError("A present node's parent must be present.")

    @classmethod
    def unchecked(cls, tokens: torch.Tensor, parents: torch.Tensor, laws: torch.Tensor | None = None,
                  drawn: torch.Tensor | None = None, present: torch.Tensor | None = None) -> DraftTree:
        """The same tree as ``DraftTree(...)`` without the construction checks: no tensor is read,
        so it may be built inside a step that must not synchronise. For trees valid by construction."""
        tree = object.__new__(cls)
        for name, value in (("tokens", tokens), ("parents", parents), ("laws", laws), ("drawn", drawn),
                            ("present", present)):
            object.__setattr__(tree, name, value)
        return tree

    def walk_parents(self) -> torch.Tensor:
        """Parents with absent nodes marked :data:`ABSENT` (never a candidate)."""
        if self.present is None:
            return self.parents
        return torch.where(self.present, self.parents, torch.full_like(self.parents, ABSENT))


@dataclass
class TreeVerifyResult:
    """``num_accepted [B]``: nodes kept (0..depth). ``path [B, N]``: their indices in order, then
    -1. ``tokens [B, N + 1]``: their tokens, then the new token at ``num_accepted``, then -1."""

    num_accepted: torch.Tensor
    path: torch.Tensor
    tokens: torch.Tensor


def tree_from_chains(chains: torch.Tensor, lengths: torch.Tensor | None = None, check: bool = True) -> DraftTree:
    """The tree of several chosen continuations (point masses: n-gram and datastore
    continuations, greedy drafts), one per drafter: ``chains [B, M, L]`` token ids, ``lengths
    [B, M]`` how many of each chain's tokens are real (default: all ``L``). Chain ``i``'s token
    ``d`` is node ``i·L + d``; where an earlier chain has the same first ``d + 1`` tokens, that
    chain's node stands for it (one node per distinct prefix: the same token from two drafters is
    one node) and this one is absent. Static shapes ``[B, M·L]``, tensor operations only; earlier
    chains' branches are tested first (SPEC.md §2, "Tree verification"). ``check=False`` skips the
    checks that read tensors (``lengths``' range, the tree's) and returns an unchecked tree."""
    if chains.dim() != 3 or chains.dtype != torch.long:
        raise ValueError(f"chains must be a [B, M, L] tensor of token ids (torch.long); got {tuple(chains.shape)} "
                         f"{chains.dtype}.")
    batch, m, length = chains.shape
    if m == 0 or length == 0:
        raise ValueError("chains must hold at least one chain of at least one token.")
    device = chains.device
    depth = torch.arange(length, device=device)
    if lengths is None:
        real = torch.ones(batch, m, length, dtype=torch.bool, device=device)
    else:
        if lengths.shape != (batch, m) or (check and bool(((lengths < 0) | (lengths > length)).any())):
            raise ValueError(f"lengths must be [B, M] = [{batch}, {m}] with values in [0, {length}].")
        real = depth[None, None] < lengths[..., None]
    # same[b, i, k, d]: chains i and k agree on their first d + 1 tokens, all of them real
    agree = (chains[:, :, None] == chains[:, None]) & real[:, :, None] & real[:, None]
    same = agree.long().cumprod(dim=-1).bool()
    earlier = torch.arange(m, device=device)
    lower = earlier[None, :, None] >= earlier[None, None, :]  # k <= i
    first = torch.where(same & lower[..., None], earlier[None, None, :, None], m).amin(dim=2)  # [B, M, L]
    node = first * length + depth  # the node standing for chain i's prefix up to d
    present = (first == earlier[None, :, None]) & real
    parent_node = torch.cat([torch.full_like(node[..., :1], ROOT), node[..., :-1]], dim=-1)
    parents = torch.where(present, parent_node, ROOT).reshape(batch, m * length)
    present = present.reshape(batch, m * length)
    build = DraftTree if check else DraftTree.unchecked
    return build(chains.reshape(batch, m * length), parents, present=present)


def merge_chosen(tree: DraftTree) -> DraftTree:
    """``tree`` with equal chosen siblings merged: node ``j`` goes into the first earlier present
    node with its token under the same (merged) parent when both are point masses (drawn nodes are
    never merged); it becomes absent and its children move under that node. The token paths from
    the root are the same, one node each (SPEC.md §2, "Duplicates"). One pass over the nodes, no
    read back to the host; returns an unchecked tree (valid when ``tree`` is)."""
    tokens, batch, n = tree.tokens, tree.tokens.shape[0], tree.tokens.shape[1]
    device = tokens.device
    present = torch.ones_like(tokens, dtype=torch.bool) if tree.present is None else tree.present
    chosen = present if tree.drawn is None else present & ~tree.drawn
    index = torch.arange(n, device=device)
    stands = index.expand(batch, n).clone()  # the node that stands for each node after the merge
    parents = tree.parents.clone()
    kept = present.clone()
    for j in range(1, n):
        parent = tree.parents[:, j]
        merged_parent = torch.where(parent >= 0, stands.gather(1, parent.clamp(min=0)[:, None]).squeeze(1), parent)
        parents[:, j] = torch.where(present[:, j], merged_parent, parent)
        same = (parents[:, :j] == parents[:, j : j + 1]) & (tokens[:, :j] == tokens[:, j : j + 1]) & kept[:, :j]
        same &= chosen[:, :j] & chosen[:, j : j + 1]
        first = torch.where(same.any(dim=1), same.long().argmax(dim=1), j)  # argmax: the first True
        stands[:, j] = first
        kept[:, j] &= first == j
    parents = torch.where(kept, parents, torch.where(present, ROOT, tree.parents))
    return DraftTree.unchecked(tokens, parents, tree.laws, tree.drawn, kept)


def depths(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N]``: each node's depth below the root (a child of the root is at 1): its position
    past the root's in the scoring forward. Absent nodes (parent :data:`ABSENT`) get 0."""
    out = torch.zeros_like(parents)
    for j in range(parents.shape[1]):  # topological order: a parent's depth is known first
        parent = parents[:, j]
        above = out.gather(1, parent.clamp(min=0)[:, None]).squeeze(1)
        out[:, j] = torch.where(parent >= 0, above + 1, torch.where(parent == ROOT, 1, 0))
    return out


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N, N]`` bool: node ``i`` sees node ``j`` iff ``j`` is ``i`` or one of its ancestors
    (every node also sees the root and the committed context, outside this mask)."""
    batch, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(batch, n, n).clone()
    for j in range(n):  # a node sees what its parent sees, and itself
        parent = parents[:, j]
        inherited = mask.gather(1, parent.clamp(min=0)[:, None, None].expand(batch, 1, n)).squeeze(1)
        mask[:, j] |= inherited & (parent >= 0)[:, None]
    return mask


def verify_tree(
    target_logits: torch.Tensor,
    tree: DraftTree,
    params: SamplingParams,
    uniforms: torch.Tensor | None = None,
) -> TreeVerifyResult:
    """Walk ``tree`` against the target (SPEC.md §2, "Tree verification"): ``target_logits
    [B, N + 1, V]`` are the target's logits after the root (row 0) and after each node (row
    ``j + 1``). Sampling reads ``uniforms [B, N + 1]``: ``u[:, j]`` tests node ``j``,
    ``u[:, N]`` draws the new token; greedy reads none."""
    batch, n = tree.tokens.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (batch, n + 1):
        raise ValueError(f"target_logits must be [B, N + 1, V] = [{batch}, {n + 1}, V]; got "
                         f"{tuple(target_logits.shape)}.")
    if tree.laws is not None and tree.laws.shape[2] != target_logits.shape[2]:
        raise ValueError(f"The tree's laws have {tree.laws.shape[2]} tokens and the target's logits "
                         f"{target_logits.shape[2]}: they must share one vocabulary.")
    parents, tokens = tree.walk_parents(), tree.tokens
    device = target_logits.device
    rows = torch.arange(batch, device=device)
    current = torch.full((batch,), ROOT, dtype=torch.long, device=device)
    path = torch.full((batch, n), -1, dtype=torch.long, device=device)
    kept = torch.zeros(batch, dtype=torch.long, device=device)

    if not params.do_sample:
        choice = target_logits.float().argmax(dim=-1)  # [B, N + 1]: the greedy token after each position
        for j in range(n):
            accept = (parents[:, j] == current) & (tokens[:, j] == choice[rows, current + 1])
            path[rows, kept.clamp(max=n - 1)] = torch.where(accept, j, path[rows, kept.clamp(max=n - 1)])
            kept = kept + accept.long()
            current = torch.where(accept, j, current)
        final = choice[rows, current + 1]
        return TreeVerifyResult(kept, path, _tokens(tokens, path, kept, final))

    if uniforms is None or uniforms.shape != (batch, n + 1):
        raise ValueError(f"Sampling needs uniforms of shape [{batch}, {n + 1}].")
    p = probabilities(target_logits, params)  # [B, N + 1, V] float32
    # The running law r = running / mass: unnormalised weights, so that a chain rounds exactly as
    # verify() does (its residual is p - q, never divided); a target law has mass 1.
    running = p[:, 0]
    mass = torch.ones(batch, dtype=torch.float64, device=device)
    for j in range(n):
        candidate = parents[:, j] == current
        x = tokens[:, j]
        r_x = running.gather(1, x[:, None]).squeeze(1).double()
        drawn = None if tree.drawn is None else tree.drawn[:, j]
        q_x = torch.ones_like(r_x)
        if drawn is not None:
            q_x = torch.where(drawn, tree.laws[:, j].gather(1, x[:, None]).squeeze(1).double(), q_x)
        accept = candidate & (uniforms[:, j].double() * q_x * mass < r_x)
        reject = candidate & ~accept
        # a rejected candidate leaves max(r - q, 0): a point mass removes x; a law is taken off
        residual = running.scatter(1, x[:, None], 0.0)
        if drawn is not None:
            taken = torch.clamp(running - mass.float()[:, None] * tree.laws[:, j].float(), min=0.0)
            residual = torch.where(drawn[:, None], taken, residual)
        left = residual.double().sum(dim=1)
        reject_with_mass = reject & (left > 0)  # none left only by rounding: r stays
        running = torch.where(reject_with_mass[:, None], residual, running)
        mass = torch.where(reject_with_mass, left, mass)
        running = torch.where(accept[:, None], p[:, j + 1], running)
        mass = torch.where(accept, 1.0, mass)
        path[rows, kept.clamp(max=n - 1)] = torch.where(accept, j, path[rows, kept.clamp(max=n - 1)])
        kept = kept + accept.long()
        current = torch.where(accept, j, current)
    final = sample(running, uniforms[:, n])
    return TreeVerifyResult(kept, path, _tokens(tokens, path, kept, final))


def _tokens(tokens: torch.Tensor, path: torch.Tensor, kept: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """``[B, N + 1]``: the kept nodes' tokens, the new token at ``kept``, then -1."""
    batch, n = tokens.shape
    columns = torch.arange(n + 1, device=tokens.device)
    on_path = tokens.gather(1, path.clamp(min=0))
    out = torch.cat([on_path, torch.zeros_like(on_path[:, :1])], dim=1)
    out = torch.where(columns[None] < kept[:, None], out, -1)
    return torch.where(columns[None] == kept[:, None], final[:, None], out)
