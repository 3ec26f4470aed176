"""The decode loop's buffers and what the engine hands a loop (SPEC.md §7).

:class:`Workspace` holds the device tensors of a decode loop; captured CUDA graphs read and write
these exact tensors, so they are filled in place for each request. :class:`Plan` is everything a
loop needs from the engine: the loop reads nothing else of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..drafters.base import Drafter
from ..models.graphs import Graphs
from ..select import Selector
from ..select.guard import Guard

__all__ = ["FAULTS", "Plan", "Workspace", "raise_fault", "workspace_shape"]


def workspace_shape(rows: int, length: int, gamma: int, num_eos: int, hidden: int = 0,
                    feature_layers: tuple[int, ...] = ()) -> tuple[Any, ...]:
    """``(batch, capacity, γ, EOS ids, hidden, feature layers)`` of the buffers of ``rows`` rows
    of up to ``length`` tokens (prompt + new) with drafts of up to ``gamma`` tokens: room for the
    longest row plus one step of drafts past its budget (never committed), rounded up so that
    requests of similar sizes share buffers and graphs; ``hidden`` and ``feature_layers``: the
    target's feature size and the layer counts after which drafters read its features (SPEC.md
    §11; none: no feature buffers)."""
    capacity = -(-(length + gamma + 2) // 256) * 256
    return rows, capacity, gamma, max(num_eos, 1), hidden, tuple(feature_layers)


class Workspace:
    """The device buffers of a decode loop, kept across ``generate`` calls of the same shape.

    Captured CUDA graphs read and write these exact tensors, so they are filled in place for
    each request and replaced (with every graph) only when the batch, capacity or γ changes.
    """

    def __init__(self, batch: int, capacity: int, gamma: int, num_eos: int, hidden: int,
                 feature_layers: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.shape = (batch, capacity, gamma, num_eos, hidden, feature_layers)
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, capacity, **long)
        self.prompt_length = torch.zeros(batch, **long)
        self.length = torch.zeros(batch, **long)
        self.generated = torch.zeros(batch, **long)
        self.max_new_tokens = torch.zeros(batch, **long)
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)
        self.eos = torch.full((num_eos,), -1, **long)  # -1 pads: never equal to a token
        # Random numbers of a step: drafting [B, gamma], then verification [B, gamma + 1].
        self.random = torch.zeros(batch, 2 * gamma + 1, dtype=torch.float64, device=device)
        self.draft_tokens = torch.zeros(batch, gamma, **long)
        self.draft_probs: torch.Tensor | None = None  # [B, gamma, V], allocated on first use
        # The target's states a drafter handed back for the verify to reuse (Draft.states, SPEC.md
        # §11): [B, gamma, hidden], allocated on first use.
        self.draft_states: torch.Tensor | None = None
        # Per-step log, read lagged: accepted drafts, rows still active, tokens committed.
        self.log = torch.zeros(capacity + 1, 3, **long)
        self.steps_taken = torch.zeros((), **long)
        self.fault = torch.zeros(3, **long)  # the first fault: step + 1 (0: none), row, kind (FAULTS)
        # The target's features after n layers at every fed position, for drafters that read them
        # (SPEC.md §11): {n: [B, capacity, hidden]}, or None.
        self.hidden = {n: torch.zeros(batch, capacity, hidden, dtype=dtype, device=device)
                       for n in feature_layers} or None
        # A tree step's parts and uniforms, in buffers its CUDA graphs read (decode.tree_graph.TreeInputs),
        # made at the first tree step.
        self.tree: Any = None


# What a fault's kind means (Workspace.fault[2]).
FAULTS = {
    1: "the target's logits are not finite (NaN or infinite): the model is broken or overflows in its dtype",
    2: "a token draw found no finite probability mass: the drafter's probabilities are not finite or not a law",
    3: "the drafter proposed token ids outside the target's vocabulary",
}


def raise_fault(fault: list[int]) -> None:
    """A noted fault (``Workspace.fault`` read back) as the ``ValueError`` it stands for."""
    step, row, kind = fault
    if step:
        raise ValueError(f"Generation stopped at decode step {step - 1}, row {row}: {FAULTS[kind]}.")


@dataclass(frozen=True)
class Plan:
    """Everything one decode loop needs, handed over by the engine."""

    target: Any  # the target behind its cache (flashspec.models.static): forward(...), forward_seconds
    drafters: list[Drafter]
    arm_drafters: list[int | None]  # per arm: index into drafters (None: the target-only arm)
    arm_gammas: list[int]  # per arm: its draft length, resolved for this request (0: target-only)
    labels: list[str]  # per arm: "drafter@γ" ("target@0")
    selector: Selector | None  # None: target-only (no arms)
    guard: Guard | None  # the never-slower guard of this request (SPEC.md §8), or None
    graphs: Graphs
    workspace: Workspace
    commit_step: Callable[..., None]  # commit_step, or its compiled form
    stage_drafts: Callable[..., None]  # stage_drafts, or its compiled form
    tp: Any  # flashspec.models.parallel.TensorParallel, or None on one device
    queue_ahead: bool  # queue the next step before a poll waits (CUDA)
    acceptance: str = "token"  # the verification rule: "token" or "block" (SPEC.md §2)
    block_size: int | None = None  # draft, score and verify in chunks of this many drafts (None: one; SPEC.md §2)
