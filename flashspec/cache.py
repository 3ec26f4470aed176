"""A Hugging Face causal LM behind a KV cache that rows of different lengths can share.

Rows in a batch accept different numbers of tokens each step. Instead of giving every row its
own cache, all rows share one physical length ``T``; a position that does not hold a real token
of a row is a *hole*, masked out as a key for every later query (SPEC.md §3). Position ids count
real tokens only, so each row sees exactly the positions it would see alone.
"""

from __future__ import annotations

import inspect
import time

import torch
from transformers import DynamicCache, PreTrainedModel

__all__ = ["CachedLM", "right_align"]


class CachedLM:
    """Incremental forward passes of one model over a batch, with per-row rollback."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        accepted = inspect.signature(model.forward).parameters
        self._accepts_logits_to_keep = "logits_to_keep" in accepted
        # transformers >= 5.24 renames past_key_values to cache.
        self._cache_argument = "cache" if "cache" in accepted else "past_key_values"
        self.forward_seconds = 0.0  # wall time inside model forwards, for overhead accounting
        self.reset(0)

    def reset(self, batch: int) -> None:
        """Forget everything; the next :meth:`append` starts a new batch of ``batch`` rows."""
        device = self.model.device
        self.cache = DynamicCache(config=self.model.config)
        self.key_mask = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.num_real = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def length(self) -> int:
        """Physical cache length ``T`` (real tokens plus holes)."""
        return self.key_mask.shape[1]

    @torch.inference_mode()
    def append(self, tokens: torch.Tensor, real: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """Feed ``tokens [B, n]`` (``real [B, n]`` marks non-holes); return the logits of the
        last ``logits_to_keep`` positions, ``[B, logits_to_keep, V]``."""
        real = real.long()
        positions = self.num_real[:, None] + torch.cumsum(real, dim=1) - 1
        positions = positions.clamp(min=0)  # a leading hole gets position 0, as in transformers
        self.key_mask = torch.cat([self.key_mask, real], dim=1)
        kwargs = {self._cache_argument: self.cache}
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        started = time.perf_counter()
        out = self.model(
            input_ids=tokens,
            attention_mask=self.key_mask,
            position_ids=positions,
            use_cache=True,
            **kwargs,
        )
        logits = out.logits[:, -logits_to_keep:]
        # Host time. On an asynchronous device (CUDA) this is launch time only: no sync is added
        # to the decode step just to measure it, so engine overhead is reported for the CPU.
        self.forward_seconds += time.perf_counter() - started
        self.num_real = self.num_real + real.sum(dim=1)
        return logits

    def keep(self, num_real: torch.Tensor) -> None:
        """Roll back: row ``b`` keeps its first ``num_real[b]`` real tokens (never more than it
        has); the rest become holes and the physical length shrinks to what is still used."""
        num_real = torch.minimum(num_real.to(self.num_real.device), self.num_real)
        rank = torch.cumsum(self.key_mask, dim=1)
        self.key_mask = self.key_mask * (rank <= num_real[:, None]).long()
        self.num_real = num_real
        used = self.key_mask.any(dim=0).nonzero()
        new_length = int(used[-1]) + 1 if used.numel() else 0
        if new_length < self.length:
            self.cache.crop(new_length - self.length)  # negative: remove that many positions
            self.key_mask = self.key_mask[:, :new_length]


def right_align(
    history: torch.Tensor, start: torch.Tensor, end: torch.Tensor, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut ``history[b, start[b]:end[b]]`` from each row and right-align the pieces.

    Returns ``tokens [B, w]`` and ``real [B, w]`` where ``w = max(end - start)``; the left
    padding is marked as holes. The last column is each row's token ``end[b] - 1``.
    """
    width = int((end - start).max()) if history.shape[0] else 0
    offsets = torch.arange(width, device=history.device) - width  # -w .. -1
    index = end[:, None] + offsets[None, :]
    real = index >= start[:, None]
    tokens = history.gather(1, index.clamp(min=0))
    return torch.where(real, tokens, torch.full_like(tokens, pad_id)), real.long()
