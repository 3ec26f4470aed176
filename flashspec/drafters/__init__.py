"""Drafters: objects that propose tokens for the target to verify (SPEC.md §4)."""

from .base import Draft, Drafter, History
from .datastore import DatastoreDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["DatastoreDrafter", "Draft", "Drafter", "History", "ModelDrafter", "NgramDrafter"]
