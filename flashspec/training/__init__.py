"""Training drafters made from the target (SPEC.md §11): the text they learn from
(:mod:`~flashspec.training.data`), the training loop (:mod:`~flashspec.training.train`) and the
target's own answers as training text (:mod:`~flashspec.training.distill`)."""
