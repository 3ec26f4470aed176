"""One way to check the integers, numbers and flags users pass: a ``ValueError`` that names the
argument, says what it must be and shows what it got (SPEC.md §5). ``bool`` is never a number
here, though Python counts it as one."""

from __future__ import annotations

import math
import numbers
import textwrap
from typing import Any

__all__ = ["brief", "check_flag", "check_int", "check_number", "is_int", "is_number"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number (an integer or a float), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``, else ``ValueError``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}.")
    return value


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None, *,
              upto: str | None = None) -> int:
    """``value`` as an ``int`` if it is an integer in ``[low, high]`` (either bound may be None),
    else ``ValueError``: "NAME must be an integer from LOW to HIGH" (``upto`` words the upper
    bound, e.g. "the target's 28"), or ">= LOW"."""
    bounded = high is not None or upto is not None
    if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        if low is not None and bounded:
            rule = f"from {low} to {upto or high}"
        elif low is not None:
            rule = f">= {low}"
        elif bounded:
            rule = f"<= {upto or high}"
        else:
            rule = ""
        raise ValueError(f"{name} must be an integer{' ' + rule if rule else ''}; got {value!r}.")
    return int(value)


def check_number(name: str, value: Any, low: float | None = None, high: float | None = None, *,
                 above: float | None = None, below: float | None = None, rule: str | None = None) -> float:
    """``value`` as a ``float`` if it is a finite real number with ``low <= value <= high`` and
    ``above < value < below`` (each bound optional), else ``ValueError``: "NAME must be RULE"
    (``rule`` in words, by default built from the bounds)."""
    ok = is_number(value) and math.isfinite(value)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    ok = ok and (above is None or value > above) and (below is None or value < below)
    if not ok:
        if rule is None:
            parts = [f">= {low}" if low is not None else "", f"> {above}" if above is not None else "",
                     f"<= {high}" if high is not None else "", f"< {below}" if below is not None else ""]
            rule = "a number " + " and ".join(p for p in parts if p) if any(parts) else "a finite number"
        raise ValueError(f"{name} must be {rule.strip()}; got {value!r}.")
    return float(value)


def brief(error: BaseException | str, limit: int = 300) -> str:
    """``error``'s text in at most ``limit`` characters, cut between words (`` …`` marks the cut):
    errors quoted inside FlashSpec's own messages stay readable instead of ending mid-word."""
    return textwrap.shorten(str(error), limit, placeholder=" …") or str(error)[:limit]

