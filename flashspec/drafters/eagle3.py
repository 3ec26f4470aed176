"""EAGLE-3 draft heads as their authors define them (SPEC.md §11.9).

EAGLE-3 (arXiv 2503.01840; SafeAILab/EAGLE, SpecForge, vLLM, SGLang, ``speculators``) differs
from FlashSpec's own fused-feature head (:class:`~flashspec.drafters.feature.FeatureHead`) in its
one decoder layer: the attention reads the 2·hidden pair ``[input_layernorm(e_t);
hidden_norm(g_{t-1})]`` (q/k/v projections 2·hidden → …), and the residual stream starts from
the fused feature ``g`` itself, not from ``fc([g; e])``. :class:`Eagle3Head` holds that layer with
the checkpoint's own final norm and draft-vocabulary head, under ``speculators``' tensor names;
:class:`Eagle3Drafter` drives it with :class:`FeatureDrafter`'s machinery (catch-up windows,
joins, draws in the draft vocabulary) over a KV cache of its own, run eagerly (no
``torch.compile``; on CUDA the proposal is still captured as a graph).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from ..models.graphs import Graphs
from ..models.static import StaticLM
from .base import Seen
from .feature import FeatureDrafter, tapped_layers

__all__ = ["PREFIX", "DraftVocabHead", "Eagle3Drafter", "Eagle3Head", "eagle3_attention"]

PREFIX = "eagle3:"


class DraftVocabHead(nn.Module):
    """EAGLE-3's ``lm_head`` over its draft vocabulary (``[draft_vocab, hidden]``, a parameter of
    the checkpoint, not the target's). ``vocab [draft_vocab]`` holds the target id of each draft
    id (``d + d2t[d]``), or None when the draft vocabulary is the target's, in order. With
    ``compact`` it returns the draft-vocabulary logits only (:func:`draw_in_subset` draws and maps
    them back); else full-vocabulary logits, ``-inf`` outside ``vocab`` (as :class:`SubsetHead`)."""

    compact = False

    def __init__(self, hidden: int, draft_vocab: int, vocab_size: int, vocab: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(draft_vocab, hidden))
        self.vocab_size = vocab_size
        self.register_buffer("vocab", vocab, persistent=False)

    def subset(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.subset(x)
        if self.vocab is None or self.compact:
            return small
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(-1, self.vocab, small)


class _Attention(nn.Module):
    """EAGLE-3's attention projections: q/k/v over the 2·hidden pair, o back to hidden; q/k
    RMSNorms per head when the layer is Qwen3's."""

    def __init__(self, config: Any, qk_norm: bool) -> None:
        super().__init__()
        hidden, heads, kv, dim = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                  config.head_dim)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * hidden, heads * dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, kv * dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, kv * dim, bias=bias)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=bias)
        self.q_norm = LlamaRMSNorm(dim, eps=config.rms_norm_eps) if qk_norm else None
        self.k_norm = LlamaRMSNorm(dim, eps=config.rms_norm_eps) if qk_norm else None


class _Layer(nn.Module):
    """EAGLE-3's decoder layer (``midlayer`` / ``layers.0``): its weights, named as the formats name them."""

    def __init__(self, config: Any, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = _Attention(config, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def eagle3_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q [B, heads, W, d]`` at ``positions [B, W]`` over a cache
    ``keys, values [B, kv, C, d]``: key ``j`` is seen from position ``p`` when ``1 ≤ j ≤ p``.
    Position 0 holds FlashSpec's pair ``(0, e_0)``, which EAGLE-3 never forms (its first pair is
    ``(h_0, x_1)``), so no later query reads it; a query at 0 reads only itself (its logits are
    never drafted from). Query head ``h`` reads key-value head ``h // (heads / kv)``; the groups
    are folded into the query rows, so the cache is never repeated."""
    batch, heads, width, dim = q.shape
    kv = keys.shape[1]
    groups = heads // kv
    rows = q.reshape(batch, kv, groups * width, dim)  # row g·W + w: head kv·groups + g, position w
    p = positions.repeat(1, groups)[:, None, :, None]  # [B, 1, groups·W, 1]
    j = torch.arange(keys.shape[2], device=q.device)
    seen = (j <= p) & ((j >= 1) | (p == 0))  # [B, 1, groups·W, C]
    out = torch.nn.functional.scaled_dot_product_attention(rows, keys, values, attn_mask=seen)
    return out.reshape(batch, heads, width, dim)


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head: ``fc`` over the tapped layers' outputs side by side (optionally
    RMS-normed first: ``input_norm`` over the whole concatenation, or ``fc_norm`` per tap), one
    EAGLE-3 layer, its own final ``norm`` and a draft-vocabulary head. ``taps`` are FlashSpec tap
    indices (0-based decoder-layer outputs, SPEC.md §11.8). ``embed``: the checkpoint's own token
    embedding when it differs from the target's (else None: the target's is used).

    Options of the formats: ``norm_before_residual`` (the residual is ``hidden_norm(g)``, not
    ``g``), ``norm_output`` (the normed layer output is fed back, EAGLE 3.1), ``fc_bias``."""

    def __init__(self, config: Any, taps: tuple[int, ...], vocab_size: int, draft_vocab: int,
                 vocab: torch.Tensor | None = None, *, fc_bias: bool = False, qk_norm: bool = False,
                 norm_before_residual: bool = False, norm_before_fc: bool = False, fc_norm: bool = False,
                 norm_output: bool = False, embed: torch.Tensor | None = None) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config, self.taps = config, tuple(taps)
        self.norm_before_residual, self.norm_output = norm_before_residual, norm_output
        self.input_norm = LlamaRMSNorm(len(taps) * hidden, eps=eps) if norm_before_fc else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(hidden, eps=eps) for _ in taps) if fc_norm else None
        self.fc = nn.Linear(len(taps) * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([_Layer(config, qk_norm)])
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.lm_head = DraftVocabHead(hidden, draft_vocab, vocab_size, vocab)
        self.embed_tokens = None if embed is None else nn.Embedding.from_pretrained(embed, freeze=True)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def fused(self, target_features: torch.Tensor) -> torch.Tensor:
        """``g = fc([h_a; h_b; h_c])`` for the tapped outputs side by side ``[..., taps·hidden]``."""
        x = target_features
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def layer(self, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's layer on pairs ``(g_{t-1}, e_t)``: ``embeddings, features [B, W, hidden]`` at
        FlashSpec positions ``positions [B, W]``; writes the pairs' keys and values into the cache
        ``keys, values [B, kv, C, d]`` there (clamped to ``C − 1``), then attends. Rotary
        positions are ``t − 1``, as EAGLE-3 numbers the pair ``(h_{t-1}, x_t)``."""
        residual, q, k, v = self._project(embeddings, features, positions)
        dim = q.shape[-1]
        at = positions.clamp(max=keys.shape[2] - 1)[:, None, :, None].expand(-1, k.shape[1], -1, dim)
        keys.scatter_(2, at, k.to(keys.dtype))
        values.scatter_(2, at, v.to(values.dtype))
        return self._finish(residual, eagle3_attention(q, keys, values, positions))

    def attend(self, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
               visible: torch.Tensor, before: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`layer` without a cache, as training runs it (SPEC.md §11.9, "Training a head in
        EAGLE-3's layout"): the pairs ``embeddings, features [B, W, hidden]`` at FlashSpec positions
        ``positions [B or 1, W]`` attend to the keys ``before`` holds (earlier pairs' keys and values
        ``[B, kv, M, d]``) and to their own, as ``visible [W, M + W]`` marks. Returns the output and
        the keys and values of all ``M + W`` pairs."""
        residual, q, k, v = self._project(embeddings, features, positions)
        if before is not None:
            k, v = torch.cat([before[0], k], dim=2), torch.cat([before[1], v], dim=2)
        batch, heads, width, dim = q.shape
        kv = k.shape[1]
        groups = heads // kv
        rows = q.reshape(batch, kv, groups * width, dim)  # row g·W + w: head kv·groups + g, pair w
        out = torch.nn.functional.scaled_dot_product_attention(rows, k, v, attn_mask=visible.repeat(groups, 1))
        return self._finish(residual, out.reshape(batch, heads, width, dim)), k, v

    def placed(self, device: Any, dtype: torch.dtype) -> Eagle3Head:
        """This head on ``device`` in ``dtype``, its rotary frequencies kept in float32 (rotary
        angles are not rounded to a 16-bit dtype)."""
        inv_freq = self.rotary_emb.inv_freq
        head = self.to(device=device, dtype=dtype)
        head.rotary_emb.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        return head

    def tree_layer(self, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor, pending: torch.Tensor, sees: torch.Tensor,
                   before: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`layer` on tree nodes (SPEC.md §7, "Top-k expansion"), writing nothing: each sees the
        cache at ``1 … pending [B]``, the nodes fed before (``before``: their keys and values
        ``[B, kv, M, d]``) that ``sees [B, W, M]`` marks, and itself. Returns the output and the
        nodes' keys and values."""
        residual, q, k, v = self._project(embeddings, features, positions)
        k, v = k.to(keys.dtype), v.to(values.dtype)
        batch, heads, width, dim = q.shape
        kv = keys.shape[1]
        groups, capacity = heads // kv, keys.shape[2]
        j = torch.arange(capacity, device=q.device)
        cache = ((j >= 1) & (j <= pending[:, None]))[:, None].expand(batch, width, capacity)
        itself = torch.eye(width, dtype=torch.bool, device=q.device).expand(batch, width, width)
        visible = torch.cat([cache, sees, itself], dim=-1)
        seen = visible.shape[-1]
        visible = visible[:, None, None].expand(batch, 1, groups, width, seen).reshape(batch, 1, groups * width, seen)
        earlier = [] if before is None else [before]
        all_keys = torch.cat([keys, *(a for a, _ in earlier), k], dim=2)
        all_values = torch.cat([values, *(b for _, b in earlier), v], dim=2)
        rows = q.reshape(batch, kv, groups * width, dim)  # row g·W + w: head kv·groups + g, node w
        out = torch.nn.functional.scaled_dot_product_attention(rows, all_keys, all_values, attn_mask=visible)
        return self._finish(residual, out.reshape(batch, heads, width, dim)), k, v

    def _project(self, embeddings: torch.Tensor, features: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual and the rotated ``q, k [B, heads|kv, W, d]`` and ``v`` of the pairs."""
        block, attn = self.layers[0], self.layers[0].self_attn
        batch, width, _ = features.shape
        residual = features
        hidden = block.hidden_norm(features)
        if self.norm_before_residual:
            residual = hidden
        x = torch.cat([block.input_layernorm(embeddings), hidden], dim=-1)
        dim = self.config.head_dim
        q = attn.q_proj(x).view(batch, width, -1, dim)
        k = attn.k_proj(x).view(batch, width, -1, dim)
        v = attn.v_proj(x).view(batch, width, -1, dim).transpose(1, 2)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = self.rotary_emb(v, positions - 1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return residual, q, k, v

    def _finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The output projection, the residual and the MLP after attention ``[B, heads, W, d]``."""
        block = self.layers[0]
        batch, _, width, _ = attended.shape
        h = residual + block.self_attn.o_proj(attended.transpose(1, 2).reshape(batch, width, -1))
        return h + block.mlp(block.post_attention_layernorm(h))


class _Cache:
    """The head's own KV cache (one layer), with :class:`StaticLM`'s ``reset`` / ``only_row``."""

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.batch, self.capacity = 0, 0
        self.forward_seconds = 0.0  # host time inside forwards (meaningful on the CPU only)

    def reset(self, batch: int, capacity: int) -> bool:
        if batch == self.batch and capacity <= self.capacity:
            return False
        param = self.head.fc.weight
        config = self.head.config
        shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.values = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.batch, self.capacity = batch, capacity
        return True

    @contextlib.contextmanager
    def only_row(self, row: int) -> Iterator[None]:
        keys, values, batch = self.keys, self.values, self.batch
        if not 0 <= row < batch:
            raise ValueError(f"Row {row} is outside the cache's batch of {batch}.")
        self.keys, self.values, self.batch = keys[row : row + 1], values[row : row + 1], 1
        try:
            yield
        finally:
            self.keys, self.values, self.batch = keys, values, batch


class Eagle3Drafter(FeatureDrafter):
    """Drafts with an :class:`Eagle3Head` over the target's tapped features (SPEC.md §11.9).

    The same proposal as :class:`FeatureDrafter` (window feed from the true features, then a
    chain of one-token steps that feed back the layer's own output), with EAGLE-3's layer in
    place of ``fc`` + a decoder layer of the target's class. ``compile`` is accepted and ignored:
    the head runs eagerly."""

    def __init__(self, target: StaticLM, head: Eagle3Head, name: str | None = None, compile: bool = False) -> None:
        if not isinstance(target, StaticLM):
            raise ValueError("An EAGLE-3 drafter needs a target that runs over FlashSpec's static cache "
                             f"(architectures {', '.join(StaticLM.ARCHITECTURES)}).")
        hidden = target.model.config.hidden_size
        if head.config.hidden_size != hidden:
            raise ValueError(f"This EAGLE-3 head has hidden size {head.config.hidden_size}; the target's is {hidden}.")
        layers = len(target.base.layers)
        if max(head.taps) >= layers:
            raise ValueError(f"This EAGLE-3 head reads the target's decoder layers {list(head.taps)} "
                             "(0-based outputs); "
                             f"the target has {layers}.")
        self.target, self.head = target, head
        self.feature_layers = tapped_layers(head.taps, layers)
        self.name = name or "eagle3"
        self.lm: Any = _Cache(head)
        self.compiled = False
        self._feed_step, self._next_step = self._feed, self._next
        self._warm_shape = None
        subset = head.lm_head
        subset.compact = subset.vocab is not None
        self._subset = subset if subset.vocab is not None else None
        self._embed = head.embed_tokens if head.embed_tokens is not None else target.base.embed_tokens
        device = next(target.model.parameters()).device
        self._graphs = Graphs(enabled=device.type == "cuda")
        self._features = None
        self._seen = Seen()

    def network(self, tokens: torch.Tensor, features: torch.Tensor, start: torch.Tensor,
                logits_at: torch.Tensor | None = None,
                hidden_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """EAGLE-3's head on pairs: ``tokens [B, q]`` and the features ``[B, q, H]`` before them
        (fused or predicted) at positions ``start[b] + j``; the logits (draft vocabulary when
        compact) at every position or at ``logits_at [B, m]``; the fed-back feature (the layer's
        output, normed with ``norm_output``) into ``hidden_out``'s buffer."""
        started = time.perf_counter()
        head = self.head
        positions = start[:, None] + torch.arange(tokens.shape[1], device=start.device)
        embeddings = self._embed(tokens).to(features.dtype)
        out = head.layer(embeddings, features, positions, self.lm.keys, self.lm.values)
        normed = head.norm(out)
        if hidden_out:
            own = next(iter(hidden_out.values()))
            at = positions.clamp(max=own.shape[1] - 1)[..., None].expand(-1, -1, own.shape[-1])
            own.scatter_(1, at, (normed if head.norm_output else out).to(own.dtype))
        if logits_at is not None:
            normed = normed.gather(1, logits_at[..., None].expand(-1, -1, normed.shape[-1]))
        logits = head.lm_head(normed)
        self.lm.forward_seconds += time.perf_counter() - started
        return logits

    @property
    def draft_vocab_size(self) -> int:
        return int(self.head.lm_head.weight.shape[0])

    def _tree_network(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                      pending: torch.Tensor, sees: torch.Tensor, scratch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`FeatureDrafter._tree_network` with EAGLE-3's layer (:meth:`Eagle3Head.tree_layer`):
        the fed-back feature is the layer's output, normed with ``norm_output``."""
        started, head = time.perf_counter(), self.head
        embeddings = self._embed(tokens).to(features.dtype)
        before = scratch.get("kv")
        out, keys, values = head.tree_layer(embeddings, features, positions, self.lm.keys, self.lm.values, pending,
                                            sees, before)
        if before is not None:
            keys, values = torch.cat([before[0], keys], dim=2), torch.cat([before[1], values], dim=2)
        scratch["kv"] = (keys, values)
        normed = head.norm(out)
        self.lm.forward_seconds += time.perf_counter() - started
        return head.lm_head(normed), (normed if head.norm_output else out)
