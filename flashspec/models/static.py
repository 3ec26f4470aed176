"""A Llama-family model behind a KV cache the decode loop can roll back (SPEC.md §3).

:class:`StaticLM` answers the call every cached model answers (:meth:`StaticLM.forward`; the
other is :class:`~flashspec.models.cached.CachedLM`): feed ``tokens [B, q]`` at positions
``start[b] .. start[b] + q - 1`` of each row, forgetting whatever the cache held at positions
``>= start[b]``, and return logits. The loop never "rolls back" explicitly: feeding at ``start``
*is* the rollback. The cache is pre-allocated and indexed by position. A token's keys and values
are written at its position, and a query at position ``p`` attends to keys at positions ``<= p``.
Stale entries past a row's length are never read before they are overwritten, so rollback costs
nothing, shapes never change and no step reads anything back to the host: the forward can be
captured in a CUDA graph.

Besides :meth:`~StaticLM.forward` and :meth:`~StaticLM.prefill`, named entry points serve the
drafters made from the target (SPEC.md §11): :meth:`~StaticLM.early_exit`,
:meth:`~StaticLM.layer_states`, :meth:`~StaticLM.forward_embeds` and :meth:`~StaticLM.resume`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel

from ..checks import check_flag, check_int
from ..kernels import attention
from ..kernels.decode_linear import MAX_ROWS as _LINEAR_ROWS
from ..kernels.decode_linear import decode_linear
from ..kernels.rope_kv import rope_write_kv
from .fusion import (
    final_norm_fusable,
    folds_in,
    fuse,
    norms_fusable,
    sixteen_bit,
    write_features,
    write_kv,
)

__all__ = ["StaticLM"]

# SDPA backends for StaticLM's masked attention on CUDA: every one but cuDNN (see StaticLM.forward).
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class StaticLM:
    """A Llama-family causal LM run over a pre-allocated KV cache indexed by position.

    The model's own modules (norms, rotary embedding, projections, activation) do the arithmetic;
    only the cache and the attention call are ours, so every checkpoint transformers loads for
    these architectures works unchanged. The query/key/value projections and the MLP's gate/up
    projections are each fused into one matrix (the model's modules are re-pointed at slices of
    it, so no memory is duplicated and the model still works on its own): fewer, larger matrix
    products, which is what batch-1 decoding on a GPU is short of.

    ``compile=True`` runs short forwards (decode steps) through ``torch.compile``, which fuses
    the small element-wise kernels (norms, rotary embedding, activation); one compilation per
    distinct token count.
    """

    ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
    COMPILED_WIDTHS = 16  # forwards over more tokens (prefills) run eagerly

    def __init__(self, model: PreTrainedModel, compile: bool = False) -> None:
        if not self.supports(model):
            raise ValueError(f"StaticLM does not support model type {model.config.model_type!r}.")
        self.model = model
        self.base = model.model
        first = self.base.layers[0].self_attn
        self.head_dim: int = first.head_dim
        # Read off the projections, not the config: a tensor-parallel rank holds only its share
        # of the heads (flashspec.models.parallel), and its cache only their keys and values.
        self.num_heads: int = first.q_proj.weight.shape[0] // self.head_dim
        self.num_kv_heads: int = first.k_proj.weight.shape[0] // self.head_dim
        self.apply_rope = sys.modules[type(first).__module__].apply_rotary_pos_emb
        self.forward_seconds = 0.0  # host time inside forwards (meaningful on the CPU only)
        self.batch, self.capacity = 0, 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.qkv = [fuse([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.base.layers]
        self.gate_up = [fuse([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.base.layers]
        # Decode forwards on CUDA (SPEC.md §3) use the flash-decoding Triton kernel
        # (flashspec.kernels.attention) and rotate queries and keys and write the cache in one
        # kernel (flashspec.kernels.rope_kv) instead of three; prefills, CPUs and machines without
        # Triton use the model's rotation and PyTorch's SDPA.
        # Which linear maps of a decode forward run through flashspec.kernels.decode_linear, each
        # with the element-wise work around it folded in (16-bit models; decode_maps for one
        # token row, decode_maps_wide for 2 to 16). Defaults (SPEC.md §3): the maps that beat
        # cuBLAS on both an H200's Qwen2.5-1.5B and Llama-3-8B shapes (BENCHMARKS.md, "Kernels");
        # q/k/v with its norm folded in only where the model's norm is the one decode_linear computes.
        self._norms_fusable = norms_fusable(model)
        sixteen = sixteen_bit(model)
        one_row = {"qkv", "o", "down"} if self._norms_fusable else {"o", "down"}
        self.decode_maps = frozenset(one_row) if sixteen else frozenset()
        self.decode_maps_wide = frozenset({"o"}) if sixteen else frozenset()
        self._bit_exact = False
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # bit-exact mode: cos, sin [capacity, D]
        self._compiled = None
        if compile:
            # One compilation per (model, token count, logits_at or not); dynamo counts them per
            # code object, shared by every StaticLM, so the default limit of 8 is too low.
            config = torch._dynamo.config
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(config, name):
                    setattr(config, name, max(getattr(config, name), 64))
            self._compiled = torch.compile(self._forward, dynamic=False)
            self._compiled_inputs = torch.compile(self._inputs, dynamic=False)

    DECODE_MAPS = ("qkv", "o", "gate_up", "down")

    @property
    def bit_exact(self) -> bool:
        """Bit-exact mode (SPEC.md §14): a decode forward's logits, and the keys and values it
        writes, at a position are bit-identical whether the forward feeds 1 token or several per
        sequence and whatever the other sequences of the batch are — every linear map (the output
        head and the norms before them included) through ``decode_linear(..., exact=True)``, the
        attention kernel's exact tiles and splits, rotary tables looked up per position. Setting
        it to True raises ``ValueError`` saying why where it cannot hold."""
        return self._bit_exact

    @bit_exact.setter
    def bit_exact(self, value: Any) -> None:
        check_flag("bit_exact", value)
        if value:
            reason = self._bit_exact_unsupported()
            if reason:
                raise ValueError(f"bit_exact=True is not available here: {reason}.")
        self._bit_exact = value
        self._rotary = None
        if value and self.capacity:
            self._make_rotary_table()

    def _bit_exact_unsupported(self) -> str | None:
        """Why bit-exact mode cannot run for this model here, or None."""
        if not sixteen_bit(self.model):
            return ("it is for bfloat16 and float16 models (in float32 a 1-token and a several-token forward "
                    "already agree to about 1e-6, SPEC.md §7)")
        if getattr(self.model, "_flashspec_tp", None) is not None:
            return "tensor-parallel ranks add partial sums in another order than one GPU (SPEC.md §9)"
        if not (self._norms_fusable and final_norm_fusable(self.model)):
            return ("the model's RMSNorms or its MLP activation are not the ones flashspec's decode kernels "
                    "compute, so its linear maps cannot all run through them")
        attn = self.base.layers[0].self_attn
        if hasattr(attn, "q_norm") and not (folds_in(attn.q_norm) and folds_in(attn.k_norm)):
            return "its per-head query and key norms are not the RMSNorm flashspec's rotation kernel computes"
        param = next(self.model.parameters())
        if not attention.available(param):
            return ("it runs the Triton decode kernels: it needs a CUDA GPU with Triton "
                    "(pip install 'flashspec[gpu]'), or Triton's interpreter on the CPU (TRITON_INTERPRET=1, tests)")
        return None

    def _make_rotary_table(self) -> None:
        """Bit-exact mode: every position's rotary ``cos, sin`` computed once, by the model's own
        rotary embedding, so that forwards of any width read the same values for a position."""
        param = next(self.model.parameters())
        positions = torch.arange(self.capacity, device=param.device)[None]
        probe = torch.zeros(1, self.capacity, 1, dtype=param.dtype, device=param.device)
        cos, sin = self.base.rotary_emb(probe, positions)
        self._rotary = (cos[0].contiguous(), sin[0].contiguous())
        if self._compiled is not None:
            for t in self._rotary:
                torch._dynamo.mark_static_address(t)

    @property
    def decode_maps(self) -> frozenset[str]:
        """The linear maps that forwards of one token row (batch 1, one token: target-only
        decoding, drafting) run through :func:`flashspec.kernels.decode_linear.decode_linear`:
        ``"qkv"`` (with the input RMSNorm), ``"o"`` (with the residual add), ``"gate_up"`` (with the
        RMSNorm and SiLU·up), ``"down"`` (with the residual add). The rest use cuBLAS and the
        model's modules. Default ``{"qkv", "o", "down"}`` for 16-bit models (``{"o", "down"}`` where
        the model's norm is not the one decode_linear folds in), nothing for float32 ones.
        Forwards of 2 to 16 token rows use :attr:`decode_maps_wide`."""
        return self._decode_maps

    @decode_maps.setter
    def decode_maps(self, maps: Any) -> None:
        self._decode_maps = self._checked_maps(maps, "decode_maps")

    @property
    def decode_maps_wide(self) -> frozenset[str]:
        """As :attr:`decode_maps`, for forwards of 2 to 16 token rows (verification, batches),
        where decode_linear runs on tensor cores. Default ``{"o"}`` for 16-bit models."""
        return self._decode_maps_wide

    @decode_maps_wide.setter
    def decode_maps_wide(self, maps: Any) -> None:
        self._decode_maps_wide = self._checked_maps(maps, "decode_maps_wide")

    def _checked_maps(self, maps: Any, name: str) -> frozenset[str]:
        maps = frozenset(maps)
        unknown = maps - set(self.DECODE_MAPS)
        if unknown:
            raise ValueError(f"{name} can hold {', '.join(self.DECODE_MAPS)}; got {sorted(unknown)}")
        if maps and not sixteen_bit(self.model):
            raise ValueError(f"{name} needs a bfloat16 or float16 model; this one keeps cuBLAS")
        if maps & {"qkv", "gate_up"} and not self._norms_fusable:
            raise ValueError(f"{name} 'qkv' and 'gate_up' fold in the model's RMSNorm (and SiLU·up), but this "
                             "model's norm or activation is not the one decode_linear computes")
        return maps

    @classmethod
    def supports(cls, model: PreTrainedModel) -> bool:
        """Whether ``model`` is an architecture this class reproduces exactly."""
        config = model.config
        if getattr(config, "model_type", None) not in cls.ARCHITECTURES:
            return False
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            layer_types = getattr(config, "layer_types", None)
            if layer_types is None or "sliding_attention" in layer_types:
                return False
        base = getattr(model, "model", None)
        return base is not None and hasattr(base, "rotary_emb") and hasattr(base, "layers")

    def reset(self, batch: int, capacity: int) -> bool:
        """Make room for ``batch`` rows of ``capacity`` positions. Returns whether the buffers
        were replaced (graphs that captured the old ones must then be dropped)."""
        if batch == self.batch and capacity <= self.capacity:
            return False
        capacity = -(-capacity // 256) * 256  # round up so nearby requests reuse buffers and graphs
        param = next(self.model.parameters())
        shape = (batch, self.num_kv_heads, capacity, self.head_dim)
        layers = len(self.base.layers)
        self.keys = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(layers)]
        if self._compiled is not None:
            for t in self.keys + self.values:
                torch._dynamo.mark_static_address(t)
        self.batch, self.capacity = batch, capacity
        if self._bit_exact:
            self._make_rotary_table()
        return True

    @contextlib.contextmanager
    def only_row(self, row: int) -> Iterator[None]:
        """Within the block, forwards see a batch of one: row ``row`` of the cache (views of it,
        so what they write lands in that row and no other row is read or written). How a request
        joins a running batch (SPEC.md §12): its prompt is fed alone while the others wait."""
        keys, values, batch = self.keys, self.values, self.batch
        if not 0 <= row < batch:
            raise ValueError(f"Row {row} is outside the cache's batch of {batch}.")
        self.keys = [k[row : row + 1] for k in keys]
        self.values = [v[row : row + 1] for v in values]
        self.batch = 1
        try:
            yield
        finally:
            self.keys, self.values, self.batch = keys, values, batch

    # ------------------------------------------------------------------ entry points
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, real: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, hidden_out: dict[int, torch.Tensor] | None = None,
                eager: bool = False) -> torch.Tensor:
        """Feed ``tokens [B, q]`` at positions ``start[b] + j``; logits ``[B, q, V]``, or only the
        columns ``logits_at [B, m]``. ``real`` is accepted for interface parity and ignored:
        a padding token writes a stale entry that is overwritten before any query can see it.
        ``hidden_out {n: [B, capacity, hidden]}``: also write the output of the first ``n`` layers
        (for ``n`` = all of them: before the final norm) of every fed position there, for drafters
        that read the target's features (SPEC.md §11). ``eager=True``: not through the compiled
        forward even when it is short (:meth:`prefill`)."""
        return self._run(tokens, start, logits_at=logits_at, hidden_out=hidden_out, eager=eager)

    def prefill(self, tokens: torch.Tensor, start: torch.Tensor, real: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, hidden_out: dict[int, torch.Tensor] | None = None,
                ) -> torch.Tensor:
        """:meth:`forward`, never compiled: prefills, whose widths are the prompts' lengths, so
        that a new short prompt never compiles inside its request (SPEC.md §3)."""
        return self._run(tokens, start, logits_at=logits_at, hidden_out=hidden_out, eager=True)

    def early_exit(self, tokens: torch.Tensor, start: torch.Tensor, layers: int,
                   hidden_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits after only the first ``layers`` decoder layers (writing their cache entries),
        then the final norm and the output head: an early exit (SPEC.md §11)."""
        return self._run(tokens, start, layers=layers, hidden_out=hidden_out)

    def layer_states(self, tokens: torch.Tensor, start: torch.Tensor, layers: int | None = None,
                     hidden_out: dict[int, torch.Tensor] | None = None, eager: bool = False) -> torch.Tensor:
        """The output ``[B, q, hidden]`` of the first ``layers`` decoder layers (None: all of them,
        before the final norm) at the fed positions, writing their cache entries; no head."""
        return self._run(tokens, start, layers=layers, hidden_out=hidden_out, head=False, eager=eager)

    def forward_embeds(self, embeds: torch.Tensor, start: torch.Tensor, logits_at: torch.Tensor | None = None,
                       hidden_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """:meth:`forward` fed the input vectors ``embeds [B, q, hidden]`` instead of tokens'
        embeddings (drafters whose inputs are the target's features, SPEC.md §11)."""
        return self._run(None, start, embeds=embeds, logits_at=logits_at, hidden_out=hidden_out)

    def resume(self, states: torch.Tensor, start: torch.Tensor, first_layer: int,
               hidden_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits from ``states [B, q, hidden]``, the output of the first ``first_layer`` layers at
        the fed positions (their cache entries already written): run layers ``first_layer`` on
        only (and write ``hidden_out[first_layer]`` with ``states``) — the verify forward that
        reuses a shallow drafter's states (SPEC.md §11)."""
        stop = len(self.base.layers)
        check_int("first_layer", first_layer, 1, stop, upto=f"the last layer ({stop})")
        return self._run(None, start, embeds=states, hidden_out=hidden_out, first_layer=first_layer)

    @torch.inference_mode()
    def _run(self, tokens: torch.Tensor | None, start: torch.Tensor, *, embeds: torch.Tensor | None = None,
             logits_at: torch.Tensor | None = None, layers: int | None = None,
             hidden_out: dict[int, torch.Tensor] | None = None, head: bool = True, first_layer: int = 0,
             eager: bool = False) -> torch.Tensor:
        """Every entry point's forward: compiled when short (``compile=True``, at most
        :attr:`COMPILED_WIDTHS` tokens, not ``eager``), else eagerly."""
        started = time.perf_counter()
        width = (tokens if embeds is None else embeds).shape[1]
        compiled = self._compiled is not None and width <= self.COMPILED_WIDTHS and not eager
        inputs = (self._compiled_inputs if compiled else self._inputs)(tokens, start, embeds)
        if compiled:
            logits = self._compiled(*inputs, logits_at, layers, hidden_out, head, first_layer)
        elif inputs[0].is_cuda:
            # Prefills (and uncompiled decodes) on CUDA: SDPA without the cuDNN backend, which
            # plans each new query length afresh (SPEC.md §3; about 50 ms per new prompt length
            # on an H200): every request's prompt length is usually new.
            with sdpa_kernel(_SDPA_BACKENDS):
                logits = self._forward(*inputs, logits_at, layers, hidden_out, head, first_layer)
        else:
            logits = self._forward(*inputs, logits_at, layers, hidden_out, head, first_layer)
        self.forward_seconds += time.perf_counter() - started
        return logits

    def _inputs(self, tokens: torch.Tensor | None, start: torch.Tensor,
                embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Embeddings, positions ``[B, q]`` and rotary tables ``cos, sin [B, q, D]`` of a forward.
        Compiled as a graph of its own, so its outputs are buffers every layer reads; inside the
        layers' graph inductor recomputes such cheap values for each opaque op that reads them
        (two small kernels per layer; SPEC.md §3)."""
        x = self.base.embed_tokens(tokens) if embeds is None else embeds
        width = x.shape[1]
        positions = (start[:, None] + torch.arange(width, device=x.device)).clamp(max=self.capacity - 1)
        if self._rotary is not None:  # bit-exact mode: the same values for a position in any forward
            cos, sin = self._rotary[0][positions], self._rotary[1][positions]
        else:
            cos, sin = self.base.rotary_emb(x, positions)
        return x, positions, cos, sin

    def _decode_kernels(self, x: torch.Tensor) -> bool:
        """Whether this forward of ``x [B, q, hidden]`` runs on the Triton decode kernels
        (attention, rotary + cache write, linear maps): CUDA with Triton, ``q ≤ 16`` (in bit-exact
        mode also the CPU under Triton's interpreter: tests)."""
        return bool((x.is_cuda or self._bit_exact) and x.shape[1] <= self.COMPILED_WIDTHS
                    and attention.available(x))

    def _forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        logits_at: torch.Tensor | None, layers: int | None = None,
        hidden_out: dict[int, torch.Tensor] | None = None, head: bool = True, first_layer: int = 0,
    ) -> torch.Tensor:
        batch, width, _ = x.shape
        device = x.device
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        groups = heads // kv_heads
        use_kernel = self._decode_kernels(x)
        if not use_kernel:
            # Query heads h = kv * groups + g share key head kv: fold the groups into the query axis.
            query_positions = positions[:, None, :].expand(batch, groups, width).reshape(batch, 1, groups * width, 1)
            visible = torch.arange(self.capacity, device=device) <= query_positions  # [B, 1, G*q, capacity]
        # Where this forward's keys and values go: [B, H_kv, q, D] indices along the position axis.
        slots = positions[:, None, :, None].expand(batch, kv_heads, width, dim)

        # (Not on tensor-parallel ranks: their o/down projections all-reduce, flashspec.models.parallel.)
        fused = frozenset()
        exact = self._bit_exact and use_kernel  # SPEC.md §14: every map, the head too, any row count
        if exact:
            fused = frozenset(self.DECODE_MAPS)
        elif use_kernel and batch * width <= _LINEAR_ROWS and getattr(self.model, "_flashspec_tp", None) is None:
            fused = self.decode_maps if batch * width == 1 else self.decode_maps_wide

        if first_layer and hidden_out is not None and first_layer in hidden_out:  # the features fed in
            write_features(hidden_out[first_layer], positions, x)
        for i in range(first_layer, len(self.base.layers) if layers is None else layers):
            layer = self.base.layers[i]
            attn, mlp = layer.self_attn, layer.mlp
            if "qkv" in fused:
                norm = layer.input_layernorm
                qkv = decode_linear(x, *self.qkv[i], norm_weight=norm.weight, eps=norm.variance_epsilon, exact=exact)
            else:
                qkv = F.linear(layer.input_layernorm(x), *self.qkv[i])
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q = q.view(batch, width, heads, dim)
            k = k.view(batch, width, kv_heads, dim)
            head_norms = {}
            if hasattr(attn, "q_norm"):  # Qwen3 normalises queries and keys per head
                if exact:  # in the rotation's kernel, a reduction per row whatever the shape (SPEC.md §14)
                    head_norms = dict(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight,
                                      q_eps=attn.q_norm.variance_epsilon, k_eps=attn.k_norm.variance_epsilon)
                else:
                    q, k = attn.q_norm(q), attn.k_norm(k)
            v = v.view(batch, width, kv_heads, dim)
            if use_kernel:  # rotation and cache write in one launch
                q = rope_write_kv(q, k, v, cos, sin, positions, self.keys[i], self.values[i],
                                  **head_norms).transpose(1, 2)
            else:
                q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                write_kv(self.keys[i], self.values[i], k, v.transpose(1, 2), slots)
            if use_kernel:
                out = attention.decode_attention_heads(q, self.keys[i], self.values[i], positions, attn.scaling,
                                                       exact=exact)
                out = out.view(batch, width, heads * dim)
            else:
                q = q.reshape(batch, kv_heads, groups * width, dim)
                out = F.scaled_dot_product_attention(q, self.keys[i], self.values[i], attn_mask=visible, scale=attn.scaling)
                out = out.reshape(batch, heads, width, dim).transpose(1, 2).reshape(batch, width, heads * dim)
            if "o" in fused:
                x = decode_linear(out, attn.o_proj.weight, attn.o_proj.bias, residual=x, exact=exact)
            else:
                x = x + attn.o_proj(out)
            if "gate_up" in fused:
                norm = layer.post_attention_layernorm
                h = decode_linear(x, *self.gate_up[i], norm_weight=norm.weight, eps=norm.variance_epsilon, gated=True,
                                  exact=exact)
            else:
                gate, up = F.linear(layer.post_attention_layernorm(x), *self.gate_up[i]).chunk(2, dim=-1)
                h = mlp.act_fn(gate) * up
            if "down" in fused:
                x = decode_linear(h, mlp.down_proj.weight, mlp.down_proj.bias, residual=x, exact=exact)
            else:
                x = x + mlp.down_proj(h)
            if hidden_out is not None and i + 1 in hidden_out:  # the features after layer i, at their positions
                write_features(hidden_out[i + 1], positions, x)
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        if not head:
            return x
        if exact:  # the final norm and the output head as one more exact map (SPEC.md §14)
            norm, lm_head = self.base.norm, self.model.lm_head
            return decode_linear(x, lm_head.weight, lm_head.bias, norm_weight=norm.weight, eps=norm.variance_epsilon,
                                 exact=True)
        return self.model.lm_head(self.base.norm(x))

