"""Any transformers causal LM behind a ``DynamicCache`` that rows of different lengths share
(SPEC.md §3): the reference path for architectures :class:`~flashspec.models.static.StaticLM`
does not know.

Like :class:`StaticLM` it answers :meth:`CachedLM.forward`: feed ``tokens [B, q]`` at positions
``start[b] .. start[b] + q - 1`` of each row, forgetting whatever the cache held at positions
``>= start[b]``, and return logits; rolling back crops the cache, which reads lengths on the host.
"""

from __future__ import annotations

import inspect
import time

import torch
from transformers import DynamicCache, PreTrainedModel

from .loading import context_window
from .static import StaticLM

__all__ = ["CachedLM", "make_lm"]


class CachedLM:
    """Any transformers causal LM behind a ``DynamicCache`` that rows of different lengths share.

    All rows share one physical length; a position that holds no real token of a row is a hole,
    masked out as a key. Position ids count real tokens only, so each row sees exactly the
    positions it would see alone. Rolling back crops the cache (a host read per step).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        accepted = inspect.signature(model.forward).parameters
        self._accepts_logits_to_keep = "logits_to_keep" in accepted
        # transformers >= 5.24 renames past_key_values to cache.
        self._cache_argument = "cache" if "cache" in accepted else "past_key_values"
        # Positions past the window only ever hold tokens beyond a row's budget, which are thrown
        # away; clamping them keeps learned position tables (GPT-2, OPT) in range.
        self._last_position = (context_window(model.config) or 2**62) - 1
        self.forward_seconds = 0.0
        self.reset(0, 0)

    def reset(self, batch: int, capacity: int) -> bool:
        """Forget everything; the next :meth:`forward` starts a new batch of ``batch`` rows.
        (Never captured in graphs, so this reports no buffer replacement.)"""
        device = self.model.device
        self.cache = DynamicCache(config=self.model.config)
        self.key_mask = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.num_real = torch.zeros(batch, dtype=torch.long, device=device)
        return False

    @property
    def length(self) -> int:
        """Physical cache length (real tokens plus holes)."""
        return self.key_mask.shape[1]

    def forward(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        real: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        eager: bool = False,
    ) -> torch.Tensor:
        """Feed ``tokens [B, q]`` as real tokens ``start[b]..`` (where ``real [B, q]`` is 1; rows
        whose first column is not real are left as they are and get holes). ``eager`` is
        accepted for interface parity with :class:`StaticLM` (nothing here is compiled)."""
        return self._feed(tokens, start, real, logits_at)

    @torch.inference_mode()
    def _feed(self, tokens: torch.Tensor, start: torch.Tensor, real: torch.Tensor | None,
              logits_at: torch.Tensor | None) -> torch.Tensor:
        real = torch.ones_like(tokens) if real is None else real.long()
        row_feeds = real[:, 0] > 0
        self._keep(torch.where(row_feeds, start.to(self.num_real.device), self.num_real))
        logits = self._append(tokens, real)
        if logits_at is not None:
            logits = logits.gather(1, logits_at[..., None].expand(-1, -1, logits.shape[-1]))
        return logits

    def prefill(self, tokens: torch.Tensor, start: torch.Tensor, real: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` (the name the loop calls for a prefill, as :class:`StaticLM`'s)."""
        return self._feed(tokens, start, real, logits_at)

    def _append(self, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        positions = self.num_real[:, None] + torch.cumsum(real, dim=1) - 1
        positions = positions.clamp(min=0, max=self._last_position)  # a leading hole gets 0
        self.key_mask = torch.cat([self.key_mask, real], dim=1)
        kwargs = {self._cache_argument: self.cache}
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = tokens.shape[1]
        started = time.perf_counter()
        out = self.model(
            input_ids=tokens, attention_mask=self.key_mask, position_ids=positions, use_cache=True, **kwargs
        )
        self.forward_seconds += time.perf_counter() - started
        self.num_real = self.num_real + real.sum(dim=1)
        return out.logits[:, -tokens.shape[1]:]

    def _keep(self, num_real: torch.Tensor) -> None:
        """Row ``b`` keeps its first ``num_real[b]`` real tokens; the rest become holes and the
        physical length shrinks to what is still used."""
        num_real = torch.minimum(num_real, self.num_real)
        rank = torch.cumsum(self.key_mask, dim=1)
        self.key_mask = self.key_mask * (rank <= num_real[:, None]).long()
        self.num_real = num_real
        used = self.key_mask.any(dim=0).nonzero()
        new_length = int(used[-1]) + 1 if used.numel() else 0
        if new_length < self.length:
            self.cache.crop(new_length - self.length)  # negative: remove that many positions
            self.key_mask = self.key_mask[:, :new_length]


def make_lm(model: PreTrainedModel, compile: bool = False) -> StaticLM | CachedLM:
    """The fastest exact wrapper for ``model``: :class:`StaticLM` when it knows the architecture
    (``compile`` applies to it only)."""
    return StaticLM(model, compile=compile) if StaticLM.supports(model) else CachedLM(model)
