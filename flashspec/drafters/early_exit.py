"""A drafter made from the target itself: its first ``N`` layers, its final norm and its head.

No weights of its own and no cache of its own (SPEC.md §11): it runs the target's
:class:`~flashspec.models.static.StaticLM` with ``layers=N``, reading the target's KV cache for layers
``< N`` and writing the entries of the tokens it feeds there. The target's verify forward feeds
the same positions again and overwrites those entries before any query reads them, so what the
drafter wrote never reaches the target's logits: the output law is the target's.
"""

from __future__ import annotations

import torch

from ..checks import check_int
from ..models.graphs import Graphs
from ..models.static import StaticLM
from ..sampling import SamplingParams
from .base import Draft, History, autoregress

__all__ = ["EarlyExitDrafter", "parse_early_exit"]

PREFIX = "early-exit:"


def parse_early_exit(spec: str, num_layers: int) -> int:
    """``"early-exit:N"`` → ``N`` (1 ≤ N ≤ the target's layers), else a ValueError saying why."""
    text = spec[len(PREFIX):]
    if not text.strip().isdigit() or not 1 <= int(text) <= num_layers:
        raise ValueError(f"{spec!r}: an early-exit drafter is 'early-exit:N' with N from 1 to the target's "
                         f"{num_layers} layers.")
    return int(text)


class EarlyExitDrafter:
    """Drafts with the target's first ``layers`` layers (SPEC.md §11). Needs no training; the
    baseline of the drafters made from the target. One target forward of ``layers`` layers per
    drafted token; on CUDA the whole proposal is one CUDA graph per ``(k, params)``."""

    def __init__(self, target: StaticLM, layers: int) -> None:
        if not isinstance(target, StaticLM):
            raise ValueError("An early-exit drafter needs a target that runs over FlashSpec's static cache "
                             f"(architectures {', '.join(StaticLM.ARCHITECTURES)}).")
        total = len(target.base.layers)
        check_int("layers", layers, 1, total, upto=f"the target's {total}")
        self.target, self.layers = target, layers
        self.name = f"{PREFIX}{layers}"
        device = next(target.model.parameters()).device
        self._graphs = Graphs(enabled=device.type == "cuda")

    def begin(self, batch_size: int) -> None:
        pass  # nothing of its own: the target's cache holds every committed token but the pending one

    def propose(
        self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor
    ) -> Draft:
        active = history.active if history.active is not None else torch.ones_like(history.length, dtype=torch.bool)
        # Graphs read fixed buffers: the history's, the uniforms' and the target's cache.
        self._graphs.reading(history.tokens, history.length, active, uniforms, self.target.keys[0])
        tokens, probs = self._graphs.run(
            (num_tokens, params), lambda: self._draft(history.tokens, history.length, uniforms, num_tokens, params))
        return Draft(tokens, probs)

    def _draft(
        self, history: torch.Tensor, length: torch.Tensor, uniforms: torch.Tensor, num_tokens: int,
        params: SamplingParams,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pure tensor code: feed the pending token, then each draft, through the first layers."""
        pending = history.gather(1, (length - 1)[:, None])  # [B, 1]
        logits = self.target.early_exit(pending, length - 1, self.layers)[:, 0]
        return autoregress(logits, lambda token, i: self.target.early_exit(token[:, None], length + i, self.layers)[:, 0],
                           num_tokens, params, uniforms)
