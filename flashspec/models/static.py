"""Models behind KV caches that the decode loop can roll back (SPEC.md §3).

Both classes answer one call, :meth:`forward`: feed ``tokens [B, q]`` at positions
``start[b] .. start[b] + q - 1`` of each row, forgetting whatever the cache held at positions
``>= start[b]``, and return logits. The loop never "rolls back" explicitly: feeding at ``start``
*is* the rollback.

* :class:`StaticLM` (Llama-family models): a pre-allocated cache indexed by position. A token's
  keys and values are written at its position, and a query at position ``p`` attends to keys at
  positions ``<= p``. Stale entries past a row's length are never read before they are
  overwritten, so rollback costs nothing, shapes never change and no step reads anything back
  to the host: the forward can be captured in a CUDA graph.
* :class:`CachedLM` (every other causal LM): transformers' ``DynamicCache`` shared by rows of
  different lengths, with *holes* masked out; rollback crops the cache, which reads lengths on
  the host. The reference path for architectures :class:`StaticLM` does not know.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel

from .kernels import attention
from .kernels.decode_linear import MAX_ROWS as _LINEAR_ROWS
from .kernels.decode_linear import decode_linear
from .kernels.rope_kv import rope_write_kv
from .models import context_window

__all__ = ["CachedLM", "StaticLM", "make_lm"]

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
        # of the heads (flashspec.parallel), and its cache only their keys and values.
        self.num_heads: int = first.q_proj.weight.shape[0] // self.head_dim
        self.num_kv_heads: int = first.k_proj.weight.shape[0] // self.head_dim
        self.apply_rope = sys.modules[type(first).__module__].apply_rotary_pos_emb
        self.forward_seconds = 0.0  # host time inside forwards (meaningful on the CPU only)
        self.batch, self.capacity = 0, 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.qkv = [_fuse([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.base.layers]
        self.gate_up = [_fuse([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.base.layers]
        # Decode forwards on CUDA (SPEC.md §3) use the flash-decoding Triton kernel
        # (flashspec.kernels.attention) and rotate queries and keys and write the cache in one
        # kernel (flashspec.kernels.rope_kv) instead of three; prefills, CPUs and machines without
        # Triton use the model's rotation and PyTorch's SDPA.
        # Which linear maps of a decode forward run through flashspec.kernels.decode_linear, each
        # with the element-wise work around it folded in (16-bit models; decode_maps for one
        # token row, decode_maps_wide for 2 to 16). Defaults (SPEC.md §3): the maps that beat
        # cuBLAS on both an H200's Qwen2.5-1.5B and Llama-3-8B shapes (docs/lab/NOTES.md, probes
        # 12 and 16; BENCHMARKS.md); q/k/v with its norm folded in only where the model's norm is
        # the one decode_linear computes.
        self._norms_fusable = _norms_fusable(model)
        sixteen = _sixteen_bit(model)
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
        if not isinstance(value, bool):
            raise ValueError(f"bit_exact must be True or False; got {value!r}.")
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
        if not _sixteen_bit(self.model):
            return ("it is for bfloat16 and float16 models (in float32 a 1-token and a several-token forward "
                    "already agree to about 1e-6, SPEC.md §7)")
        if getattr(self.model, "_flashspec_tp", None) is not None:
            return "tensor-parallel ranks add partial sums in another order than one GPU (SPEC.md §9)"
        if not (self._norms_fusable and _final_norm_fusable(self.model)):
            return ("the model's RMSNorms or its MLP activation are not the ones flashspec's decode kernels "
                    "compute, so its linear maps cannot all run through them")
        attn = self.base.layers[0].self_attn
        if hasattr(attn, "q_norm") and not (_folds_in(attn.q_norm) and _folds_in(attn.k_norm)):
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
        if maps and not _sixteen_bit(self.model):
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

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        real: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        layers: int | None = None,
        hidden_out: dict[int, torch.Tensor] | None = None,
        embeds: torch.Tensor | None = None,
        head: bool = True,
        first_layer: int = 0,
        eager: bool = False,
    ) -> torch.Tensor:
        """Feed ``tokens [B, q]`` at positions ``start[b] + j``; logits ``[B, q, V]``, or only the
        columns ``logits_at [B, m]``. ``real`` is accepted for interface parity and ignored:
        a padding token writes a stale entry that is overwritten before any query can see it.
        ``layers``: run only the first this many decoder layers (writing their cache entries),
        then the final norm and the output head — an early exit (SPEC.md §11); None: all.
        ``hidden_out {n: [B, capacity, hidden]}``: also write the output of the first ``n`` layers
        (for ``n`` = all of them: before the final norm) of every fed position there, for drafters
        that read the target's features (SPEC.md §11). ``embeds [B, q, hidden]``: feed these input
        vectors instead of ``tokens``' embeddings. ``head=False``: return the last layer run's
        output (before the final norm) instead of logits. ``first_layer=n`` with ``embeds``: those
        vectors are the output of the first ``n`` layers at the fed positions (their cache entries
        already written); run layers ``n`` on only (and write ``hidden_out[n]`` with ``embeds``) —
        the verify forward that reuses a shallow drafter's states (SPEC.md §11). ``eager=True``:
        not through the compiled forward even when it is short — prefills, whose widths are the
        prompts' lengths, so that a new short prompt never compiles inside its request (SPEC.md §3)."""
        if first_layer:
            stop = len(self.base.layers) if layers is None else layers
            if isinstance(first_layer, bool) or not isinstance(first_layer, int) or not 0 < first_layer <= stop:
                raise ValueError(f"first_layer must be an integer from 0 to the last layer run ({stop}); "
                                 f"got {first_layer!r}.")
            if embeds is None:
                raise ValueError("first_layer > 0 starts from given hidden states: pass them as embeds "
                                 "(the output of the first first_layer layers at the fed positions).")
        started = time.perf_counter()
        width = (tokens if embeds is None else embeds).shape[1]
        compiled = self._compiled is not None and width <= self.COMPILED_WIDTHS and not eager
        inputs = (self._compiled_inputs if compiled else self._inputs)(tokens, start, embeds)
        if compiled:
            logits = self._compiled(*inputs, logits_at, layers, hidden_out, head, first_layer)
        elif inputs[0].is_cuda:
            # Prefills (and uncompiled decodes) on CUDA: SDPA without the cuDNN backend, which
            # plans each new query length afresh (SPEC.md §3; ≈ 50 ms per new prompt length on an
            # H200, docs/lab/NOTES.md, probe 9): every request's prompt length is usually new.
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

        # (Not on tensor-parallel ranks: their o/down projections all-reduce, flashspec.parallel.)
        fused = frozenset()
        exact = self._bit_exact and use_kernel  # SPEC.md §14: every map, the head too, any row count
        if exact:
            fused = frozenset(self.DECODE_MAPS)
        elif use_kernel and batch * width <= _LINEAR_ROWS and getattr(self.model, "_flashspec_tp", None) is None:
            fused = self.decode_maps if batch * width == 1 else self.decode_maps_wide

        if first_layer and hidden_out is not None and first_layer in hidden_out:  # the features fed in
            _write_features(hidden_out[first_layer], positions, x)
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
                _write_features(hidden_out[i + 1], positions, x)
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        if not head:
            return x
        if exact:  # the final norm and the output head as one more exact map (SPEC.md §14)
            norm, lm_head = self.base.norm, self.model.lm_head
            return decode_linear(x, lm_head.weight, lm_head.bias, norm_weight=norm.weight, eps=norm.variance_epsilon,
                                 exact=True)
        return self.model.lm_head(self.base.norm(x))


def _write_features(buffer: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> None:
    """``buffer [B, capacity, hidden]`` at ``positions [B, q]`` ← ``x [B, q, hidden]`` (SPEC.md §11)."""
    buffer.scatter_(1, positions[..., None].expand(-1, -1, x.shape[-1]), x.to(buffer.dtype))


def _sixteen_bit(model: PreTrainedModel) -> bool:
    """Whether ``model`` computes in bfloat16 or float16 (float32 models keep cuBLAS, and with it
    their token-for-token equality with ``generate()``)."""
    weight = model.model.layers[0].self_attn.o_proj.weight
    return weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type != "meta"


def _norms_fusable(model: PreTrainedModel) -> bool:
    """Whether ``model``'s layers use a SiLU-gated MLP and RMSNorms that compute exactly the
    formula :func:`flashspec.kernels.decode_linear.decode_linear` folds in (checked by running one
    on a random input, not by trusting the class name)."""
    if getattr(model.config, "hidden_act", None) not in ("silu", "swish") or not _sixteen_bit(model):
        return False
    layer = model.model.layers[0]
    return all(_folds_in(norm) for norm in (layer.input_layernorm, layer.post_attention_layernorm))


def _folds_in(norm: torch.nn.Module) -> bool:
    """Whether ``norm`` computes exactly the RMSNorm ``decode_linear`` folds in (run on a random
    input)."""
    if not (isinstance(getattr(norm, "weight", None), torch.Tensor) and hasattr(norm, "variance_epsilon")
            and norm.weight.dim() == 1):
        return False
    with torch.no_grad():
        weight = norm.weight
        x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
        xf = x.float()
        expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)
        return bool(torch.equal(norm(x), (weight.float() * expected.float()).to(x.dtype)))


def _final_norm_fusable(model: PreTrainedModel) -> bool:
    """Whether ``model``'s final norm computes the RMSNorm that ``decode_linear`` folds in and its
    output head is a plain linear map (bit-exact mode computes them as one, SPEC.md §14)."""
    return isinstance(model.lm_head, torch.nn.Linear) and _folds_in(model.model.norm)


def _write_kv(
    keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor, slots: torch.Tensor
) -> None:
    keys.scatter_(2, slots, new_keys)
    values.scatter_(2, slots, new_values)


def _register_write_kv():
    """The op, registered once per process (even if this module is loaded twice)."""
    if hasattr(torch.ops.flashspec, "write_kv"):
        return torch.ops.flashspec.write_kv
    op = torch.library.custom_op("flashspec::write_kv", _write_kv, mutates_args=("keys", "values"))
    op.register_fake(lambda keys, values, new_keys, new_values, slots: None)
    return op


# write_kv(keys, values, new_keys, new_values, slots): write a forward's keys and values into the
# cache, in place, at ``slots [B, H_kv, q, D]`` (positions along axis 2). An opaque op that
# declares what it mutates: written as a plain ``scatter_`` inside a compiled forward, the cache
# (a graph input) is functionalised into a fresh copy of the whole cache per layer, scattered and
# copied back — work that grows with the cache's capacity, not with the context (SPEC.md §3;
# measured in docs/lab/NOTES.md, probe 8). Declared this way, the compiled graph writes in place.
write_kv = _register_write_kv()


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linear maps of the same input, stacked by output.

    The modules' parameters keep their identity, ``requires_grad`` and values; only their
    storage becomes a slice of the fused tensor (``param.data = slice``), so nothing is held
    twice, an optimizer built earlier still holds the model's parameters, and in-place updates
    of them (an optimizer step, ``load_state_dict``) are what the engine computes with."""
    cached = getattr(linears[0], "_flashspec_fused", None)
    if cached is not None and cached[0].data_ptr() == linears[0].weight.data_ptr():
        return cached  # already fused by another wrapper of the same model: share it
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
        offset = 0
        for m in linears:
            n = m.out_features
            m.weight.data = weight[offset : offset + n]
            if m.bias is not None:
                m.bias.data = bias[offset : offset + n]
            offset += n
    linears[0]._flashspec_fused = (weight, bias)
    return weight, bias


class CachedLM:
    """Any transformers causal LM behind a ``DynamicCache`` that rows of different lengths share.

    All rows share one physical length; a position that holds no real token of a row is a hole,
    masked out as a key. Position ids count real tokens only, so each row sees exactly the
    positions it would see alone. Rolling back crops the cache (a host read per step).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        accepted = inspect.signature(model.forward).parameters
        self._accepts_logits_to_keep = "logits_to_keep" in accepted
        # transformers >= 5.24 renames past_key_values to cache.
        self._cache_argument = "cache" if "cache" in accepted else "past_key_values"
        # Positions past the window only ever hold tokens beyond a row's budget, which are thrown
        # away; clamping them keeps learned position tables (GPT-2, OPT) in range.
        self._last_position = (context_window(model.config) or 2**62) - 1
        self.forward_seconds = 0.0
        self.reset(0, 0)

    def reset(self, batch: int, capacity: int) -> bool:
        """Forget everything; the next :meth:`forward` starts a new batch of ``batch`` rows.
        (Never captured in graphs, so this reports no buffer replacement.)"""
        device = self.model.device
        self.cache = DynamicCache(config=self.model.config)
        self.key_mask = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.num_real = torch.zeros(batch, dtype=torch.long, device=device)
        return False

    @property
    def length(self) -> int:
        """Physical cache length (real tokens plus holes)."""
        return self.key_mask.shape[1]

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        real: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        eager: bool = False,
    ) -> torch.Tensor:
        """Feed ``tokens [B, q]`` as real tokens ``start[b]..`` (where ``real [B, q]`` is 1; rows
        whose first column is not real are left as they are and get holes). ``eager`` is
        accepted for interface parity with :class:`StaticLM` (nothing here is compiled)."""
        real = torch.ones_like(tokens) if real is None else real.long()
        row_feeds = real[:, 0] > 0
        self._keep(torch.where(row_feeds, start.to(self.num_real.device), self.num_real))
        logits = self._append(tokens, real)
        if logits_at is not None:
            logits = logits.gather(1, logits_at[..., None].expand(-1, -1, logits.shape[-1]))
        return logits

    def _append(self, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        positions = self.num_real[:, None] + torch.cumsum(real, dim=1) - 1
        positions = positions.clamp(min=0, max=self._last_position)  # a leading hole gets 0
        self.key_mask = torch.cat([self.key_mask, real], dim=1)
        kwargs = {self._cache_argument: self.cache}
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = tokens.shape[1]
        started = time.perf_counter()
        out = self.model(
            input_ids=tokens, attention_mask=self.key_mask, position_ids=positions, use_cache=True, **kwargs
        )
        self.forward_seconds += time.perf_counter() - started
        self.num_real = self.num_real + real.sum(dim=1)
        return out.logits[:, -tokens.shape[1]:]

    def _keep(self, num_real: torch.Tensor) -> None:
        """Row ``b`` keeps its first ``num_real[b]`` real tokens; the rest become holes and the
        physical length shrinks to what is still used."""
        num_real = torch.minimum(num_real, self.num_real)
        rank = torch.cumsum(self.key_mask, dim=1)
        self.key_mask = self.key_mask * (rank <= num_real[:, None]).long()
        self.num_real = num_real
        used = self.key_mask.any(dim=0).nonzero()
        new_length = int(used[-1]) + 1 if used.numel() else 0
        if new_length < self.length:
            self.cache.crop(new_length - self.length)  # negative: remove that many positions
            self.key_mask = self.key_mask[:, :new_length]


def make_lm(model: PreTrainedModel, compile: bool = False) -> StaticLM | CachedLM:
    """The fastest exact wrapper for ``model``: :class:`StaticLM` when it knows the architecture
    (``compile`` applies to it only)."""
    return StaticLM(model, compile=compile) if StaticLM.supports(model) else CachedLM(model)
