"""Text the benchmarks and the training draw on: the three-domain corpus with its held-out part
(:mod:`~flashspec.data.corpus`), the field's benchmark workloads, MT-bench and HumanEval
(:mod:`~flashspec.data.workloads`, files fetched by :mod:`~flashspec.data.registry`), and ShareGPT
conversations for training (:mod:`~flashspec.data.sharegpt`)."""
