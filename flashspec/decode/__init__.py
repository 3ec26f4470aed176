"""The decode loop: one speculative step — select → propose → score → verify → commit → update —
over a batch of rows (:mod:`~flashspec.decode.loop`), its buffers (:mod:`~flashspec.decode.workspace`),
its bookkeeping kernels (:mod:`~flashspec.decode.commit`), a request's checked arguments
(:mod:`~flashspec.decode.request`) and the running batch that requests join and leave
(:mod:`~flashspec.decode.batch`)."""
