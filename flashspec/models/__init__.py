"""How models run: loading (folders, hub ids, GGUF), the caches the decode loop rolls back,
CUDA-graph replay and tensor parallelism (SPEC.md §3, §7, §9)."""

from .cached import CachedLM, make_lm
from .static import StaticLM

__all__ = ["CachedLM", "StaticLM", "make_lm"]
