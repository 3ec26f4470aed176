"""What a drafter hands the decode loop, checked on the host (SPEC.md §4, §5): the protocol's
shapes, dtypes and devices of a :class:`~flashspec.drafters.base.Draft`, without reading a value
from the device."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_draft"]


def check_draft(drafter: Any, draft: Any, k: int, batch: int, vocab_size: int, device: torch.device,
                target: Any) -> None:
    """``ValueError`` naming ``drafter`` unless ``draft`` holds ``tokens [batch, k]`` (integers on
    ``device``), ``probs [batch, k, vocab_size]`` (floats) or None, and, where it hands the verify
    states to reuse (SPEC.md §11), ``states [batch, k, hidden]`` of a ``target`` over FlashSpec's
    static cache with ``states_layer`` one of its layer counts."""
    tokens, probs = getattr(draft, "tokens", None), getattr(draft, "probs", None)
    where = f"Drafter {getattr(drafter, 'name', drafter)!r} returned"
    if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (batch, k):
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"{where} draft tokens of shape {shape}; the protocol asks for [{batch}, {k}] "
                         "(Draft(tokens [B, k], probs [B, k, V] or None)).")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"{where} {tokens.dtype} draft tokens; token ids are integers.")
    if tokens.device != device:
        raise ValueError(f"{where} draft tokens on {tokens.device}; the target is on {device}.")
    if probs is not None and (not isinstance(probs, torch.Tensor)
                              or tuple(probs.shape) != (batch, k, vocab_size)
                              or not probs.dtype.is_floating_point or probs.device != device):
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"{where} draft probabilities of shape {shape}; the protocol asks for a float "
                         f"[{batch}, {k}, {vocab_size}] tensor on {device}, or None.")
    states, layer = getattr(draft, "states", None), getattr(draft, "states_layer", None)
    if states is None:
        return
    if not hasattr(target, "keys"):
        raise ValueError(f"{where} states for the verify to reuse, but the target does not run over "
                         "FlashSpec's static cache, whose entries a drafter can write.")
    hidden, layers = target.model.config.hidden_size, len(target.base.layers)
    if (not isinstance(states, torch.Tensor) or tuple(states.shape) != (batch, k, hidden)
            or not states.dtype.is_floating_point or states.device != device):
        shape = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
        raise ValueError(f"{where} states of shape {shape}; the protocol asks for a float [{batch}, {k}, "
                         f"{hidden}] tensor on {device} (the target's states at the fed positions), or None.")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer < layers:
        raise ValueError(f"{where} states after {layer!r} layers; states_layer must be an integer from 1 to "
                         f"{layers - 1} (the target has {layers} layers).")
