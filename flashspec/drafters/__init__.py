"""Drafters: objects that propose tokens for the target to verify (SPEC.md §4, §11).

The contract is :class:`Drafter` (``name``, ``begin``, ``propose``); optional capabilities are the
protocols :class:`CatchesUp`, :class:`JoinsRows`, :class:`CapturesJoins`, :class:`ReadsFeatures`,
:class:`TimesForwards`, :class:`DraftsInChunks` and :class:`ExpandsTrees` (top-k draft trees, :class:`TreeExpansion`).
:func:`~flashspec.drafters.specs.make_drafter` turns the names the engine, the command line and the server take into drafters.
"""

from .base import (
    CapturesJoins,
    CatchesUp,
    Draft,
    Drafter,
    DraftsInChunks,
    History,
    JoinsRows,
    ReadsFeatures,
    TimesForwards,
)
from .datastore import DatastoreDrafter
from .early_exit import EarlyExitDrafter
from .expansion import ExpandedDraft, ExpandsTrees, TreeExpansion
from .feature import FeatureDrafter, FeatureHead
from .model import ModelDrafter
from .ngram import NgramDrafter
from .shallow import ShallowDrafter, ShallowHead

__all__ = ["CapturesJoins", "CatchesUp", "DatastoreDrafter", "Draft", "Drafter", "DraftsInChunks", "EarlyExitDrafter",
           "ExpandedDraft", "ExpandsTrees", "FeatureDrafter", "FeatureHead", "History", "JoinsRows", "ModelDrafter",
           "NgramDrafter", "ReadsFeatures", "ShallowDrafter", "ShallowHead", "TimesForwards", "TreeExpansion"]
