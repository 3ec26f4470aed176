"""Fused features (SPEC.md §11.8, EAGLE-3): which of the target's decoder layers a feature
drafter reads (its ``taps``) and the ``fuse`` map that turns their outputs, side by side, into
one feature of the hidden size: a full ``len(taps)·hidden → hidden`` matrix, or with
``fuse_rank`` the product of two thin ones (:class:`FactoredLinear`, a smaller checkpoint)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..checks import check_int

__all__ = ["FactoredLinear", "check_fuse_rank", "check_taps", "default_taps", "fuse_map", "tapped_layers"]


def default_taps(layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high taps for a target of ``layers`` decoder layers: the outputs
    of layers ``1, L//2 − 1, L − 4`` (0-based), i.e. the inputs of layers ``2, L//2, L − 3`` where
    the reference code reads them. Clamped to the layers there are and deduplicated (a target of
    fewer than 8 layers gets fewer or closer taps)."""
    check_int("layers", layers, 1)
    return tuple(sorted({min(1, layers - 1), max(layers // 2 - 1, 0), max(layers - 4, 0)}))


def check_taps(taps: Any, layers: int) -> tuple[int, ...]:
    """``taps`` as a tuple if it holds distinct decoder-layer indices in ``[0, layers)`` (index
    ``i``: the output of layer ``i``, 0-based, before the final norm), else ``ValueError``."""
    try:
        taps = tuple(taps)
    except TypeError:
        raise ValueError(f"taps must be a sequence of decoder-layer indices; got {taps!r}.") from None
    if not taps or len(set(taps)) != len(taps):
        raise ValueError(f"taps must hold one or more distinct decoder-layer indices; got {list(taps)}.")
    for tap in taps:
        check_int("each tap", tap, 0, layers - 1, upto=f"{layers - 1} (the target has {layers} decoder layers)")
    return tuple(int(t) for t in taps)


def tapped_layers(taps: tuple[int, ...] | None, layers: int) -> tuple[int, ...]:
    """The layer counts ``n`` whose outputs a head with ``taps`` reads over a target of ``layers``
    decoder layers (the keys of ``History.hidden``: the output of the first ``n`` layers): tap
    ``i`` is ``n = i + 1``; without taps, the last layer's, ``n = layers``."""
    return (layers,) if taps is None else tuple(t + 1 for t in taps)


def check_fuse_rank(rank: Any, taps: tuple[int, ...] | None, hidden: int, name: str = "fuse_rank") -> int | None:
    """``rank`` (None: a full-rank ``fuse``) if it is an integer from 1 to ``min(len(taps)·hidden,
    hidden) = hidden`` over a head with taps, else ``ValueError``."""
    if rank is None:
        return None
    if taps is None:
        raise ValueError(f"{name} sets the rank of the map that fuses the tapped layers: it needs taps (fused "
                         f"features); got {name} {rank!r} without taps.")
    bound = min(len(taps) * hidden, hidden)
    return check_int(name, rank, 1, bound, upto=f"{bound} (the hidden size)")


class FactoredLinear(nn.Module):
    """A linear map without bias stored as a product: ``up(down(x))``, ``down`` ``[rank, in]`` then
    ``up`` ``[out, rank]``; ``rank·(in + out)`` parameters where a full matrix has ``in·out``.
    Both factors are ``nn.Linear`` (int8 storage and low-rank deltas treat them as any other)."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=False)

    @property
    def rank(self) -> int:
        return self.down.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


def fuse_map(taps: int, hidden: int, rank: int | None = None) -> nn.Module:
    """The ``taps·hidden → hidden`` map without bias (a zero feature stays zero): one matrix, or
    with ``rank`` a :class:`FactoredLinear` through ``rank`` dimensions."""
    if rank is None:
        return nn.Linear(taps * hidden, hidden, bias=False)
    return FactoredLinear(taps * hidden, hidden, rank)
