"""Drafter training on several processes (SPEC.md §11.3, "Several processes"): ``torchrun
--nproc-per-node N -m flashspec train-drafter …``, or ``flashspec train-drafter --gpus N``.

One process per GPU (``cuda:LOCAL_RANK``, NCCL), or CPU processes (gloo). Every rank holds the
frozen target and the whole training data and draws the same global batch of rows from the seeded
generator; each computes the target's features and the loss on its own slice of those rows
(:meth:`Ranks.shard`). The trained head is wrapped in PyTorch's ``DistributedDataParallel``
(:meth:`Ranks.loss_of`), whose all-reduce *sums* the ranks' gradients: each rank's loss is its
rows' share of the whole batch's loss, its positions' terms over the count of every rank's
positions (:func:`summed_over_ranks`), so the ranks' losses add up to the loss one process computes
over the whole batch. The step's loss, token counts and clock are agreed with one all-gather
(:meth:`Ranks.agree`), so every rank sets the same learning rates and stops at the same step.
Rank 0 alone estimates acceptance, shows progress and writes the checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import io
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ALONE", "Ranks", "join", "summed_over_ranks", "under_torchrun"]

_COUNTING: list[Any] = []  # the group whose ranks a loss being computed spans (set inside Ranks.loss_of)


def summed_over_ranks(count: torch.Tensor) -> torch.Tensor:
    """``count`` (a sum of loss weights) summed over every rank of the loss being computed, as a
    constant; ``count`` itself outside a loss on several ranks. The training loss divides by it, so
    that each rank's loss is its share of the loss of the whole batch."""
    if not _COUNTING:
        return count
    total = count.detach().clone()
    dist.all_reduce(total, group=_COUNTING[-1])
    return total


def under_torchrun() -> bool:
    """Whether this process is one of several that torchrun started (``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


class _Forward(nn.Module):
    """The module DDP wraps: the trained head, whose forward is any loss function given to it."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, function: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        return function(*args)


def _sum_gradients(group, bucket):  # unannotated: DDP refuses annotations other than its own classes
    """DDP's communication hook: the ranks' gradients summed (DDP's default averages them)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


class Ranks:
    """The processes that train one drafter together: this one is ``rank`` of ``world`` and trains
    on ``device`` (None: the default, CUDA where available). ``Ranks()`` is this process alone;
    :func:`join` gives torchrun's."""

    def __init__(self, group: Any = None, device: str | None = None, owns: bool = False) -> None:
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world = 1 if group is None else dist.get_world_size(group)
        self.device = device
        self._owns = owns

    @property
    def writes(self) -> bool:
        """Whether this rank estimates acceptance, shows progress and writes (rank 0)."""
        return self.rank == 0

    def check_batch(self, batch: int) -> None:
        """A ``ValueError`` unless the global ``batch`` splits evenly over the ranks."""
        if batch % self.world:
            raise ValueError(f"The batch ({batch} sequences per step, over every process) must be divisible by the "
                             f"number of processes ({self.world}): each computes batch / {self.world} of them.")

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a step's global ``rows``."""
        self.check_batch(len(rows))
        size = len(rows) // self.world
        return rows[self.rank * size:(self.rank + 1) * size]

    def loss_of(self, head: nn.Module) -> Callable[..., torch.Tensor]:
        """``loss(function, *args)`` = ``function(*args)``, a loss computed with ``head``'s
        parameters. On several ranks it runs as the forward of DDP over ``head`` (which broadcasts
        rank 0's parameters now), so that the backward pass sums every rank's gradients into each."""
        if self.group is None:
            return lambda function, *args: function(*args)
        ddp = nn.parallel.DistributedDataParallel
        # the head's buffers (a draft vocabulary's ids) never change: not broadcast before each forward
        sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp).parameters else \
            "broadcast_buffers"
        wrapped = ddp(_Forward(head), process_group=self.group, **{sync: False})
        wrapped.register_comm_hook(self.group, _sum_gradients)

        def loss(function: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
            _COUNTING.append(self.group)
            try:
                return wrapped(function, *args)
            finally:
                _COUNTING.pop()

        return loss

    def agree(self, loss: torch.Tensor, tokens: int, scored: torch.Tensor | float, started: float
              ) -> tuple[float, int, int, float]:
        """The step as every rank sees it: the loss and the counts of tokens and of scored
        positions, summed over the ranks, and the seconds since ``started`` (``time.perf_counter()``)
        by the slowest rank's clock."""
        elapsed = time.perf_counter() - started
        if self.group is None:
            return loss.item(), tokens, int(scored), elapsed
        where = self.device or "cpu"
        mine = torch.tensor([loss.item(), tokens, float(scored), elapsed], dtype=torch.float64, device=where)
        parts = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        every = torch.stack(parts).cpu()
        return every[:, 0].sum().item(), int(every[:, 1].sum()), int(every[:, 2].sum()), every[:, 3].max().item()

    def barrier(self) -> None:
        """Wait until every rank is here."""
        if self.group is not None:
            dist.barrier(group=self.group)

    @contextlib.contextmanager
    def first(self) -> Iterator[None]:
        """Rank 0 runs the block before the others (a target fetched once, into one cache)."""
        if not self.writes:
            self.barrier()
        yield
        if self.writes:
            self.barrier()

    def quiet(self) -> contextlib.AbstractContextManager:
        """Standard output kept for rank 0 (errors still show on every rank)."""
        return contextlib.nullcontext() if self.writes else contextlib.redirect_stdout(io.StringIO())

    def close(self) -> None:
        """Leave the process group if :func:`join` started it."""
        if self._owns and dist.is_initialized():
            dist.destroy_process_group()
            self._owns = False


ALONE = Ranks()  # this process alone


def join(device: str | None = None, timeout: float | None = None) -> Ranks:
    """The ranks this process trains with, and (``Ranks.device``) the device it trains on.

    Under torchrun (``WORLD_SIZE`` > 1, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) it joins
    the process group: NCCL on ``cuda:LOCAL_RANK`` where ``device`` is None or ``"cuda"`` and CUDA is
    available, else gloo on the CPU. A process group already joined (e.g. through a ``file://``
    rendezvous) is used as it is. Otherwise: this process alone, on ``device``. ``timeout``: seconds
    a rank waits for the others at a collective before it fails (None: PyTorch's default)."""
    if not dist.is_available():
        if under_torchrun():
            raise ValueError("Training on several processes needs torch.distributed, which this PyTorch build lacks.")
        return Ranks(device=device)
    if not (dist.is_initialized() or under_torchrun()):
        return Ranks(device=device)
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"On several processes each trains on cuda:LOCAL_RANK (or the CPU): give --device cuda, "
                         f"--device cpu or leave it out; got {device!r}.")
    on_gpu = device != "cpu" and torch.cuda.is_available()
    if device == "cuda" and not on_gpu:
        raise ValueError("--device cuda, but CUDA is not available here.")
    where = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    owns = False
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout)
        if on_gpu:
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (see flashspec.models.parallel)
            torch.cuda.set_device(where)
            kwargs["device_id"] = where
        dist.init_process_group("nccl" if on_gpu else "gloo", **kwargs)
        owns = True
    elif on_gpu:
        torch.cuda.set_device(where)
    return Ranks(dist.group.WORLD, str(where), owns)
