"""Test-session setup shared by every test file."""

from __future__ import annotations

import os

import torch

# Without CUDA, the Triton verify kernels run on CPU tensors through Triton's interpreter. The
# variable must be set before anything imports triton (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
