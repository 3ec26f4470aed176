"""Triton kernels of the decode step (CUDA; the CPU runs them through Triton's interpreter in
tests): flash-decoding attention, rotary + cache write, decode linear maps, the verify rule, and
programmatic dependent launch. Every module imports without Triton."""
