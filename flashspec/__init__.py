"""FlashSpec: exact speculative decoding for Hugging Face causal language models."""

from .drafters import (
                       DatastoreDrafter,
                       Draft,
                       Drafter,
                       EarlyExitDrafter,
                       FeatureDrafter,
                       FeatureHead,
                       History,
                       ModelDrafter,
                       NgramDrafter,
                       ShallowDrafter,
                       ShallowHead,
                       TreeExpansion,
)
from .engine import SpeculativeEngine
from .sampling import SamplingParams
from .select import Selection
from .stats import GenerationOutput, GenerationStats
from .tuning.auto import calibrated_engine
from .verify import VerifyResult, verify

__all__ = [
    "__version__",
    "Draft",
    "DatastoreDrafter",
    "Drafter",
    "EarlyExitDrafter",
    "FeatureDrafter",
    "FeatureHead",
    "GenerationOutput",
    "GenerationStats",
    "History",
    "ModelDrafter",
    "NgramDrafter",
    "SamplingParams",
    "ShallowDrafter",
    "ShallowHead",
    "Selection",
    "SpeculativeEngine",
    "TreeExpansion",
    "VerifyResult",
    "calibrated_engine",
    "verify",
]
from .version import __version__
