"""What every Triton module of :mod:`flashspec.kernels` shares: the optional Triton import, the
interpreter check, the availability test, the error raised where Triton is needed but missing,
and small host-side helpers.

Triton is optional (the ``gpu`` extra, Linux only): without it ``triton`` and ``tl`` are None,
every kernel module still imports, ``available(...)`` is False everywhere and the PyTorch paths
(references, SDPA, cuBLAS) run instead. Under ``TRITON_INTERPRET=1`` (CPU tests,
tests/conftest.py) the kernels run on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import os

import torch

try:  # the kernel modules import without triton; their kernels need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["available", "device_fn", "importable", "interpreted", "jit", "next_pow2", "require", "tl", "triton"]


def interpreted() -> bool:
    """Whether Triton runs kernels through its interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # pragma: no cover - older triton


def importable() -> bool:
    """Whether ``import triton`` works now (tried afresh on every call, not cached, so tests can
    hide Triton after this module was imported)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernels can run on ``tensor``'s device: Triton imported and ``tensor`` on a
    CUDA device, or on the CPU under Triton's interpreter (tests)."""
    if triton is None:
        return False
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and interpreted()


def require(what: str, tensor: torch.Tensor) -> None:
    """Raise the ``ValueError`` that says how to get ``what`` running unless :func:`available`."""
    if not available(tensor):
        raise ValueError(f"{what} needs Triton and CUDA tensors (or TRITON_INTERPRET=1 on the CPU); "
                         "install the gpu extra on Linux: pip install 'flashspec[gpu]'")


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def jit(**options):
    """``triton.jit(**options)`` as a decorator; without Triton the function itself, so a module
    defining kernels at its top level still imports (its kernels cannot launch)."""
    if triton is None:
        return lambda fn: fn
    return triton.jit(**options)


def device_fn(fn):
    """``@triton.jit`` for a helper called from kernels, except under the interpreter (and without
    Triton), where the plain function runs the same code without the interpreter's cost of about
    1 ms per nested jit call. Decided when the helper is defined, as ``triton.jit`` itself reads
    ``TRITON_INTERPRET`` then."""
    return fn if triton is None or interpreted() else triton.jit(fn)
