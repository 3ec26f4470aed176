"""Tensor-parallel targets: one Llama-family model split across the GPUs of a host (SPEC.md §9).

Every process (one per GPU, started by ``torchrun``) runs the same decode loop on the same
inputs with the same random numbers. Only the target is split; drafters are replicated.

The split, Megatron/gpt-fast style, for ``W`` processes:

* attention: each rank keeps ``H / W`` query heads and ``H_kv / W`` key/value heads (rows of
  ``q_proj``, ``k_proj``, ``v_proj`` and their biases), so its KV cache holds only its own heads;
  ``o_proj`` keeps the matching input columns and its partial outputs are **all-reduced**;
* MLP: ``gate_proj``/``up_proj`` keep ``I / W`` rows, ``down_proj`` the matching input columns,
  followed by an **all-reduce**;
* output head: each rank computes the logits of ``ceil(V / W)`` vocabulary entries and the
  logits are **all-gathered** (so every rank holds the same full logits, byte for byte);
* embedding, norms and rotary tables: replicated.

The collectives are ``torch.distributed._functional_collectives`` calls: eager on gloo (CPU
tests), and traceable by ``torch.compile`` and capturable in CUDA graphs on NCCL. The split
modules are ordinary ``nn.Module`` s, so the sharded model also runs through transformers'
own ``forward``/``generate`` on every rank, and :class:`~flashspec.models.static.StaticLM` reads its
per-rank head counts off the projection shapes.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:  # absent from PyTorch builds without torch.distributed; `import flashspec` must not fail there
    import torch.distributed._functional_collectives as funcol
except ImportError:  # pragma: no cover
    funcol = None

__all__ = [
    "TensorParallel",
    "init_tensor_parallel",
    "local_device",
    "check_shardable",
    "shard_model",
    "tensor_parallel_of",
    "load_tensor_parallel",
    "RowParallelLinear",
    "VocabParallelHead",
]

# torch >= 2.13 renames all_gather_tensor (now deprecated) to all_gather_single.
_all_gather = getattr(funcol, "all_gather_single", None) or getattr(funcol, "all_gather_tensor", None)


@dataclass(frozen=True)
class TensorParallel:
    """Which slice of a sharded model this process holds, and the group that holds the rest."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    world_size: int

    @property
    def device(self) -> torch.device:
        """Where host-level collectives put their tensors: the current GPU on NCCL, else CPU."""
        if "nccl" in str(dist.get_backend(self.group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` (contiguous, on :attr:`device`) with group rank 0's, in place."""
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group)
        return tensor

    def shared_seed(self, seed: int | None = None) -> int:
        """Rank 0's ``seed`` (a fresh random one when None) on every rank."""
        if seed is None:
            seed = random.SystemRandom().randrange(2**62)
        return int(self.broadcast_(torch.tensor([seed], dtype=torch.long, device=self.device)).item())

    def shared_floats(self, values: list[float]) -> list[float]:
        """Rank 0's ``values`` on every rank (host numbers such as step durations)."""
        if not values:
            return []
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.broadcast_(tensor).tolist()


def local_device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_tensor_parallel(backend: str | None = None, init_method: str | None = None) -> TensorParallel:
    """Join the process group that ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), or return the one already joined.

    ``backend``: ``"nccl"`` with CUDA, else ``"gloo"``. On NCCL the current GPU becomes
    ``cuda:LOCAL_RANK`` and ``NCCL_NVLS_ENABLE`` defaults to ``0`` (NVLink multicast off; it
    must be set before NCCL starts, which happens here). ``init_method`` (e.g.
    ``"file:///tmp/x"``) replaces the ``MASTER_ADDR``/``MASTER_PORT`` rendezvous.
    """
    if not dist.is_available() or funcol is None:
        raise ValueError("Tensor parallelism needs torch.distributed, which this PyTorch build lacks.")
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            device = local_device()
            torch.cuda.set_device(device)
            kwargs["device_id"] = device  # starts NCCL now, bound to this GPU
        if init_method is not None:
            kwargs.update(init_method=init_method, rank=int(os.environ["RANK"]),
                          world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend, **kwargs)
    group = dist.group.WORLD
    return TensorParallel(group, dist.get_rank(group), dist.get_world_size(group))


def check_shardable(config: Any, world_size: int) -> None:
    """Raise ``ValueError`` unless heads, key/value heads and the MLP width split evenly."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world_size:
            raise ValueError(
                f"Cannot split this model over {world_size} processes: its {name} ({value}) is not "
                f"divisible by {world_size}. Use a number of GPUs that divides it."
            )


class RowParallelLinear(nn.Module):
    """A linear map whose input features are split across ranks: each rank multiplies its slice
    of the input by its columns of the weight, and the partial outputs are summed (all-reduce).
    The bias, if any, is added once, after the sum."""

    def __init__(self, linear: nn.Linear, tp: TensorParallel) -> None:
        super().__init__()
        n = linear.in_features // tp.world_size
        columns = slice(tp.rank * n, (tp.rank + 1) * n)
        self.weight = nn.Parameter(linear.weight[:, columns].contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = n, linear.out_features
        self.group = tp.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = funcol.all_reduce(F.linear(x, self.weight), "sum", self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Module):
    """The output head with the vocabulary split across ranks: each rank computes the logits of
    ``ceil(V / W)`` entries (the last rank's slice padded with zero rows), then every rank
    gathers all of them and drops the padding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel, share: bool) -> None:
        super().__init__()
        vocab = weight.shape[0]
        per_rank = -(-vocab // tp.world_size)
        rows = slice(tp.rank * per_rank, min(vocab, (tp.rank + 1) * per_rank))
        shard = weight[rows]
        # A tied head shares its rows with the (replicated) embedding table; otherwise copy them
        # so that the full head can be freed.
        shard = _pad_rows(shard, per_rank) if shard.shape[0] < per_rank else (shard if share else shard.clone())
        self.weight = nn.Parameter(shard, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(_pad_rows(bias[rows], per_rank), requires_grad=False)
        self.vocab_size, self.world_size, self.group = vocab, tp.world_size, tp.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight, self.bias)  # [..., V / W]
        gathered = _all_gather(local, 0, self.group)  # the ranks' pieces stacked along dim 0
        return torch.cat(gathered.chunk(self.world_size, dim=0), dim=-1)[..., : self.vocab_size]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (a copy)."""
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad])


def _keep_rows(linear: nn.Linear, tp: TensorParallel) -> None:
    """Keep this rank's equal share of ``linear``'s output features (weight rows and bias)."""
    n = linear.out_features // tp.world_size
    rows = slice(tp.rank * n, (tp.rank + 1) * n)
    linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = n
    if hasattr(linear, "_flashspec_fused"):  # a StaticLM fused the full weights: let them go
        del linear._flashspec_fused


def shard_model(model: Any, group: Any = None) -> Any:
    """Keep, in place, this rank's part of a Llama/Qwen2/Qwen3/Mistral causal LM (module
    docstring) and return it. Every rank of ``group`` (default: all processes) must call this
    on the same model. With one process the model is returned unchanged."""
    from .static import (
        StaticLM,  # cache imports nothing from here; imported late all the same
    )

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("shard_model needs a process group: call init_tensor_parallel() first (under torchrun).")
    if not StaticLM.supports(model):
        raise ValueError(
            f"Tensor parallelism supports {', '.join(StaticLM.ARCHITECTURES)} models without a sliding "
            f"window; got model type {getattr(model.config, 'model_type', None)!r}."
        )
    if tensor_parallel_of(model) is not None:
        raise ValueError("This model is already sharded.")
    group = group if group is not None else dist.group.WORLD
    tp = TensorParallel(group, dist.get_rank(group), dist.get_world_size(group))
    check_shardable(model.config, tp.world_size)
    if tp.world_size == 1:
        return model
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                _keep_rows(linear, tp)  # rows are grouped by head, so equal row blocks = whole heads
            attn.o_proj = RowParallelLinear(attn.o_proj, tp)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, tp)
        head = model.lm_head
        tied = head.weight is model.model.embed_tokens.weight
        model.lm_head = VocabParallelHead(head.weight, head.bias, tp, share=tied)
    model._flashspec_tp = tp
    return model


def tensor_parallel_of(model: Any) -> TensorParallel | None:
    """How ``model`` is sharded (None when it is whole)."""
    return getattr(model, "_flashspec_tp", None)


def load_tensor_parallel(
    spec: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None, group: Any = None
) -> Any:
    """Load a checkpoint (folder, hub id or ``.gguf``) and keep this rank's shard on ``device``
    (default :func:`local_device`), in ``dtype`` (default bfloat16 on CUDA, float32 on CPU).
    Joins the torchrun process group first if needed. Every rank reads the whole checkpoint
    into CPU memory once, then keeps its slice."""
    from .loading import load_model

    init_tensor_parallel()
    device = torch.device(device) if device is not None else local_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(spec, "cpu", dtype)
    return shard_model(model, group).to(device)
