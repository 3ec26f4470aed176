"""A step's bookkeeping after verification, as tensor code only (SPEC.md §5, §7): commit the
accepted tokens, note faults for the next poll, stage a drafter's proposal. Nothing here reads
a value back to the host, so on a GPU the engine compiles these functions and they run inside
the step's CUDA graph."""

from __future__ import annotations

import torch

__all__ = ["commit_step", "commit_tokens", "note_fault", "stage_drafts"]


def note_fault(fault: torch.Tensor, rows: torch.Tensor, kind: int, step: torch.Tensor) -> None:
    """Keep ``[step + 1, first row, kind]`` in ``fault`` when ``rows [B]`` (bool) marks a row and no
    fault was noted before (tensor code only: no value goes back to the host)."""
    hit = rows.any() & (fault[0] == 0)
    entry = torch.stack([step + 1, rows.long().argmax(), torch.full_like(step, kind)])
    fault.copy_(torch.where(hit, entry, fault))


def commit_tokens(
    tokens: torch.Tensor, length: torch.Tensor, active: torch.Tensor, generated: torch.Tensor,
    max_new_tokens: torch.Tensor, eos: torch.Tensor, new_tokens: torch.Tensor, num_accepted: torch.Tensor,
) -> torch.Tensor:
    """Append each active row's ``num_accepted + 1`` tokens of ``new_tokens [B, k+1]`` to
    ``tokens [B, capacity]`` at ``length``, cut at the first EOS and at ``max_new_tokens``; update
    ``length``, ``generated`` and ``active`` in place; return how many tokens were committed (a
    device scalar). Tensor code only: no value goes back to the host."""
    columns = torch.arange(new_tokens.shape[1], device=new_tokens.device)
    take = torch.minimum(num_accepted + 1, max_new_tokens - generated)
    is_eos = torch.isin(new_tokens, eos) & (columns < take[:, None])
    first_eos = torch.where(is_eos, columns, new_tokens.shape[1]).amin(dim=1)
    take = torch.minimum(take, first_eos + 1)
    take = torch.where(active, take, 0)
    index = length[:, None] + columns
    write = columns < take[:, None]
    current = tokens.gather(1, index)
    tokens.scatter_(1, index, torch.where(write, new_tokens, current))
    length += take
    generated += take
    finished = (first_eos < take) | (generated >= max_new_tokens)
    active &= ~finished
    return take.sum()


def stage_drafts(
    staged: torch.Tensor, drafts: torch.Tensor, vocab_size: int, active: torch.Tensor, fault: torch.Tensor,
    steps_taken: torch.Tensor,
) -> None:
    """Copy a drafter's ``drafts [B, k]`` into the step's buffer ``staged [B, k]``; ids outside
    ``[0, vocab_size)`` of an active row are noted as fault 3 and staged as 0, so that no kernel
    ever indexes with them (the call fails at the next poll). Tensor code only; the engine
    compiles it on a GPU, as :func:`commit_step`."""
    outside = (drafts < 0) | (drafts >= vocab_size)
    note_fault(fault, outside.any(dim=1) & active, 3, steps_taken)
    staged.copy_(drafts.masked_fill(outside, 0))


def commit_step(
    tokens: torch.Tensor, length: torch.Tensor, active: torch.Tensor, generated: torch.Tensor,
    max_new_tokens: torch.Tensor, eos: torch.Tensor, new_tokens: torch.Tensor, num_accepted: torch.Tensor,
    log: torch.Tensor, steps_taken: torch.Tensor, logits: torch.Tensor, fault: torch.Tensor,
) -> None:
    """A step's bookkeeping after verification: its faults first (in ``fault``, for the next
    poll to raise): target ``logits [B, k + 1, V]`` not finite in an active row (kind 1), a
    draw that found no mass (kind 2: ``-1`` at the recovered or bonus token's column of
    ``new_tokens``, committed as 0 so that steps queued before the poll never index with it);
    then :func:`commit_tokens` for the active rows, the step's log entry (drafts accepted, rows
    active, tokens committed) at ``log[steps_taken]`` (the last row once the log is full), and
    ``steps_taken += 1``."""
    note_fault(fault, ~torch.isfinite(logits).flatten(1).all(dim=1) & active, 1, steps_taken)
    drawn = new_tokens.gather(1, num_accepted[:, None])[:, 0]  # the recovered or bonus token
    note_fault(fault, (drawn < 0) & active, 2, steps_taken)
    new_tokens = new_tokens.clamp(min=0)
    accepted = torch.where(active, num_accepted, 0)
    active_rows = active.sum()
    committed = commit_tokens(tokens, length, active, generated, max_new_tokens, eos, new_tokens, accepted)
    entry = torch.stack([accepted.sum(), active_rows, committed])
    log.index_copy_(0, steps_taken.clamp(max=log.shape[0] - 1)[None], entry[None])
    steps_taken += 1
