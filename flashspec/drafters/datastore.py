"""Retrieval drafting: continue the context the way a fixed text store continued it (no model).

REST (He et al., 2023) drafts from a datastore of text instead of a model: find the last few
committed tokens in the store and propose what followed them there. One store per domain (code,
prose, chat) gives drafters whose strengths differ by domain — what a bandit can choose among.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..sampling import SamplingParams
from .base import Draft, History, continuation
from .ngram import NgramDrafter

_BITS = 21  # bits per token in a packed key: vocabularies up to 2,097,152 tokens, 3 tokens in 63 bits


def _pack(grams: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` token ids (n ≤ 3) → one exact int64 key per n-gram."""
    key = torch.zeros(grams.shape[:-1], dtype=torch.long, device=grams.device)
    for j in range(grams.shape[-1]):
        key = (key << _BITS) | grams[..., j]
    return key


def _most_frequent_continuations(store: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct keys of the store's n-grams (those something follows) and, for each,
    where a continuation starts whose first token is the one that most often follows that
    n-gram (ties: the smaller token id; among its occurrences, the earliest)."""
    keys = _pack(store.unfold(0, n, 1)[:-1])
    nexts = store[n:]
    order = torch.sort(nexts, stable=True).indices  # by next token, then position
    order = order[torch.sort(keys[order], stable=True).indices]  # by key, then next token, then position
    k, t = keys[order], nexts[order]
    new_pair = torch.ones_like(k, dtype=torch.bool)
    new_pair[1:] = (k[1:] != k[:-1]) | (t[1:] != t[:-1])
    pair_id = torch.cumsum(new_pair, 0) - 1
    count = torch.bincount(pair_id)  # occurrences of each (key, next token)
    first = torch.nonzero(new_pair).squeeze(1)  # each pair's earliest occurrence in `order`
    pair_key = k[first]
    # best pair per key: sort pairs by key, then by count descending (stable keeps smaller tokens first)
    by_count = torch.sort(-count, stable=True).indices
    best = by_count[torch.sort(pair_key[by_count], stable=True).indices]
    leader = torch.ones_like(best, dtype=torch.bool)
    leader[1:] = pair_key[best[1:]] != pair_key[best[:-1]]
    chosen = best[leader]
    return pair_key[chosen], order[first[chosen]] + n


class DatastoreDrafter:
    """Proposes what followed the last ``n`` committed tokens (``n`` from ``max_ngram`` down to
    ``min_ngram``, at most 3) in ``store``, a 1-D sequence of token ids: the continuation whose
    first token most often follows that n-gram there. With ``in_context`` (the default) a match
    in the request's own text (prompt lookup, :class:`NgramDrafter`) comes first and the store
    answers only where the context has none.

    Each n-gram of the store is packed into one exact int64 key (no hashing, no collisions) and
    the keys are sorted once; a lookup is a binary search per row (``torch.searchsorted``), so a
    proposal costs O(B·n·log N) whatever the store's size, runs on the target's device and
    reads nothing back to the host. The proposal is deterministic, so it is verified with
    one-hot ``q`` (SPEC.md §2): the output law is the target's whatever the store holds. Where
    nothing matches (or the store ends), the pending token is repeated, as the n-gram drafter does.
    """

    MAX_NGRAM = 3

    def __init__(
        self, store: torch.Tensor | Sequence[int], name: str = "store", max_ngram: int = 3, min_ngram: int = 1,
        in_context: bool = True,
    ) -> None:
        sizes_are_ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (min_ngram, max_ngram))
        if not (sizes_are_ints and 1 <= min_ngram <= max_ngram <= self.MAX_NGRAM):
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram <= {self.MAX_NGRAM}; "
                             f"got min_ngram={min_ngram!r}, max_ngram={max_ngram!r}.")
        store = torch.as_tensor(store)
        if store.numel() == 0:
            raise ValueError("The store is empty; give it the token ids of some text.")
        if store.dim() != 1 or store.dtype.is_floating_point or store.dtype == torch.bool:
            raise ValueError(f"The store must be a 1-D sequence of token ids; got shape {tuple(store.shape)} "
                             f"and dtype {store.dtype}.")
        if store.numel() < max_ngram + 1:
            raise ValueError(f"The store has {store.numel()} tokens; it needs at least max_ngram + 1 = "
                             f"{max_ngram + 1} to hold one n-gram and what followed it.")
        store = store.long()
        if int(store.min()) < 0 or int(store.max()) >= 1 << _BITS:
            raise ValueError(f"Token ids in the store must lie in [0, {1 << _BITS}); got "
                             f"{int(store.min())}..{int(store.max())}.")
        self.name = name
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.store = store
        self.max_token = int(store.max())  # the engine checks it against the target's vocabulary
        self.in_context = NgramDrafter(max_ngram, min_ngram) if in_context else None
        self._keys: dict[int, torch.Tensor] = {}
        self._follow: dict[int, torch.Tensor] = {}
        for n in range(min_ngram, max_ngram + 1):
            self._keys[n], self._follow[n] = _most_frequent_continuations(store, n)

    @classmethod
    def from_text(cls, text: str, tokenizer: Any, name: str = "store", **options: Any) -> DatastoreDrafter:
        """A store of ``tokenizer(text)`` (e.g. one domain's training text)."""
        ids = tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError(f"The text for drafter {name!r} tokenizes to nothing.")
        return cls(ids, name=name, **options)

    def __len__(self) -> int:
        return self.store.numel()

    def _to(self, device: torch.device) -> None:
        if self.store.device != device:  # once, at the first proposal on a new device
            self.store = self.store.to(device)
            self._keys = {n: k.to(device) for n, k in self._keys.items()}
            self._follow = {n: f.to(device) for n, f in self._follow.items()}

    def begin(self, batch_size: int) -> None:
        pass  # stateless

    def propose(
        self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor
    ) -> Draft:
        tokens, length = history.tokens, history.length
        device = tokens.device
        self._to(device)
        follow = torch.full(length.shape, -1, dtype=torch.long, device=device)  # continuation start
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            keys = self._keys[n]
            suffix_at = (length[:, None] - n + torch.arange(n, device=device)).clamp(min=0)
            query = _pack(tokens.gather(1, suffix_at))
            at = torch.searchsorted(keys, query).clamp(max=keys.numel() - 1)
            hit = (keys[at] == query) & (length >= n) & (follow < 0)
            follow = torch.where(hit, self._follow[n][at], follow)
        pending = tokens.gather(1, (length - 1)[:, None])
        drafts = continuation(self.store, follow, self.store.numel(), num_tokens, pending)
        if self.in_context is not None:  # a match in the request's own text comes first
            here = self.in_context.find(history)
            from_context = continuation(tokens, here, length, num_tokens, pending)
            drafts = torch.where((here >= 0)[:, None], from_context, drafts)
        return Draft(drafts, None)
