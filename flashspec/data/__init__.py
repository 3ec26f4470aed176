"""Text the benchmarks and the training draw on: the three-domain corpus with its held-out part
(:mod:`~flashspec.data.corpus`), the field's benchmark workloads, MT-bench and HumanEval
(:mod:`~flashspec.data.workloads`, files fetched by :mod:`~flashspec.data.registry`), code-edit and
extraction requests cut from the held-out part (:mod:`~flashspec.data.quoting`), and ShareGPT
conversations for training (:mod:`~flashspec.data.sharegpt`)."""
