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

from ..checks import check_flag, check_int
from ..models.loading import check_no_sliding_window, context_window
from ..sampling import SamplingParams
from .chunks import check_block_size

__all__ = ["MAX_DRAFT_TOKENS", "MAX_TOKENS_WITHOUT_WINDOW", "EngineOptions", "Request", "parse_engine_options",
           "parse_request"]

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


@dataclass(frozen=True)
class EngineOptions:
    """``SpeculativeEngine``'s arguments other than the models, checked and normalised."""

    drafters: list[Any]  # drafter specs, one per drafter
    gammas: list[int] | None
    selector_options: dict[str, Any]
    share_selector: bool
    device: torch.device
    dtype: torch.dtype  # for models given as paths
    compile: bool
    block_size: int | None = None  # chunked drafting (SPEC.md §2); None: none


def parse_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` (None: CUDA when available, else the CPU), else a ValueError."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device or its name ('cpu', 'cuda', 'cuda:1'); got {device!r}.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for, but this machine has no CUDA GPU that PyTorch can use.")
    return device


def parse_engine_options(
    *, drafters: Any, gammas: Any, selector_options: Any, share_selector: Any, tokenizer: Any, device: Any,
    dtype: Any, compile: Any, block_size: Any = None,
) -> EngineOptions:
    """Check the constructor's arguments (before any model loads) and return them normalised."""
    check_flag("share_selector", share_selector)
    check_flag("compile", compile)
    block_size = check_block_size(block_size)
    device = parse_device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        from ..models.loading import DTYPES

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be a torch dtype or one of {', '.join(DTYPES)}; got {dtype!r}.")
        dtype = DTYPES[dtype]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype (e.g. torch.bfloat16); got {dtype!r}.")
    if selector_options is None:
        selector_options = {}
    if not isinstance(selector_options, dict) or not all(isinstance(k, str) for k in selector_options):
        raise ValueError(f"selector_options must be a dict of option names to values; got {selector_options!r}.")
    if tokenizer is not None and not isinstance(tokenizer, str) and not (
            callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
        raise ValueError(f"tokenizer must be a tokenizer (callable, with decode), a path or None; got {tokenizer!r}.")
    return EngineOptions(_drafter_specs(drafters), _gammas(gammas), dict(selector_options), share_selector,
                         device, dtype, compile, block_size)


def _drafter_specs(drafters: Any) -> list[Any]:
    """One drafter, or a list or tuple of them, as a list (strings and bytes are one drafter)."""
    if isinstance(drafters, bytes):
        raise ValueError(f"A drafter is a model, a path (str), 'ngram' or a Drafter; got bytes {drafters!r}.")
    if isinstance(drafters, (list, tuple)):
        return list(drafters)
    if drafters is None or isinstance(drafters, (dict, set, numbers.Number)):
        raise ValueError(f"drafters must be a drafter or a list of them (empty: target-only); got {drafters!r}.")
    return [drafters]


def _gammas(gammas: Any) -> list[int] | None:
    if gammas is None:
        return None
    message = f"gammas must be a non-empty list of integers from 1 to {MAX_DRAFT_TOKENS}; got {gammas!r}."
    if not isinstance(gammas, (list, tuple)) or not gammas:
        raise ValueError(message)
    ids = [_token_id(g) for g in gammas]
    if any(g is None or not 1 <= g <= MAX_DRAFT_TOKENS for g in ids):
        raise ValueError(message)
    return ids


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
    if seed is not None and (_token_id(seed) is None or not -(2**63) <= seed < 2**64):
        raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None; got {seed!r}.")
    seed = None if seed is None else _token_id(seed)
    if not do_sample and temperature is not None and (
            isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)):
        raise ValueError(f"temperature must be a number or None (greedy decoding ignores its value); "
                         f"got {temperature!r}.")
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
    check_int(name, value, minimum)
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
        elif any(isinstance(t, (float, np.floating)) for t in input_ids):
            raise ValueError(f"input_ids holds {next(t for t in input_ids if isinstance(t, (float, np.floating)))!r}: "
                             "token ids must be integers (a list of int ids, or a list of token-id lists).")
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
            if v is None and isinstance(t, (numbers.Real, np.floating, torch.Tensor)) and not isinstance(t, bool):
                raise ValueError(f"Prompt {i} contains {t!r}: token ids must be integers (int, not float; "
                                 "a tensor of dtype torch.long).")
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
