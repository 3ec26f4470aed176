"""A ``generate`` call's arguments, checked and normalised before anything runs (SPEC.md §5).

Every bad value is a ``ValueError`` with a sentence naming the argument, raised before any
device work: the decode loop can then trust what it is given.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .models import check_no_sliding_window, context_window
from .sampling import SamplingParams

__all__ = ["MAX_DRAFT_TOKENS", "MAX_TOKENS_WITHOUT_WINDOW", "Request", "parse_request"]

# γ beyond this never pays (acceptance of the i-th draft decays like α^i) and only allocates.
MAX_DRAFT_TOKENS = 64
# A row's prompt + new tokens when the model's config names no context window (SPEC.md §5).
MAX_TOKENS_WITHOUT_WINDOW = 131_072


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
    num_draft_tokens = _integer(num_draft_tokens, "num_draft_tokens", minimum=1, maximum=MAX_DRAFT_TOKENS)
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
    if limit is None and longest + max_new_tokens > MAX_TOKENS_WITHOUT_WINDOW:
        raise ValueError(
            f"The prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
            f"{MAX_TOKENS_WITHOUT_WINDOW} tokens, the most FlashSpec allocates for a model whose config "
            "names no context window."
        )
    try:
        hash(context)
    except TypeError:
        raise ValueError(f"context must be hashable (a string, a number, a tuple); got {context!r}.") from None
    gamma_max = max([g or num_draft_tokens for g in gammas], default=num_draft_tokens)
    for model in [target, *drafter_models]:
        check_no_sliding_window(model.config, longest + max_new_tokens * (gamma_max + 1))
    return Request(rows, params, eos, max_new_tokens, num_draft_tokens, seed, sync_every, context)


def _integer(value: Any, name: str, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}; got {value!r}.")
    return int(value)


def _token_id(value: Any) -> int | None:
    """``value`` as a token id (a Python or numpy integer, not a bool), else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def prompt_rows(input_ids: Any, attention_mask: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The prompt of each row as a list of ids, padding (``attention_mask == 0``) removed.

    ``input_ids``: a string, a list of strings, a ``[B, L]`` or ``[L]`` tensor, a list of
    token-id lists or one flat list of ids (what ``tokenizer.encode`` returns: one prompt).
    ``attention_mask`` applies to token ids (a tensor or nested lists of 0/1 of the same shape).
    """
    if isinstance(input_ids, str) or (
        isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(s, str) for s in input_ids)
    ):
        if tokenizer is None:
            raise ValueError("String prompts need a tokenizer: pass tokenizer= to SpeculativeEngine.")
        if attention_mask is not None:
            raise ValueError("attention_mask applies to token-id prompts; string prompts are tokenized without padding.")
        texts = [input_ids] if isinstance(input_ids, str) else list(input_ids)
        return _checked([tokenizer(t)["input_ids"] for t in texts], vocab_size)
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [batch, length] tensor; got shape {tuple(input_ids.shape)}.")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids; got a {input_ids.dtype} tensor.")
        rows = input_ids.cpu().tolist()
    elif isinstance(input_ids, (list, tuple)):
        if input_ids and all(_token_id(t) is not None for t in input_ids):
            rows = [list(input_ids)]  # one flat prompt
        elif all(isinstance(r, (list, tuple)) or (isinstance(r, torch.Tensor) and r.dim() == 1) for r in input_ids):
            rows = [r.tolist() if isinstance(r, torch.Tensor) else list(r) for r in input_ids]
        else:
            raise ValueError("input_ids must be a list of token ids (one prompt) or a list of token-id lists; "
                             f"got a list holding {type(input_ids[0]).__name__ if input_ids else 'nothing'}.")
    else:
        raise ValueError(f"input_ids must be a tensor, a list of token-id lists, or strings; got {type(input_ids).__name__}.")
    if attention_mask is not None:
        rows = _unpadded(rows, attention_mask)
    return _checked(rows, vocab_size)


def _unpadded(rows: list[list[Any]], attention_mask: Any) -> list[list[Any]]:
    """Keep the ids whose mask is 1; the mask must have the rows' shape and hold only 0 and 1."""
    shape = [len(r) for r in rows]
    if isinstance(attention_mask, torch.Tensor):
        mask = attention_mask[None] if attention_mask.dim() == 1 and len(rows) == 1 else attention_mask
        if mask.dim() != 2 or list(mask.shape) != [len(rows), max(shape, default=0)] or len(set(shape)) > 1:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                             f"{(len(rows), shape[0]) if len(set(shape)) == 1 else shape}; they must match.")
        mask = mask.cpu().tolist()
    elif isinstance(attention_mask, (list, tuple)):
        mask = [list(m) for m in attention_mask] if all(isinstance(m, (list, tuple)) for m in attention_mask) \
            else [list(attention_mask)] if len(rows) == 1 else None
        if mask is None or [len(m) for m in mask] != shape:
            raise ValueError(f"attention_mask must have the shape of input_ids (rows of lengths {shape}).")
    else:
        raise ValueError(f"attention_mask must be a tensor or nested lists of 0 and 1; got {type(attention_mask).__name__}.")
    out = []
    for i, (row, m) in enumerate(zip(rows, mask)):
        if any(v not in (0, 1) or isinstance(v, float) and v != int(v) for v in m):
            raise ValueError(f"attention_mask row {i} must hold only 0 (padding) and 1 (token); got {m!r}.")
        out.append([t for t, v in zip(row, m) if v == 1])
    return out


def _checked(rows: list[list[Any]], vocab_size: int) -> list[list[int]]:
    if not rows:
        raise ValueError("The batch is empty: give at least one prompt.")
    out = []
    for i, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"Prompt {i} is empty; every row needs at least one token.")
        ids = [_token_id(t) for t in row]
        for t, v in zip(row, ids):
            if v is None or not 0 <= v < vocab_size:
                raise ValueError(f"Prompt {i} contains token id {t!r}, outside the vocabulary [0, {vocab_size}).")
        out.append(ids)
    return out


def eos_ids(eos_token_id: int | Sequence[int] | None, target: Any, vocab_size: int) -> list[int]:
    """The ids that end a row: ``eos_token_id``, or the target's ``generation_config``'s when None."""
    if eos_token_id is None:
        eos_token_id = getattr(target.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    if _token_id(eos_token_id) is not None:
        eos_token_id = [eos_token_id]
    if not isinstance(eos_token_id, (list, tuple, torch.Tensor)):
        raise ValueError(f"eos_token_id must be a token id, a list of them or None; got {eos_token_id!r}.")
    ids = [_token_id(t) for t in (eos_token_id.tolist() if isinstance(eos_token_id, torch.Tensor) else eos_token_id)]
    for t, v in zip(eos_token_id, ids):
        if v is None or not 0 <= v < vocab_size:
            raise ValueError(f"eos_token_id {t!r} is outside the vocabulary [0, {vocab_size}).")
    return ids
