"""The target a user gives the engine — a loaded model or a folder, hub id or ``.gguf`` file —
as a checked causal LM with its tokenizer, if one can be had."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from .loading import check_causal_lm, load_model, load_tokenizer
from .static import StaticLM

__all__ = ["NO_TOKENIZER", "load_target"]

NO_TOKENIZER = "pass tokenizer= to SpeculativeEngine"  # why string prompts cannot work, by default


def load_target(target: Any, tokenizer: Any, device: torch.device, dtype: torch.dtype
                ) -> tuple[PreTrainedModel, Any, str]:
    """The target model (loaded on ``device`` in ``dtype`` when given as a path), its tokenizer
    (``tokenizer``, loaded when a path; else the target folder's, when it has one) and the
    sentence that says why string prompts cannot work when there is no tokenizer. The model's
    training mode is left as it is: the engine switches it only during a call."""
    no_tokenizer = NO_TOKENIZER
    if isinstance(target, (str, bytes)) or hasattr(target, "__fspath__"):
        spec = target.decode() if isinstance(target, bytes) else str(target)
        target = load_model(spec, device, dtype)
        if tokenizer is None:  # token-id prompts need none: a folder without one is still a target
            try:
                tokenizer = load_tokenizer(spec)
            except ValueError as error:
                no_tokenizer = f"none could be loaded from {spec!r} ({error}); pass tokenizer=... to SpeculativeEngine"
    if not isinstance(target, PreTrainedModel):
        raise ValueError("target must be a transformers causal LM or a path / hub id / .gguf file.")
    check_causal_lm(target, "target", known_causal=StaticLM.supports(target))
    if isinstance(tokenizer, str):
        try:
            tokenizer = load_tokenizer(tokenizer)
        except ValueError as error:
            raise ValueError(f"Cannot use {tokenizer!r} as the tokenizer: {error}") from None
    return target, tokenizer, no_tokenizer
