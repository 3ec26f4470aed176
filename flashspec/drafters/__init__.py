"""Drafters: objects that propose tokens for the target to verify (SPEC.md §4)."""

from .base import Draft, Drafter, History
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "History", "ModelDrafter", "NgramDrafter"]
