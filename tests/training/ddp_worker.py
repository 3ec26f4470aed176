"""One rank of the multi-process training tests (``tests/training/test_distributed.py`` starts two
under torchrun: ``python -m torch.distributed.run --standalone --nproc-per-node 2 ddp_worker.py MODE OUT``).

* ``api OUT``: :func:`train_head` on a tiny target over :func:`join`'s ranks, three times: the
  global batch of :data:`OPTIONS` (its head's weights and losses saved for the test to compare with
  one process), a clock that runs 100 s per reading on rank 1 only (how many steps each rank made),
  and a batch the ranks cannot split (the error). Writes ``OUT/api-rank{RANK}.json`` and ``.pt``.
* ``cli OUT ARGS…``: ``flashspec train-drafter ARGS`` as ``python -m flashspec`` runs it, each call
  of ``save_drafter`` noted in ``OUT/writers.txt``. With ``FAIL_AT_STEP=k`` in the environment,
  rank 1 raises at its ``k``-th training step. Exits with the command's code. Without torchrun,
  started with ``RANK``, ``WORLD_SIZE`` and ``FLASHSPEC_TEST_INIT`` (a ``file://`` rendezvous),
  it joins that group first: then no agent stops the other rank when one fails.

The data and target are defined here and imported by the test, so both sides build the same ones.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_models import tiny_model  # noqa: E402

from flashspec.training import train  # noqa: E402
from flashspec.training.train import TrainOptions  # noqa: E402

OPTIONS = TrainOptions(steps=4, batch=4, seq_len=16, unroll=2, estimate_every=100, lr_layers=2e-3, lr_head=4e-3)


def target() -> torch.nn.Module:
    """The tiny frozen target every rank and the single process hold."""
    return tiny_model("llama", seed=3, vocab_size=64)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks ``[N, 16]`` and a loss mask whose rows score very different numbers of positions, so
    that a rank's mean over its own rows is not its share of the batch's mean."""
    generator = torch.Generator().manual_seed(11)
    chunks = torch.randint(0, 64, (24, OPTIONS.seq_len), generator=generator)
    mask = torch.zeros_like(chunks, dtype=torch.bool)
    for row in range(len(chunks)):
        mask[row, : 2 + (row * 5) % OPTIONS.seq_len] = True
    return chunks, mask


class _Clock:
    """``time`` for flashspec.training.distributed whose ``perf_counter`` gains 100 s per reading."""

    def __init__(self) -> None:
        self.gained = 0.0

    def perf_counter(self) -> float:
        self.gained += 100.0
        return time.perf_counter() + self.gained


def api(out: Path) -> None:
    from dataclasses import replace

    from flashspec.training import distributed
    from flashspec.training.distributed import join

    torch.set_num_threads(1)
    ranks = join("cpu", timeout=60)
    model, (chunks, mask) = target(), data()
    report: dict = {"rank": ranks.rank, "world": ranks.world}
    head, log = train.train_head("feature", model, chunks, OPTIONS, mask=mask, progress=False, ranks=ranks)
    torch.save({k: v.detach().clone() for k, v in head.state_dict().items()}, out / f"api-rank{ranks.rank}.pt")
    report["equal"] = {"loss": log["loss"], "tokens": log["tokens"], "target_tokens": log["target_tokens"],
                       "processes": log["processes"]}
    if ranks.rank == 1:
        distributed.time = _Clock()  # this rank alone would think its minute over after the first step
    capped = replace(OPTIONS, steps=50, max_seconds=60.0)
    _, log = train.train_head("feature", model, chunks, capped, mask=mask, progress=False, ranks=ranks)
    distributed.time = time
    report["clock"] = {"steps": len(log["loss"]), "stopped_at_step": log.get("stopped_at_step")}
    try:
        train.train_head("feature", model, chunks, replace(OPTIONS, batch=3), progress=False, ranks=ranks)
        report["odd_batch"] = None
    except ValueError as error:
        report["odd_batch"] = str(error)
    (out / f"api-rank{ranks.rank}.json").write_text(json.dumps(report))
    ranks.close()


def cli(out: Path, argv: list[str]) -> int:
    from flashspec.cli import main
    from flashspec.drafters import checkpoint

    torch.set_num_threads(1)
    rank = os.environ["RANK"]
    save = checkpoint.save_drafter

    def noted(*args, **kwargs):
        with open(out / "writers.txt", "a") as file:
            file.write(f"{rank}\n")
        return save(*args, **kwargs)

    checkpoint.save_drafter = noted
    if "FLASHSPEC_TEST_INIT" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=os.environ["FLASHSPEC_TEST_INIT"], rank=int(rank),
                                world_size=int(os.environ["WORLD_SIZE"]))
    fail_at = int(os.environ.get("FAIL_AT_STEP", "0"))
    if fail_at and rank == "1":
        features_and_logits, calls = train._features_and_logits, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError(f"rank 1 fails at step {fail_at}")
            return features_and_logits(*args, **kwargs)

        train._features_and_logits = failing
    return main(["train-drafter", *argv])


if __name__ == "__main__":
    mode, folder = sys.argv[1], Path(sys.argv[2])
    if mode == "api":
        api(folder)
    else:
        sys.exit(cli(folder, sys.argv[3:]))
