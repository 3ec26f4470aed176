"""Drafters named as the engine, the command line and the server take them (SPEC.md §4, §11):
a loaded model, a path / hub id / ``.gguf`` file, ``"ngram"``, ``"early-exit:N"``,
``"feature:DIR"``, ``"shallow:DIR"``, ``"eagle3:DIR"`` (an EAGLE-3 head, EAGLE/SpecForge or
speculators layout) or a :class:`~flashspec.drafters.base.Drafter` object."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ..models.loading import check_causal_lm, load_model
from ..models.static import StaticLM
from .base import Drafter
from .checkpoint import load_head
from .datastore import DatastoreDrafter
from .eagle3 import PREFIX as EAGLE3
from .eagle3 import Eagle3Drafter
from .eagle3_formats import load_eagle3_head
from .early_exit import PREFIX as EARLY_EXIT
from .early_exit import EarlyExitDrafter, parse_early_exit
from .feature import PREFIX as FEATURE
from .feature import FeatureDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .shallow import PREFIX as SHALLOW
from .shallow import ShallowDrafter

__all__ = ["make_drafter"]


def make_drafter(spec: Any, *, target: PreTrainedModel, target_lm: Any, device: torch.device, dtype: torch.dtype,
                 compile: bool = False, reuse_shallow: bool = False) -> Drafter:
    """The drafter ``spec`` names, for ``target`` behind ``target_lm`` (its cache, shared by the
    drafters made from the target); models given as paths load on ``device`` in ``dtype``."""
    vocab_size = target.config.vocab_size
    if isinstance(spec, type):  # a class where an object belongs: NgramDrafter for NgramDrafter()
        raise ValueError(f"{spec.__name__} is a class, not a drafter: pass an instance: {_call(spec)}.")
    if isinstance(spec, str) and spec == "ngram":
        return NgramDrafter()
    if isinstance(spec, str) and spec.startswith((EARLY_EXIT, FEATURE, SHALLOW, EAGLE3)):
        return _made_from_target(spec, target, target_lm, compile, reuse_shallow)
    if isinstance(spec, str) and spec.strip().lower() == "ngram":
        raise ValueError(f"Unknown drafter {spec!r}: did you mean 'ngram'? (Drafter names are lower case.)")
    name = None
    if isinstance(spec, str):
        name = Path(spec).stem if spec.endswith(".gguf") else spec.rstrip("/").split("/")[-1]
        try:
            spec = load_model(spec, device, dtype)
        except ValueError as error:
            raise ValueError(f"Cannot use {spec!r} as a drafter: {error}") from None
    if isinstance(spec, PreTrainedModel):
        check_causal_lm(spec, "drafter", known_causal=StaticLM.supports(spec))
        return ModelDrafter(spec, vocab_size, name=name, compile=compile)
    if isinstance(spec, DatastoreDrafter) and spec.max_token >= vocab_size:
        raise ValueError(f"Drafter {spec.name!r} stores token id {spec.max_token}, but the target's vocabulary "
                         f"has {vocab_size} tokens: build the store with the target's tokenizer.")
    if isinstance(spec, Drafter):
        return spec
    raise ValueError(f"Cannot use {spec!r} as a drafter: give a model, a path, 'ngram' or a Drafter.")


def _call(cls: type) -> str:
    """How an instance of ``cls`` is made: ``Name()``, or ``Name(...)`` when it needs arguments."""
    try:
        needed = [p for p in inspect.signature(cls).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        needed = [None]
    return f"{cls.__name__}({'...' if needed else ''})"


def _made_from_target(spec: str, target: PreTrainedModel, target_lm: Any, compile: bool, reuse_shallow: bool
                      ) -> Drafter:
    """``early-exit:N``, ``feature:DIR``, ``shallow:DIR`` or ``eagle3:DIR``: a drafter sharing the
    target, its weights and its cache (SPEC.md §11)."""
    if not isinstance(target_lm, StaticLM):
        raise ValueError(f"{spec!r} needs a target that runs over FlashSpec's static cache "
                         f"(architectures {', '.join(StaticLM.ARCHITECTURES)}).")
    if spec.startswith(EARLY_EXIT):
        return EarlyExitDrafter(target_lm, parse_early_exit(spec, len(target_lm.base.layers)))
    kind, folder = spec.split(":", 1)
    if spec.startswith(EAGLE3):  # an EAGLE-3 head in the EAGLE or speculators layout (SPEC.md §11.9)
        head = load_eagle3_head(folder, target)
        return Eagle3Drafter(target_lm, head, name=f"eagle3-{Path(folder).name or 'head'}")
    head = load_head(folder, target, kind)
    name = f"{kind}-{Path(folder).name or 'drafter'}"
    if kind == "feature":
        return FeatureDrafter(target_lm, head, name=name, compile=compile)
    return ShallowDrafter(target_lm, head, name=name, reuse=reuse_shallow)
