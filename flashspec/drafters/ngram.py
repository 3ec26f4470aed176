"""Prompt-lookup drafting: continue the text the way it continued last time (no model)."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .base import Draft, History, continuation


class NgramDrafter:
    """Finds the most recent earlier occurrence of the last ``n`` committed tokens (``n`` from
    ``max_ngram`` down to ``min_ngram``) and proposes the tokens that followed it.

    The proposal is a deterministic function of the context, so it carries no ``q`` and is
    verified with one-hot ``q`` (SPEC.md §2). All rows are searched at once with tensor ops, and
    nothing is read back to the host.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram!r}, "
                f"max_ngram={max_ngram!r}."
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, batch_size: int) -> None:
        pass  # stateless

    def propose(
        self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor
    ) -> Draft:
        tokens, length = history.tokens, history.length
        pending = tokens.gather(1, (length - 1)[:, None])
        return Draft(continuation(tokens, self.find(history), length, num_tokens, pending), None)

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
