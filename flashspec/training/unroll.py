"""Training-time test (SPEC.md §11.6): the attention mask of a drafter's unrolled passes, shared
by the feature drafter's training (:mod:`flashspec.training.train`) and an EAGLE-3 head's
(:mod:`flashspec.training.eagle3_head`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["chain_mask"]


def chain_mask(passes: int, length: int, device: Any = None) -> torch.Tensor:
    """``[passes·length, passes·length]`` boolean attention mask of the unrolled passes (SPEC.md
    §11.6): query ``(a, t)`` — pass ``a`` at position ``t`` — sees pass 1 at positions
    ``s ≤ t − a + 1`` (the committed prefix of a draft chain begun at ``t − a + 1``) and pass
    ``b ∈ 2…a`` at ``s = t − (a − b)`` (the chain's own earlier drafts), as at inference."""
    t = torch.arange(length, device=device)
    rows = []
    for a in range(1, passes + 1):
        blocks = []
        for b in range(1, passes + 1):
            if b == 1:
                block = t[None, :] <= (t[:, None] - a + 1)
            elif b <= a:
                block = t[None, :] == (t[:, None] - (a - b))
            else:
                block = torch.zeros(length, length, dtype=torch.bool, device=device)
            blocks.append(block)
        rows.append(torch.cat(blocks, dim=1))
    return torch.cat(rows, dim=0)
