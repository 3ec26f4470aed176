"""Low-rank deltas over a trained drafter (SPEC.md §11.5): a per-domain drafter stored as
``B·A`` factors over a general one, merged into its weights when loaded."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["LowRank", "add_low_rank", "low_rank_factors", "merge_low_rank"]


class LowRank(nn.Module):
    """A parametrization ``W → W + B·A`` of a linear map's weight (``A [rank, in]`` small random,
    ``B [out, rank]`` zero, so training starts from the base drafter exactly)."""

    def __init__(self, weight: torch.Tensor, rank: int) -> None:
        super().__init__()
        out, inp = weight.shape
        self.A = nn.Parameter(torch.randn(rank, inp, dtype=weight.dtype, device=weight.device) / math.sqrt(inp))
        self.B = nn.Parameter(torch.zeros(out, rank, dtype=weight.dtype, device=weight.device))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.B @ self.A


def _linears(head: Any) -> dict[str, nn.Linear]:
    """The head's own linear maps by state-dict name (the target's shared modules excluded)."""
    return {name: m for name, m in head.named_modules() if isinstance(m, nn.Linear)}


def add_low_rank(head: Any, rank: int) -> None:
    """Give every linear map of ``head`` a trainable low-rank delta (:class:`LowRank`)."""
    from torch.nn.utils import parametrize

    for module in _linears(head).values():
        if not parametrize.is_parametrized(module, "weight"):
            parametrize.register_parametrization(module, "weight", LowRank(module.weight, rank))


def low_rank_factors(head: Any) -> dict[str, torch.Tensor]:
    """``{name.A, name.B}`` of every delta of ``head`` (what a delta checkpoint stores)."""
    from torch.nn.utils import parametrize

    out = {}
    for name, module in _linears(head).items():
        if parametrize.is_parametrized(module, "weight"):
            delta = module.parametrizations.weight[0]
            out[f"{name}.A"], out[f"{name}.B"] = delta.A.detach(), delta.B.detach()
    return out


def merge_low_rank(head: Any, factors: dict[str, torch.Tensor]) -> None:
    """Add ``B·A`` to each named linear map's weight in place (loading a delta checkpoint)."""
    linears = _linears(head)
    names = {key.rsplit(".", 1)[0] for key in factors}
    unknown = sorted(names - set(linears))
    if unknown:
        raise ValueError(f"The low-rank delta names maps its base drafter lacks: {', '.join(unknown[:3])}.")
    with torch.no_grad():
        for name in names:
            weight = linears[name].weight
            delta = factors[f"{name}.B"].to(torch.float32) @ factors[f"{name}.A"].to(torch.float32)
            weight.copy_((weight.to(torch.float32) + delta.to(weight.device)).to(weight.dtype))
