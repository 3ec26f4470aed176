"""Scoring a draft tree in one target forward over :class:`~flashspec.models.static.StaticLM`'s
cache, and committing the accepted path (SPEC.md §3, "Scoring a draft tree").

:func:`tree_forward` feeds the root (the last committed token) at its position and every node of
the tree at ``start + depth``, each node attending to the committed context, the root, its
ancestors and itself; it returns the logits :func:`flashspec.draft_tree.verify_tree` reads.
Several nodes share a position, so their keys and values cannot live in the position-indexed
cache: they stay in a :class:`TreeScratch` until :func:`commit_path` copies the accepted path's
into the cache, as if those tokens had been fed as a chain. With ``hidden_out`` (the target's
features, for drafters that read them, SPEC.md §11) the same holds for the outputs of the first
``n`` layers: the root's are written into the feature buffer, the nodes' kept in the scratch until
the commit copies the accepted path's.

The forward runs on the model's own modules and PyTorch's SDPA with an explicit mask, never compiled
(the tree decode loop replays it inside a CUDA graph on a GPU), whatever the ``StaticLM``'s
``compile``, decode maps or bit-exact mode: its results match a chain
forward's to rounding, not bit for bit. (``flashspec.models`` sits beside ``flashspec.draft_tree``
in the layering, so the tree's ancestors and depths are computed here from the parents.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .fusion import write_features, write_kv
from .static import StaticLM

__all__ = ["TreeScratch", "commit_path", "tree_forward", "tree_layers", "tree_layout"]

ROOT = -1
"""The parent index of the root's children (as in :class:`flashspec.draft_tree.DraftTree`)."""


@dataclass
class TreeScratch:
    """The tree nodes' keys and values, ``[B, H_kv, N, D]`` per layer, rotated at each node's own
    position: what :func:`commit_path` copies into the cache for the accepted nodes. With
    ``hidden_out``, also the nodes' features ``{n: [B, N, hidden]}`` (in the buffers' dtype) and
    the buffers ``{n: [B, capacity, hidden]}`` the commit copies the accepted nodes' into: siblings
    share a position, so the forward cannot write them there itself."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    features: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_out: dict[int, torch.Tensor] = field(default_factory=dict)


def tree_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``visible [B, N, N]`` (node ``i`` sees node ``j`` iff ``j`` is ``i`` or an ancestor of it)
    and ``depth [B, N]`` (a child of the root is at 1) of a tree given by ``parents [B, N]``
    (``-1``: the root; else an earlier node). Tensor operations only, one pass over the nodes."""
    batch, n = parents.shape
    visible = torch.eye(n, dtype=torch.bool, device=parents.device).expand(batch, n, n).clone()
    for j in range(n):  # topological order: a parent's row is complete before its children's
        parent = parents[:, j]
        inherited = visible.gather(1, parent.clamp(min=0)[:, None, None].expand(batch, 1, n)).squeeze(1)
        visible[:, j] |= inherited & (parent >= 0)[:, None]
    return visible, visible.sum(dim=-1)  # a node's depth is the number of nodes on its path


def _check_shapes(lm: StaticLM, tokens: torch.Tensor, parents: torch.Tensor, start: torch.Tensor,
                  present: torch.Tensor | None) -> None:
    """What can be checked without reading a tensor back: shapes, dtypes, the cache's size."""
    if lm.capacity == 0:
        raise ValueError("The cache is empty: call lm.reset(batch, capacity) and prefill before scoring a tree.")
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [B, N + 1] (the root, then N >= 1 nodes); got {tuple(tokens.shape)}.")
    batch, width = tokens.shape
    if parents.shape != (batch, width - 1):
        raise ValueError(f"parents must be [B, N] = [{batch}, {width - 1}] for tokens {tuple(tokens.shape)}; "
                         f"got {tuple(parents.shape)}.")
    if start.shape != (batch,):
        raise ValueError(f"start must be [B] = [{batch}]; got {tuple(start.shape)}.")
    if batch != lm.batch:
        raise ValueError(f"The tree has {batch} rows and the cache {lm.batch}.")
    if any(t.dtype != torch.long for t in (tokens, parents, start)):
        raise ValueError("tokens, parents and start must be integer (torch.long) tensors.")
    if present is not None and (present.shape != parents.shape or present.dtype != torch.bool):
        raise ValueError(f"present must be a bool tensor of shape {tuple(parents.shape)}.")


def _check_features(lm: StaticLM, hidden_out: dict[int, torch.Tensor], batch: int) -> None:
    """``hidden_out``'s layer counts are ``1 … layers`` and its buffers ``[B, capacity, hidden]``."""
    layers, hidden = len(lm.base.layers), lm.base.embed_tokens.embedding_dim
    for n, buffer in hidden_out.items():
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= layers:
            raise ValueError(f"hidden_out's keys are layer counts from 1 to {layers}; got {n!r}.")
        if (not isinstance(buffer, torch.Tensor) or buffer.dim() != 3 or buffer.shape[0] != batch
                or buffer.shape[1] < lm.capacity or buffer.shape[2] != hidden):
            shape = tuple(buffer.shape) if isinstance(buffer, torch.Tensor) else type(buffer).__name__
            raise ValueError(f"hidden_out[{n}] must be a [B, capacity, hidden] = [{batch}, {lm.capacity}, {hidden}] "
                             f"tensor; got {shape}.")


def _check_values(lm: StaticLM, tokens: torch.Tensor, parents: torch.Tensor, start: torch.Tensor,
                  present: torch.Tensor) -> None:
    """The checks that read the tensors: a topological tree, tokens in the vocabulary, every
    present node's position inside the cache."""
    n = parents.shape[1]
    vocab = lm.base.embed_tokens.num_embeddings
    if bool(((tokens < 0) | (tokens >= vocab)).any()):
        raise ValueError(f"Token ids must be in [0, {vocab}).")
    index = torch.arange(n, device=parents.device)
    if bool((present & ((parents < ROOT) | (parents >= index))).any()):
        raise ValueError("Each present node's parent must be -1 (the root) or an earlier node (nodes in "
                         "topological order).")
    if bool((present & (parents >= 0) & ~present.gather(1, parents.clamp(0, n - 1))).any()):
        raise ValueError("A present node's parent must be present.")
    if bool((start < 0).any()):
        raise ValueError("start must be >= 0 (the root's position).")
    _, depth = tree_layout(torch.where(present, parents, ROOT))
    deepest = torch.where(present, depth, 0).amax(dim=1)
    if bool((start + deepest >= lm.capacity).any()):
        raise ValueError(f"start + depth must stay below the cache's capacity ({lm.capacity}) for every "
                         "present node: reset the cache with more room.")


def tree_layers(lm: StaticLM, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, *, cached: int = 0,
                before: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None, taps: tuple[int, ...] = (),
                ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], dict[int, torch.Tensor]]:
    """``lm``'s decoder layers on ``x [B, W, hidden]`` at ``positions [B, W]`` under an explicit mask
    (eager, SDPA). The first ``cached`` columns' keys and values are written into the cache at their
    positions (before attention); the others' are returned, ``[B, H_kv, W − cached, D]`` per layer.
    The keys attended are the cache's ``capacity``, then ``before``'s (keys and values per layer of
    nodes fed earlier, ``[B, H_kv, M, D]``), then the returned ones: ``visible [B, W, capacity + M +
    W − cached]`` says which each column sees. Returns the last layer's output (before the final
    norm), the keys, the values, and ``{n: [B, W, hidden]}`` the output of the first ``n`` layers for
    each ``n`` of ``taps``."""
    batch, width, _ = x.shape
    heads, kv_heads, dim = lm.num_heads, lm.num_kv_heads, lm.head_dim
    groups = heads // kv_heads
    # Query heads h = kv * groups + g share key head kv: fold the groups into the query axis.
    keys_seen = visible.shape[-1]
    visible = visible[:, None, None].expand(batch, 1, groups, width, keys_seen).reshape(batch, 1, groups * width,
                                                                                          keys_seen)
    slots = positions[:, :cached, None, None].transpose(1, 2).expand(batch, kv_heads, cached, dim)
    cos, sin = lm.base.rotary_emb(x, positions)
    new_keys, new_values, outputs = [], [], {}
    for i, layer in enumerate(lm.base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = F.linear(layer.input_layernorm(x), *lm.qkv[i]).split(
            [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k = q.view(batch, width, heads, dim), k.view(batch, width, kv_heads, dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises queries and keys per head
            q, k = attn.q_norm(q), attn.k_norm(k)
        v = v.view(batch, width, kv_heads, dim).transpose(1, 2)
        q, k = lm.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if cached:
            write_kv(lm.keys[i], lm.values[i], k[:, :, :cached].contiguous(), v[:, :, :cached].contiguous(), slots)
        new_keys.append(k[:, :, cached:].contiguous())
        new_values.append(v[:, :, cached:].contiguous())
        earlier = [] if before is None else [(before[0][i], before[1][i])]
        keys = torch.cat([lm.keys[i], *(k for k, _ in earlier), new_keys[-1]], dim=2)
        values = torch.cat([lm.values[i], *(v for _, v in earlier), new_values[-1]], dim=2)
        q = q.reshape(batch, kv_heads, groups * width, dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=attn.scaling)
        out = out.reshape(batch, heads, width, dim).transpose(1, 2).reshape(batch, width, heads * dim)
        x = x + attn.o_proj(out)
        gate, up = F.linear(layer.post_attention_layernorm(x), *lm.gate_up[i]).chunk(2, dim=-1)
        x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        if i + 1 in taps:
            outputs[i + 1] = x
    return x, new_keys, new_values, outputs


@torch.inference_mode()
def tree_forward(lm: StaticLM, tokens: torch.Tensor, parents: torch.Tensor, start: torch.Tensor,
                 present: torch.Tensor | None = None, check: bool = True,
                 hidden_out: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, TreeScratch]:
    """Score a draft tree in one forward: ``tokens [B, N + 1]`` are the root (column 0, fed at
    ``start [B]``, its keys and values written into the cache there) and the nodes (column
    ``j + 1`` is node ``j``, with parent ``parents [B, N]``: ``-1`` for the root, else an earlier
    node), node ``j`` at position ``start + depth(j)``. Absent nodes (``present [B, N]`` False)
    are scored as children of the root and seen by no other node; their logits mean nothing.

    Returns ``logits [B, N + 1, V]`` (after the root, then after each node: what
    :func:`~flashspec.draft_tree.verify_tree` reads) and the nodes' keys and values for
    :func:`commit_path`. The cache at positions ``< start`` must hold the committed context.
    ``check=False`` skips the checks that read tensors back to the host (shapes are still checked).

    ``hidden_out {n: [B, capacity, hidden]}``: also the output of the first ``n`` layers (all of
    them: before the final norm), as :meth:`StaticLM.forward <flashspec.models.static.StaticLM.forward>`
    writes it — the root's written at ``start``, the nodes' kept in the scratch for the commit."""
    _check_shapes(lm, tokens, parents, start, present)
    hidden_out = hidden_out or {}
    _check_features(lm, hidden_out, tokens.shape[0])
    present = torch.ones_like(parents, dtype=torch.bool) if present is None else present
    if check:
        _check_values(lm, tokens, parents, start, present)
    started = time.perf_counter()
    batch, width = tokens.shape
    n, capacity, device = width - 1, lm.capacity, tokens.device
    among_nodes, depth = tree_layout(torch.where(present, parents, ROOT))
    positions = (start[:, None] + torch.cat([torch.zeros_like(depth[:, :1]), depth], dim=1)).clamp(max=capacity - 1)
    # Keys: the cache (committed context and the root, positions <= start), then the N nodes.
    committed = (torch.arange(capacity, device=device) <= start[:, None])[:, None].expand(batch, width, capacity)
    root_sees_no_node = torch.zeros(batch, 1, n, dtype=torch.bool, device=device)
    visible = torch.cat([committed, torch.cat([root_sees_no_node, among_nodes], dim=1)], dim=-1)
    x, node_keys, node_values, taps = tree_layers(lm, lm.base.embed_tokens(tokens), positions, visible, cached=1,
                                                  taps=tuple(hidden_out))
    node_features = {}
    for layers, buffer in hidden_out.items():  # the root's features at its position, the nodes' kept
        write_features(buffer, positions[:, :1], taps[layers][:, :1])
        node_features[layers] = taps[layers][:, 1:].to(buffer.dtype)
    logits = lm.model.lm_head(lm.base.norm(x))
    lm.forward_seconds += time.perf_counter() - started
    return logits, TreeScratch(node_keys, node_values, node_features, dict(hidden_out))


@torch.inference_mode()
def commit_path(lm: StaticLM, scratch: TreeScratch, path: torch.Tensor, kept: torch.Tensor,
                start: torch.Tensor) -> None:
    """Copy the accepted nodes' keys and values into the cache: node ``path[b, i]`` (a node index,
    as :class:`~flashspec.draft_tree.TreeVerifyResult` gives it) to position ``start[b] + 1 + i``
    for ``i < kept[b]``, in every layer. Afterwards the cache holds what feeding the root and the
    kept tokens as a chain would have written, so the next forward feeds at ``start + kept + 1``.
    Features the forward kept (its ``hidden_out``) are copied the same way into their buffers.

    Tensor operations only, no read back to the host, static shapes: all ``L`` slots of
    ``path [B, L]`` are written, those past ``kept`` as a repeat of the last kept entry (or of the
    root when none is kept), so no position past ``start + kept`` is touched."""
    batch, n = scratch.keys[0].shape[0], scratch.keys[0].shape[2]
    if path.dim() != 2 or path.shape[0] != batch or not 1 <= path.shape[1] <= n:
        raise ValueError(f"path must be [B, L] with B = {batch} and 1 <= L <= N = {n}; got {tuple(path.shape)}.")
    if kept.shape != (batch,) or start.shape != (batch,):
        raise ValueError(f"kept and start must be [B] = [{batch}]; got {tuple(kept.shape)} and {tuple(start.shape)}.")
    if batch != lm.batch or len(scratch.keys) != len(lm.keys):
        raise ValueError("The scratch does not come from a tree_forward over this cache.")
    length, capacity = path.shape[1], lm.capacity
    kv_heads, dim = lm.num_kv_heads, lm.head_dim
    slot = torch.arange(length, device=path.device)[None]
    last = torch.minimum(slot, kept[:, None] - 1).clamp(0, length - 1)
    # Index into [root, node 0, ..., node N - 1]: the kept node, or the repeat described above.
    source = torch.where(kept[:, None] > 0, 1 + path.gather(1, last).clamp(0, n - 1), 0)
    target = (start[:, None] + torch.minimum(slot + 1, kept[:, None])).clamp(0, capacity - 1)

    def spread(index: torch.Tensor) -> torch.Tensor:
        return index[:, None, :, None].expand(batch, kv_heads, index.shape[1], dim)

    at = start.clamp(0, capacity - 1)[:, None]
    sources, targets, root = spread(source), spread(target), spread(at)
    for i in range(len(lm.keys)):
        keys = torch.cat([lm.keys[i].gather(2, root), scratch.keys[i]], dim=2).gather(2, sources)
        values = torch.cat([lm.values[i].gather(2, root), scratch.values[i]], dim=2).gather(2, sources)
        write_kv(lm.keys[i], lm.values[i], keys, values, targets)
    for layers, features in scratch.features.items():  # [root, nodes] → the same slots of the feature buffer
        buffer, hidden = scratch.hidden_out[layers], features.shape[-1]
        root_feature = buffer.gather(1, at[..., None].expand(batch, 1, hidden))
        chosen = torch.cat([root_feature, features], dim=1).gather(1, source[..., None].expand(-1, -1, hidden))
        write_features(buffer, target, chosen)
