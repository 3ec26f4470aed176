"""Drafters: objects that propose tokens for the target to verify (SPEC.md §4)."""

from .base import Draft, Drafter, History
from .datastore import DatastoreDrafter
from .early_exit import EarlyExitDrafter
from .feature import FeatureDrafter, FeatureHead
from .shallow import ShallowDrafter, ShallowHead
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["DatastoreDrafter", "Draft", "Drafter", "EarlyExitDrafter", "FeatureDrafter", "FeatureHead", "History", "ModelDrafter", "NgramDrafter",
           "ShallowDrafter", "ShallowHead"]
