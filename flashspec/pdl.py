"""Programmatic dependent launch (PDL) for FlashSpec's decode kernels (Hopper and newer).

A decode forward of a small model is a chain of small kernels, each depending on the one before:
a Qwen2.5-1.5B layer's output projection reads 4.7 MB, about 1.1 µs at copy bandwidth, yet takes
3.7 µs alone (probe 12) — launch, ramp-up and the first weight bytes' trip from HBM, paid once per
kernel, 6 to 10 kernels per layer. With PDL (a launch attribute, kept by CUDA graphs as a
programmatic edge) the next kernel's programs may start while the current one still runs. Every
Triton kernel of the decode forward (:mod:`flashspec.decode_linear`, :mod:`flashspec.rope_kv`,
:mod:`flashspec.attention`) then runs in three parts:

1. **Independent work only.** :func:`flashspec.decode_linear.decode_linear` prefetches its weight
   tile into L2 (weights are never written, so this may overlap anything). Nothing else.
2. **Wait** (``gdc_wait``): returns once the previous kernel has completed and its writes are
   visible. Every kernel of the chain waits before it can complete, so "the previous one has
   completed" means every earlier one has: the order of the chain is kept, not just one link.
3. **Let the next kernel launch** (``gdc_launch_dependents``), then read the inputs (activations,
   the cache, positions) and compute. Every read of something an earlier kernel may write, and
   every write, comes after the wait.

The arithmetic is unchanged: the same instructions compute the same values, only earlier.
A kernel launched after a kernel that does not take part (cuBLAS, inductor's) simply starts when
that one ends; without PDL support (older GPUs, the CPU interpreter) the kernels compile without
the wait and launch as usual.

``FLASHSPEC_PDL=0`` in the environment turns it off (and with it the prefetch) for the process;
:data:`ENABLED` and :data:`PREFETCH` are the switches probes flip between graph captures.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["ENABLED", "PREFETCH", "enabled", "launch_options", "prefetch"]

ENABLED: bool = os.environ.get("FLASHSPEC_PDL", "1") != "0"
PREFETCH: bool = True  # decode_linear's L2 prefetch of its weight tile before the wait (with PDL only)


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


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL: :data:`ENABLED`, a CUDA device of compute
    capability 9.0 or newer, and a Triton that supports it."""
    if not ENABLED or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _supported(index)


def prefetch(device: torch.device) -> bool:
    """Whether decode_linear prefetches its weights before the wait (PDL on and :data:`PREFETCH`)."""
    return PREFETCH and enabled(device)


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a Triton launch on ``device``: ``{"launch_pdl": True}`` with PDL."""
    return {"launch_pdl": True} if enabled(device) else {}
