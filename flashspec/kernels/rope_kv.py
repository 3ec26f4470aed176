"""Rotary embedding and the KV-cache write of a decode forward, in one Triton kernel.

A decode (or verify) forward of :class:`flashspec.models.static.StaticLM` feeds ``q ≤ 16`` tokens. Per
layer it must rotate the queries and keys (rotary position embedding) and write the rotated keys
and the values into the static cache at the tokens' positions. Written in PyTorch this is three
kernels per layer even under ``torch.compile`` (the rotation, and one scatter each for keys and
values: the scatters sit behind the opaque in-place op ``flashspec::write_kv``), each a few
hundred bytes of work and a couple of microseconds of launch and tail. :func:`rope_write_kv` does
all of it in one launch.

The arithmetic is the model's own: ``x·cos + rotate_half(x)·sin`` with the ``cos``/``sin`` tables
the model's rotary module returned (so every rope scaling variant it implements is honoured),
where ``rotate_half(x) = (−x[D/2:], x[:D/2])``. Products and the sum are computed in float32
and rounded once to the tensor's dtype — what inductor's fused rotation does; eager PyTorch
rounds after each operation, so in 16-bit dtypes the two can differ in the last bit.

With ``q_norm``/``k_norm`` weights (``[D]``, Qwen3's per-head RMSNorms; bit-exact mode, SPEC.md §14)
each query and key row is first normalised as transformers does — ``r = rsqrt(mean(x²) + eps)`` in
float32, ``n = round(x·r)``, ``h = round(w·n)`` — its sum of squares one reduction over the row in
a program of its own, so the same bits whatever the batch and width of the call.

Grid: ``(B·q, H + H_kv)``; program ``(b·q + t, h)`` rotates query head ``h`` of token ``t``
(``h < H``) or rotates key head ``h − H`` and copies its value row into the cache at
``positions[b, t]``. Batch, width and strides are runtime arguments: one compilation per dtype
and head size.
"""

from __future__ import annotations

import torch

from . import pdl, shim
from .shim import next_pow2, tl, triton

__all__ = ["available", "rope_write_kv", "rope_write_kv_reference"]


def available(query: torch.Tensor) -> bool:
    """Whether the kernel can run on ``query``'s device: CUDA with Triton, or the CPU under
    Triton's interpreter (tests)."""
    return shim.available(query)


def _norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm as transformers computes it (both roundings), or ``x``."""
    if weight is None:
        return x
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * n.float()).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos.float() + rotated.float() * sin.float()).to(x.dtype)


def rope_write_kv_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    q_eps: float = 0.0,
    k_eps: float = 0.0,
) -> torch.Tensor:
    """What :func:`rope_write_kv` computes, in PyTorch (float32 arithmetic, one rounding)."""
    query, key = _norm(query, q_norm, q_eps), _norm(key, k_norm, k_eps)
    batch, width, kv_heads, dim = key.shape
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    slots = positions[:, None, :, None].expand(batch, kv_heads, width, dim)
    keys.scatter_(2, slots, _rotate(key, cos, sin).transpose(1, 2))
    values.scatter_(2, slots, value.transpose(1, 2).to(values.dtype))
    return _rotate(query, cos, sin).contiguous()


def _check(query, key, value, cos, sin, positions, keys, values, q_norm=None, k_norm=None) -> None:
    shim.require("rope_write_kv", query)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (Qwen3 normalises both queries and keys)")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (query.shape[-1],) or w.dtype != query.dtype or w.device != query.device):
            raise ValueError(f"{name} {tuple(w.shape)} must be [D] = [{query.shape[-1]}] in the query's dtype "
                             "and device")
    if query.dim() != 4:
        raise ValueError(f"query {tuple(query.shape)} must be [B, q, H, D]")
    batch, width, heads, dim = query.shape
    kv_heads = key.shape[2]
    if key.shape != (batch, width, kv_heads, dim) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be [B, q, H_kv, D] "
                         f"matching query {tuple(query.shape)}")
    if cos.shape != (batch, width, dim) or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [B, q, D] = "
                         f"{(batch, width, dim)}")
    if positions.shape != (batch, width):
        raise ValueError(f"positions {tuple(positions.shape)} must be [B, q] = {(batch, width)}")
    if keys.shape != values.shape or keys.shape[:2] != (batch, kv_heads) or keys.shape[3] != dim:
        raise ValueError(f"cache {tuple(keys.shape)} must be [B, H_kv, C, D] = [{batch}, {kv_heads}, C, {dim}]")
    if dim % 2:
        raise ValueError(f"rotary embedding needs an even head size, got {dim}")
    if not (query.dtype == key.dtype == value.dtype == keys.dtype == values.dtype):
        raise ValueError(f"query, key, value and the cache must share one dtype, got {query.dtype}, {key.dtype}, "
                         f"{value.dtype}, {keys.dtype}, {values.dtype}")
    tensors = (query, key, value, cos, sin, keys, values)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("every tensor needs a unit stride along its last axis")
    if len({t.device for t in tensors + (positions,)}) != 1:
        raise ValueError("all tensors must be on one device")


def _launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    q_eps: float = 0.0,
    k_eps: float = 0.0,
) -> torch.Tensor:
    _check(query, key, value, cos, sin, positions, keys, values, q_norm, k_norm)
    batch, width, heads, dim = query.shape
    kv_heads = key.shape[2]
    out = torch.empty((batch, width, heads, dim), dtype=query.dtype, device=query.device)
    if batch * width == 0:
        return out
    if positions.dtype != torch.int64:
        positions = positions.to(torch.int64)
    norm = q_norm is not None
    _rope_write_kernel[(batch * width, heads + kv_heads)](
        query, key, value, cos, sin, positions, out, keys, values,
        q_norm.contiguous() if norm else query, k_norm.contiguous() if norm else key, float(q_eps), float(k_eps),
        width, heads, dim,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        positions.stride(0), positions.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        BLOCK_D=max(16, next_pow2(dim)), NORM=norm, PDL=pdl.enabled(query.device), num_warps=1,
        **pdl.launch_options(query.device),
    )
    return out


def rope_write_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    q_eps: float = 0.0,
    k_eps: float = 0.0,
) -> torch.Tensor:
    """Rotate ``query [B, q, H, D]`` and ``key [B, q, H_kv, D]`` by ``cos/sin [B, q, D]``, write the
    rotated keys and ``value [B, q, H_kv, D]`` into ``keys/values [B, H_kv, C, D]`` at
    ``positions [B, q]``, and return the rotated queries as a new contiguous ``[B, q, H, D]``
    tensor. Every input needs a unit stride along ``D`` (views of a fused projection are fine).
    ``positions`` must lie in ``[0, C)``: it is not checked, because checking would read it back
    to the host (StaticLM clamps its positions to the capacity). ``q_norm``, ``k_norm`` (``[D]``,
    together) with ``q_eps``, ``k_eps``: each query and key row is RMS-normalised first (Qwen3).

    Under ``torch.compile`` it is the opaque custom op ``flashspec::rope_write_kv``, which
    declares that it mutates the cache (so the cache is written in place, SPEC.md §3)."""
    return _OP(query, key, value, cos, sin, positions, keys, values, q_norm, k_norm, float(q_eps), float(k_eps))


def _register():
    """The op, registered once per process (even if this module is loaded twice)."""
    if hasattr(torch.ops.flashspec, "rope_write_kv"):
        return torch.ops.flashspec.rope_write_kv
    op = torch.library.custom_op("flashspec::rope_write_kv", _launch, mutates_args=("keys", "values"))
    op.register_fake(lambda query, key, value, cos, sin, positions, keys, values, q_norm=None, k_norm=None,
                     q_eps=0.0, k_eps=0.0: torch.empty_like(query, memory_format=torch.contiguous_format))
    return op


_OP = _register()


if triton is not None:
    _RUNTIME = ["q_eps", "k_eps", "W", "H", "q_sb", "q_st", "q_sh", "k_sb", "k_st", "k_sh", "v_sb", "v_st", "v_sh",
                "c_sb", "c_st", "s_sb", "s_st", "p_sb", "p_st", "kc_sb", "kc_sh", "kc_sp",
                "vc_sb", "vc_sh", "vc_sp"]

    @triton.jit
    def _normed(x, xp, w_ptr, d, partner, live, D, eps, NORM: tl.constexpr):
        """A row ``x`` and its rotation partner ``xp`` as float32, RMS-normalised first with ``NORM``
        (the row's sum of squares: one reduction in this program, whatever the call's shape)."""
        xf = x.to(tl.float32)
        xpf = xp.to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
            w = tl.load(w_ptr + d, mask=live, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=live, other=0.0).to(tl.float32)
            xf = (w * (xf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
            xpf = (wp * (xpf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        return xf, xpf

    @triton.jit(do_not_specialize=_RUNTIME)
    def _rope_write_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, kc_ptr, vc_ptr,
        qn_ptr, kn_ptr, q_eps, k_eps,
        W, H, D,
        q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh,
        c_sb, c_st, s_sb, s_st, p_sb, p_st,
        kc_sb, kc_sh, kc_sp, vc_sb, vc_sh, vc_sp,
        BLOCK_D: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # flashspec.kernels.pdl: every input comes from earlier kernels
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bt = tl.program_id(0)
        h = tl.program_id(1)
        b = bt // W
        t = bt % W
        d = tl.arange(0, BLOCK_D)
        live = d < D
        half = D // 2
        first = d < half
        partner = tl.where(first, d + half, d - half)
        sign = tl.where(first, -1.0, 1.0)
        c = tl.load(cos_ptr + b * c_sb + t * c_st + d, mask=live, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + b * s_sb + t * s_st + d, mask=live, other=0.0).to(tl.float32)
        if h < H:
            src = q_ptr + b * q_sb + t * q_st + h * q_sh
            x = tl.load(src + d, mask=live, other=0.0)
            xp = tl.load(src + partner, mask=live, other=0.0)
            xf, xpf = _normed(x, xp, qn_ptr, d, partner, live, D, q_eps, NORM)
            y = xf * c + sign * xpf * s
            tl.store(out_ptr + ((b * W + t) * H + h) * D + d, y.to(x.dtype), mask=live)
        else:
            j = h - H
            pos = tl.load(pos_ptr + b * p_sb + t * p_st)
            src = k_ptr + b * k_sb + t * k_st + j * k_sh
            x = tl.load(src + d, mask=live, other=0.0)
            xp = tl.load(src + partner, mask=live, other=0.0)
            xf, xpf = _normed(x, xp, kn_ptr, d, partner, live, D, k_eps, NORM)
            y = xf * c + sign * xpf * s
            tl.store(kc_ptr + b * kc_sb + j * kc_sh + pos * kc_sp + d, y.to(x.dtype), mask=live)
            v = tl.load(v_ptr + b * v_sb + t * v_st + j * v_sh + d, mask=live, other=0.0)
            tl.store(vc_ptr + b * vc_sb + j * vc_sh + pos * vc_sp + d, v, mask=live)
