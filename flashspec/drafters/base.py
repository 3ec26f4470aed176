"""The small protocol every drafter implements (SPEC.md §4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import SamplingParams, probabilities, sample


@dataclass
class History:
    """The committed tokens of every row: ``tokens[b, :length[b]]`` (prompt, then output).

    The last committed token of a row (``length[b] - 1``) is the *pending* token: the next
    draft continues from it.
    """

    tokens: torch.Tensor  # [B, capacity] long
    length: torch.Tensor  # [B] long
    active: torch.Tensor | None = None  # [B] bool: rows still generating (None: all of them)
    # A host-side fact, so a drafter can size its work without reading tensors back:
    max_length: int | None = None  # an upper bound on length.max() (None: tokens.shape[1])
    # {n: [B, capacity, hidden]}: the target's features after its first n layers (all of them:
    # before its final norm) at every committed position but the pending one; only for drafters
    # with ``uses_hidden_states`` (n is their ``feature_layer``).
    hidden: dict[int, torch.Tensor] | None = None

    def length_bound(self) -> int:
        return self.max_length if self.max_length is not None else self.tokens.shape[1]


@dataclass
class Draft:
    """``tokens [B, k]`` proposed ids; ``probs [B, k, V]`` the processed laws they were drawn
    from, or ``None`` when the proposal is deterministic (verified with one-hot q).

    Optional, for the verify reuse of SPEC.md §11 (a shallow drafter with ``reuse=True``):
    ``states [B, k, hidden]``, the target's own output after its first ``states_layer`` layers
    at the positions the drafter fed through them — the pending token at ``length - 1`` and
    ``d_1 … d_{k-1}`` after it — computed by one-token target forwards over the target's cache,
    whose entries of those layers at those positions the drafter wrote with them. The verify
    forward then runs those layers for ``d_k`` only and the later layers from these states."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    states: torch.Tensor | None = None
    states_layer: int | None = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens (SPEC.md §4). The engine calls ``begin`` once per ``generate``,
    then ``propose`` at each step this drafter's arm is chosen for. There is no feedback call:
    what was accepted is in the :class:`History` of the next ``propose`` (the committed tokens),
    and a drafter with a cache catches up from it — also after steps another drafter drafted.

    Optional: ``catch_up(history) -> int``, for a drafter with a cache: how many committed
    positions its next proposal must feed beyond a steady step's (its first proposal of a
    request feeds the prompt; after a gap, what it missed), 0 when caught up, from host
    arithmetic only — the never-slower guard prices the proposal with it (SPEC.md §8);
    ``prefill_row(history, row, width=None)``, to feed a row that joins a running batch (§12);
    ``forward_seconds``, the host
    time spent in its model forwards so far (the statistics' engine-overhead figure);
    ``uses_hidden_states = True`` with ``feature_layer = n``, to be handed the target's features
    after its first ``n`` layers in ``History.hidden[n]`` (written by the target's own forwards, no
    host synchronisation; SPEC.md §11)."""

    name: str

    def begin(self, batch_size: int) -> None:
        """Start a new batch: forget all previous state."""

    def propose(
        self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor
    ) -> Draft:
        """Exactly ``num_tokens`` drafts per row (``Draft.tokens`` is ``[B, num_tokens]``).

        ``uniforms [B, num_tokens]`` float64 are the random numbers for sampled drafts."""


def continuation(
    source: torch.Tensor, follow: torch.Tensor, end: torch.Tensor | int, num_tokens: int, pending: torch.Tensor
) -> torch.Tensor:
    """``[B, num_tokens]`` drafts: the tokens of ``source`` from position ``follow[b]`` on —
    ``source`` is ``[B, L]`` (each row its own text) or ``[L]`` (one store for every row) —
    and, where ``follow[b] < 0`` or past ``end`` (exclusive; per row or one number), the
    pending token ``pending [B, 1]``. Always ``num_tokens`` columns: shapes known on the host,
    nothing read back; a repeated pending token is a guess verified like any other."""
    offsets = torch.arange(num_tokens, device=follow.device)
    index = follow[:, None] + offsets
    end = end[:, None] if isinstance(end, torch.Tensor) else end
    usable = (follow[:, None] >= 0) & (index < end)
    index = index.clamp(0, source.shape[-1] - 1)
    taken = source.gather(1, index) if source.dim() == 2 else source[index]
    return torch.where(usable, taken, pending)



def draw(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of ``logits [B, V]``: the argmax when greedy, else a draw with
    ``uniforms [B]`` from the processed law ``q [B, V]``, returned with it (None when greedy)."""
    if params.do_sample:
        q = probabilities(logits, params)
        return sample(q, uniforms), q
    return logits.float().argmax(dim=-1), None
