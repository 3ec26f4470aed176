"""Training drafters made from the target (SPEC.md §11): the text they learn from
(:mod:`~flashspec.training.data`), the training loop (:mod:`~flashspec.training.train`; heads in
EAGLE-3's layout: :mod:`~flashspec.training.eagle3_head`) and the target's own answers as training
data (:mod:`~flashspec.training.distill`): to corpus prompts, and turn by turn to ShareGPT
conversations (:mod:`~flashspec.training.conversations`), kept as resumable token shards
(:mod:`~flashspec.training.shards`)."""
