"""FlashSpec: exact speculative decoding for Hugging Face causal language models."""

from .drafters import (DatastoreDrafter, Draft, Drafter, EarlyExitDrafter, FeatureDrafter, FeatureHead, History,
                       ModelDrafter, NgramDrafter, ShallowDrafter, ShallowHead)
from .engine import SpeculativeEngine
from .select import Selection
from .stats import GenerationOutput, GenerationStats
from .sampling import SamplingParams
from .verify import VerifyResult, verify

__all__ = [
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
    "VerifyResult",
    "verify",
]
__version__ = "0.1.0"
