"""Logit processing and token drawing: the only place temperature, top-k and top-p live.

The processing order and semantics are those of transformers' Temperature/TopK/TopP logits
warpers, applied in that order (SPEC.md §1). Target and drafters go through the same code, so
their distributions can never disagree about what "temperature 0.7" means.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["MIN_TEMPERATURE", "SamplingParams", "process_logits", "probabilities", "sample"]

# Below this, logits / temperature overflow float32 for ordinary logit ranges and the law has no
# finite mass left to draw from (SPEC.md §1); greedy decoding is what such a temperature means.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """How a distribution is made from logits. ``do_sample=False`` means greedy (argmax)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, (bool, np.bool_)):
            raise ValueError(f"do_sample must be True or False; got {self.do_sample!r}.")
        object.__setattr__(self, "do_sample", bool(self.do_sample))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 turns it off); got {self.top_k!r}.")
        if not _is_real(self.top_p) or not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 turns it off); got {self.top_p!r}.")
        if self.do_sample:
            t = self.temperature
            if not _is_real(t) or not math.isfinite(t) or t < MIN_TEMPERATURE:
                raise ValueError(
                    f"temperature must be a finite number >= {MIN_TEMPERATURE:g} when sampling; got {t!r}. "
                    "Use do_sample=False for greedy decoding."
                )


def _is_real(value: object) -> bool:
    """A real number (numpy scalars included), but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float32 logits after temperature, top-k and top-p (removed tokens are ``-inf``).

    Works on any shape ``[..., V]``. Greedy parameters return the raw float32 logits.
    """
    z = logits.float()
    if not params.do_sample:
        return z
    if params.temperature != 1.0:
        z = z / params.temperature
    vocab = z.shape[-1]
    if params.top_k > 0 and params.top_k < vocab:
        kth_largest = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=False)
        cumulative = sorted_z.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - params.top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        z = z.masked_fill(remove, float("-inf"))
    return z


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed distribution ``softmax(process_logits(logits))`` in float32."""
    return torch.softmax(process_logits(logits, params), dim=-1)


def sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``weights [..., V]`` by inverse CDF with ``uniforms [...]``.

    ``weights`` are non-negative with a positive sum per row (they need not be normalised).
    The draw is in float64: the smallest index whose cumulative weight exceeds ``u * total``,
    clamped to the last index with positive weight, so a zero-weight token is never returned.
    Pure tensor code: no host synchronisation.
    """
    w = weights.double()
    cdf = torch.cumsum(w, dim=-1)
    threshold = uniforms.double().unsqueeze(-1) * cdf[..., -1:]
    index = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    vocab = w.shape[-1]
    positions = torch.arange(vocab, device=w.device)
    last_positive = torch.where(w > 0, positions, -1).amax(dim=-1)
    return torch.minimum(index, last_positive)
