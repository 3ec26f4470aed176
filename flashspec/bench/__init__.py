"""Benchmarks behind ``flashspec bench``: core, e2e, gpu, kernels, tp, bandit."""
