"""A tree step's inputs in buffers that outlive it, so that its work after the proposals replays as
one CUDA graph (SPEC.md §7, "Draft trees in the decode loop", "Tree steps are graphs too").

A captured graph reads and writes the memory it was captured with. The drafters' parts are fresh
tensors at every step (or their own graphs' outputs), so each is copied into the buffer of its
:class:`PartLayout`, and the step's uniforms are drawn into a buffer of their width; all are kept
with the workspace (``Workspace.tree``), whose replacement drops every graph with it. The graph's
key (:func:`graph_key`) names everything else the captured work depends on. Each drafter's drafting
uniforms are copied into a buffer of its own too, so that its proposal graphs, which are dropped when
the buffers they read move, are kept whatever the step's allocation.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams
from .request import MAX_DRAFT_TOKENS
from .tree_build import Part
from .workspace import Workspace

__all__ = ["PartLayout", "TreeInputs", "graph_key", "tree_inputs"]


@dataclass(frozen=True)
class PartLayout:
    """What the captured work reads of one drafter's part besides its values: the drafter, its draft
    length (the part's depth), its node count, whether it is an expansion (parents and depths inside
    the part) and the dtype and vocabulary of its laws (None: point masses)."""

    drafter: int
    depth: int
    nodes: int
    expanded: bool
    laws: tuple[torch.dtype, int] | None


class TreeInputs:
    """The persistent inputs of the tree steps over one workspace: one :class:`Part` of buffers per
    layout, one ``[B, width]`` float64 buffer of uniforms per width, one of drafting uniforms per
    drafter. Allocated on first use; a graph replayed later reads the same storage."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.batch, self.device = batch, device
        self._parts: dict[PartLayout, Part] = {}
        self._uniforms: dict[int, torch.Tensor] = {}
        self._drafting: dict[int, torch.Tensor] = {}

    def uniforms(self, width: int) -> torch.Tensor:
        """The buffer of a step's ``width`` uniforms per row (drafting, then verification)."""
        buffer = self._uniforms.get(width)
        if buffer is None:
            buffer = self._uniforms[width] = torch.zeros(self.batch, width, dtype=torch.float64, device=self.device)
        return buffer

    def drafting(self, drafter: int, uniforms: torch.Tensor) -> torch.Tensor:
        """``uniforms [B, k]`` (drafter ``drafter``'s columns of the step's draw) copied into that
        drafter's own buffer, which its proposal reads: the same storage at every step."""
        buffer = self._drafting.get(drafter)
        if buffer is None:
            buffer = self._drafting[drafter] = torch.zeros(self.batch, MAX_DRAFT_TOKENS, dtype=torch.float64,
                                                           device=self.device)
        view = buffer[:, : uniforms.shape[1]]
        view.copy_(uniforms)
        return view

    def stage(self, drafter: int, depth: int, part: Part) -> tuple[Part, PartLayout]:
        """``part`` (drafter ``drafter``'s, of draft length ``depth``; shapes already checked) copied
        into its layout's buffers; returns those buffers as a part, and the layout. The tokens are
        staged as long integers whatever their type; ids outside the vocabulary are left for the step
        to note (tensor code: nothing is read)."""
        laws = None if part.laws is None else (part.laws.dtype, part.laws.shape[-1])
        layout = PartLayout(drafter, depth, part.nodes, part.parents is not None, laws)
        buffer = self._parts.get(layout)
        if buffer is None:
            buffer = self._parts[layout] = self._allocate(layout)
        buffer.tokens.copy_(part.tokens)
        if buffer.laws is not None:
            buffer.laws.copy_(part.laws)
        if buffer.parents is not None:
            buffer.parents.copy_(part.parents)
            buffer.depths.copy_(part.depths)
        return buffer, layout

    def _allocate(self, layout: PartLayout) -> Part:
        shape, long = (self.batch, layout.nodes), dict(dtype=torch.long, device=self.device)
        laws = None
        if layout.laws is not None:
            dtype, vocab = layout.laws
            laws = torch.zeros(*shape, vocab, dtype=dtype, device=self.device)
        if not layout.expanded:
            return Part(torch.zeros(shape, **long), laws)
        return Part(torch.zeros(shape, **long), laws, parents=torch.zeros(shape, **long),
                    depths=torch.zeros(shape, **long), depth=layout.depth)


def tree_inputs(workspace: Workspace) -> TreeInputs:
    """The workspace's :class:`TreeInputs`, made at its first tree step."""
    if workspace.tree is None:
        workspace.tree = TreeInputs(workspace.tokens.shape[0], workspace.tokens.device)
    return workspace.tree


def graph_key(layouts: Sequence[PartLayout], params: SamplingParams, acceptance: str) -> Hashable:
    """The key of a tree step's graph: the parts' layouts in tree order (which drafters ran, their
    depths, node counts, expansions and laws; none: the target-only step), the sampling parameters
    and the verification rule of a target-only step. The rows, the capacity and the feature buffers
    are the workspace's, whose replacement drops every graph."""
    return "tree", tuple(layouts), params, acceptance
