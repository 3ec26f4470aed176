"""Where FlashSpec keeps what it fetches and measures on this machine."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Fetched models, calibrations and tokenized training text: ``$FLASHSPEC_CACHE`` or
    ``~/.cache/flashspec``."""
    return Path(os.environ.get("FLASHSPEC_CACHE", Path.home() / ".cache" / "flashspec"))
