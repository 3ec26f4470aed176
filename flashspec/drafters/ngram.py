"""Prompt-lookup drafting: continue the text the way it continued last time (no model)."""

from __future__ import annotations

import torch

from ..models.graphs import Graphs
from ..sampling import SamplingParams
from .base import Draft, History, continuation


class NgramDrafter:
    """Finds the most recent earlier occurrence of the last ``n`` committed tokens (``n`` from
    ``max_ngram`` down to ``min_ngram``) and proposes the tokens that followed it.

    The proposal is a deterministic function of the context, so it carries no ``q`` and is
    verified with one-hot ``q`` (SPEC.md §2). All rows are searched at once with tensor ops, and
    nothing is read back to the host; on CUDA the search is replayed from one graph per draft
    length (SPEC.md §4).
    """

    name = "ngram"

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
