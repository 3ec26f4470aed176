"""Text the benchmarks and the training draw on: the three-domain corpus with its held-out part
(:mod:`~flashspec.data.corpus`)."""
