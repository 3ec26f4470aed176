"""A ``generate`` call's arguments, checked and normalised before anything runs (SPEC.md §5).

Every bad value is a ``ValueError`` with a sentence naming the argument, raised before any
device work: the decode loop can then trust what it is given.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .models import check_no_sliding_window, context_window
from .sampling import SamplingParams

__all__ = ["Request", "parse_request"]


@dataclass(frozen=True)
class Request:
    """One ``generate`` call, validated: the prompts as id lists and how to continue them."""

    rows: list[list[int]]  # the prompt of each row, padding removed
    params: SamplingParams
    eos: list[int]  # ids that end a row ([]: none)
    max_new_tokens: int
    num_draft_tokens: int  # γ of arms that have none of their own
    seed: int | None
    sync_every: int  # steps between two reads of the device
    context: Hashable  # the selector-state label

    @property
    def longest(self) -> int:
        return max(len(r) for r in self.rows)


def parse_request(
    input_ids: Any,
    *,
    attention_mask: Any,
    max_new_tokens: Any,
    do_sample: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    num_draft_tokens: Any,
    eos_token_id: Any,
    seed: Any,
    sync_every: Any,
    context: Any,
    target: Any,
    tokenizer: Any,
    drafter_models: Sequence[Any],
    gammas: Sequence[int | None],
    device: torch.device,
) -> Request:
    """Check ``generate``'s arguments against the ``target`` model (vocabulary, context window,
    sliding window) and return them as a :class:`Request`. ``drafter_models``: the drafters'
    transformers models (their sliding windows are checked too); ``gammas``: the arms' own draft
    lengths (``None``: ``num_draft_tokens``); ``device``: the engine's (``sync_every``'s default)."""
    params = SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    max_new_tokens = _integer(max_new_tokens, "max_new_tokens", minimum=0)
    num_draft_tokens = _integer(num_draft_tokens, "num_draft_tokens", minimum=1)
    if sync_every is None:
        sync_every = 8 if device.type == "cuda" else 1
    sync_every = _integer(sync_every, "sync_every", minimum=1)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer or None; got {seed!r}.")
    vocab_size = target.config.vocab_size
    rows = prompt_rows(input_ids, attention_mask, tokenizer, vocab_size)
    eos = eos_ids(eos_token_id, target, vocab_size)
    longest = max(len(r) for r in rows)
    limit = context_window(target.config)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(
            f"The prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context window of {limit} tokens."
        )
    try:
        hash(context)
    except TypeError:
        raise ValueError(f"context must be hashable (a string, a number, a tuple); got {context!r}.") from None
    gamma_max = max([g or num_draft_tokens for g in gammas], default=num_draft_tokens)
    for model in [target, *drafter_models]:
        check_no_sliding_window(model.config, longest + max_new_tokens * (gamma_max + 1))
    return Request(rows, params, eos, max_new_tokens, num_draft_tokens, seed, sync_every, context)


def _integer(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    return int(value)


def prompt_rows(input_ids: Any, attention_mask: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The prompt of each row as a list of ids (padding removed)."""
    if isinstance(input_ids, str) or (
        isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(s, str) for s in input_ids)
    ):
        if tokenizer is None:
            raise ValueError("String prompts need a tokenizer: pass tokenizer= to SpeculativeEngine.")
        texts = [input_ids] if isinstance(input_ids, str) else list(input_ids)
        rows = [tokenizer(t)["input_ids"] for t in texts]
    elif isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [batch, length] tensor; got shape {tuple(input_ids.shape)}.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = torch.as_tensor(attention_mask)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                f"{tuple(input_ids.shape)}; they must match."
            )
        rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids.cpu(), attention_mask.cpu())]
    elif isinstance(input_ids, (list, tuple)):
        rows = [list(r) for r in input_ids]
    else:
        raise ValueError("input_ids must be a tensor, a list of token-id lists, or strings.")
    if not rows:
        raise ValueError("The batch is empty: give at least one prompt.")
    for i, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"Prompt {i} is empty; every row needs at least one token.")
        for t in row:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"Prompt {i} contains token id {t!r}, outside the vocabulary [0, {vocab_size}).")
    return rows


def eos_ids(eos_token_id: int | Sequence[int] | None, target: Any, vocab_size: int) -> list[int]:
    """The ids that end a row: ``eos_token_id``, or the target's ``generation_config``'s when None."""
    if eos_token_id is None:
        eos_token_id = getattr(target.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    for t in ids:
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"eos_token_id {t!r} is outside the vocabulary [0, {vocab_size}).")
    return ids
