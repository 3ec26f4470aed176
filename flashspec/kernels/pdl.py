"""Programmatic dependent launch (PDL) for FlashSpec's decode kernels (Hopper and newer; SPEC.md
§3, "Programmatic dependent launch").

A decode forward of a small model is a chain of small kernels, each depending on the one before
(a Qwen2.5-1.5B layer: q/k/v, rotary + cache write, two attention kernels, o, gate/up, down).
In a CUDA graph the gap between two of them is only ≈ 0.45 µs (an H200's kernel timeline), but each kernel still starts cold: its programs are scheduled,
load their first bytes and only then do work. With PDL (a launch attribute, kept by CUDA graphs
as a programmatic edge) the next kernel's programs may be launched while the current one still
runs. Every Triton kernel of the decode forward (:mod:`flashspec.kernels.decode_linear`,
:mod:`flashspec.kernels.rope_kv`, :mod:`flashspec.kernels.attention`) therefore starts with

1. **wait** (``gdc_wait``): returns once the previous kernel has completed and its writes are
   visible. Every kernel of the chain waits before it can complete, so "the previous one has
   completed" means every earlier one has: the order of the whole chain is kept;
2. **let the next kernel launch** (``gdc_launch_dependents``), then read the inputs and compute.

Nothing is read or written before the wait, so the arithmetic and every value are unchanged
(checked bit for bit on an H200: ``tests/kernels/test_pdl.py``). Measured side by side on an
H200 (three rounds, graph replay; BENCHMARKS.md, "Kernels"): the one-token forward of the Qwen2.5-1.5B shape about 10 % faster with
the default maps, of the Llama-3-8B shape 3 %; the 8B shape's 5-token forward 2.3 % slower (not
understood). Prefetching the next kernel's weights into L2 before the wait was tried too and
made things slower (CHANGELOG.md: the prefetched tiles of a 55 MB gate/up or a
117 MB down projection evict one another before they are read).

Bit-exact mode (SPEC.md §14) launches its linear maps and attention without PDL: its
tensor-core tiles hold far more shared memory than the default's, and chained by PDL its
one-token forward of the Qwen2.5-1.5B shape replayed in 2.54 ms against 2.07 launched plainly,
while PDL took the default's from 2.38 to 1.99 ms (an H100, not compiled; CHANGELOG.md).
Why PDL slows these tiles is not known.

A kernel launched after one that does not take part (cuBLAS, inductor's) simply starts when that
one ends. Without PDL support (older GPUs, the CPU interpreter, a Triton without ``launch_pdl``)
the kernels compile without the wait and launch as usual.

``FLASHSPEC_PDL=0`` in the environment turns it off for the process. :data:`ENABLED` holds that
setting and is read at every launch, so assigning it switches PDL for later launches and graph
captures: ``flashspec bench gpu`` does, to time the default maps with PDL off beside them, and so
do the tests. (A captured graph keeps the setting it was captured with.)
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["ENABLED", "enabled", "launch_options"]


def _from_environment() -> bool:
    """``FLASHSPEC_PDL``: unset or ``1`` on, ``0`` off; anything else is refused rather than
    guessed at."""
    value = os.environ.get("FLASHSPEC_PDL", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"FLASHSPEC_PDL must be 1 (use programmatic dependent launch) or 0 (do not); got {value!r}")
    return value == "1"


ENABLED: bool = _from_environment()


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    """Hopper or newer, and a Triton that can both wait (``gdc_wait``) and launch with PDL."""
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if not hasattr(cuda_extra, "gdc_wait") or "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device, exact: bool = False) -> bool:
    """Whether kernels launched on ``device`` use PDL: :data:`ENABLED`, a CUDA device of compute
    capability 9.0 or newer, and a Triton that supports it — never for bit-exact mode's kernels
    (``exact``, SPEC.md §14): chained by PDL, its one-token forward of the Qwen2.5-1.5B shape
    replayed in 2.54 ms, launched plainly in 2.07 (an H100, not compiled; BENCHMARKS.md, issue
    22). Bit-exact mode's rotary kernel, which has no such flag, keeps PDL: between two
    plain launches it starts when the one before it ends, as a plain launch does."""
    if exact or not ENABLED or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _supported(index)


def launch_options(device: torch.device, exact: bool = False) -> dict[str, bool]:
    """Keyword arguments for a Triton launch on ``device``: ``{"launch_pdl": True}`` with PDL
    (:func:`enabled`)."""
    return {"launch_pdl": True} if enabled(device, exact) else {}
