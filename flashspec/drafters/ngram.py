"""Prompt-lookup drafting: continue the text the way it continued last time (no model)."""

from __future__ import annotations

import torch

from ..models.graphs import Graphs
from ..sampling import SamplingParams
from .base import Draft, History, continuation
from .expansion import ExpandedDraft


class NgramDrafter:
    """Finds the most recent earlier occurrence of the last ``n`` committed tokens (``n`` from
    ``max_ngram`` down to ``min_ngram``) and proposes the tokens that followed it.

    The proposal is a deterministic function of the context, so it carries no ``q`` and is
    verified with one-hot ``q`` (SPEC.md §2). All rows are searched at once with tensor ops, and
    nothing is read back to the host; on CUDA the search is replayed from one graph per draft
    length (SPEC.md §4). In a tree step it can offer several continuations at once
    (:meth:`expand`: the most recent distinct ones, SPEC.md §7).
    """

    name = "ngram"
    draft_vocab_size = 2**62  # any token id: a continuation copies the context

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram!r}, "
                f"max_ngram={max_ngram!r}."
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._graphs: Graphs | None = None  # made at the first proposal on a GPU

    def begin(self, batch_size: int) -> None:
        pass  # no state of its own: the graphs depend on the history's buffers only

    def propose(
        self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor
    ) -> Draft:
        tokens, length = history.tokens, history.length
        if not tokens.is_cuda:
            return Draft(self._draft(tokens, length, num_tokens), None)
        if self._graphs is None:
            self._graphs = Graphs(enabled=True)
        self._graphs.reading(tokens, length, tuple(tokens.shape), tokens.device)
        return Draft(self._graphs.run(num_tokens, lambda: self._draft(tokens, length, num_tokens)), None)

    def _draft(self, tokens: torch.Tensor, length: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[B, num_tokens]`` drafts from ``tokens [B, capacity]`` and ``length [B]`` (tensor code
        only, so it can be captured as a graph)."""
        pending = tokens.gather(1, (length - 1)[:, None])
        return continuation(tokens, self.find(History(tokens, length)), length, num_tokens, pending)

    def find(self, history: History) -> torch.Tensor:
        """Per row, where the continuation of the most recent earlier occurrence of the
        longest matching suffix starts in ``history.tokens`` (−1: no match)."""
        tokens, length = history.tokens, history.length
        batch, capacity = tokens.shape
        device = tokens.device
        follow = torch.full((batch,), -1, dtype=torch.long, device=device)  # first token after match
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if capacity < n + 1:
                continue
            windows = tokens.unfold(1, n, 1)  # [B, capacity - n + 1, n]
            suffix_at = (length[:, None] - n + torch.arange(n, device=device)).clamp(min=0)
            suffix = tokens.gather(1, suffix_at)
            starts = torch.arange(windows.shape[1], device=device)
            found = (windows == suffix[:, None, :]).all(dim=-1)
            found &= starts[None, :] + n < length[:, None]  # strictly earlier than the suffix
            latest = torch.where(found, starts[None, :], -1).amax(dim=1)
            take = (follow < 0) & (latest >= 0)
            follow = torch.where(take, latest + n, follow)
        return follow

    def expand(self, history: History, depth: int, topk: int, nodes: int, params: SamplingParams) -> ExpandedDraft:
        """``nodes`` nodes of a tree of continuations (SPEC.md §7, "Several n-gram continuations"):
        the ``max(topk, ⌈nodes / depth⌉)`` best distinct continuations of ``depth`` tokens — longest
        matching suffix first, then most recent, as :meth:`find` ranks its one — laid out breadth
        first (every branch's first token, then every second token, …) and cut after ``nodes``.
        Every node is a point mass; the first branch is :meth:`propose`'s chain. Tensor code only."""
        tokens, length = history.tokens, history.length
        batch, capacity = tokens.shape
        device = tokens.device
        branches = max(topk, -(-nodes // depth))
        wanted = min(2 * branches, capacity)  # candidates before removing repeats
        rank = torch.full((batch, capacity), -1, dtype=torch.long, device=device)  # per follow position
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if capacity < n + 1:
                continue
            windows = tokens.unfold(1, n, 1)
            suffix_at = (length[:, None] - n + torch.arange(n, device=device)).clamp(min=0)
            found = (windows == tokens.gather(1, suffix_at)[:, None, :]).all(dim=-1)
            starts = torch.arange(windows.shape[1], device=device)
            found &= starts[None, :] + n < length[:, None]
            follow = (starts + n).clamp(max=capacity - 1).expand(batch, -1)
            score = torch.where(found, n * capacity + starts + n, -1)  # longer matches first, then later ones
            rank.scatter_reduce_(1, follow, score, reduce="amax")
        best, follow = torch.topk(rank, wanted, dim=1)
        follow = torch.where(best >= 0, follow, -1)  # [B, M], best first
        offsets = torch.arange(depth, device=device)
        index = follow[..., None] + offsets  # [B, M, D]
        usable = (follow[..., None] >= 0) & (index < length[:, None, None])
        pending = tokens.gather(1, (length - 1)[:, None])
        chains = tokens.gather(1, index.clamp(0, capacity - 1).flatten(1)).view(batch, wanted, depth)
        chains = torch.where(usable, chains, pending[..., None])
        same = (chains[:, :, None, :] == chains[:, None, :, :]).all(dim=-1)  # [B, M, M]
        earlier = torch.ones(wanted, wanted, dtype=torch.bool, device=device).tril(-1)
        repeat = (same & earlier).any(dim=-1)  # an earlier candidate is the same continuation
        order = torch.sort(repeat.long() * wanted + torch.arange(wanted, device=device), dim=1).indices
        chosen = order[:, :branches]
        if branches > wanted:  # fewer candidates than branches (a tiny capacity): repeat the last
            chosen = torch.cat([chosen, chosen[:, -1:].expand(-1, branches - wanted)], dim=1)
        chains = chains.gather(1, chosen[..., None].expand(-1, -1, depth))  # [B, branches, D]
        flat = chains.transpose(1, 2).flatten(1)[:, :nodes]  # breadth first
        slot = torch.arange(nodes, device=device)
        level, branch = slot // branches, slot % branches
        parents = torch.where(level > 0, (level - 1) * branches + branch, -1).expand(batch, -1)
        values = (-branch.float()).expand(batch, -1)
        return ExpandedDraft(flat, parents.contiguous(), (level + 1).expand(batch, -1).contiguous(), values)
