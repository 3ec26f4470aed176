"""What a model's layers compute, checked by running them, and the fused weights the decode
kernels read (SPEC.md §3, §14).

:class:`~flashspec.models.static.StaticLM` runs a model's own modules except where a kernel of
:mod:`flashspec.kernels` folds work in; these checks say where that is exact (a norm is folded in
only if it computes exactly the formula the kernel computes) and :func:`fuse` stacks the
projections that share an input into one matrix without holding any weight twice.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

__all__ = ["final_norm_fusable", "folds_in", "fuse", "norms_fusable", "sixteen_bit", "write_features", "write_kv"]


def write_features(buffer: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> None:
    """``buffer [B, capacity, hidden]`` at ``positions [B, q]`` ← ``x [B, q, hidden]`` (SPEC.md §11)."""
    buffer.scatter_(1, positions[..., None].expand(-1, -1, x.shape[-1]), x.to(buffer.dtype))


def sixteen_bit(model: PreTrainedModel) -> bool:
    """Whether ``model`` computes in bfloat16 or float16 (float32 models keep cuBLAS, and with it
    their token-for-token equality with ``generate()``)."""
    weight = model.model.layers[0].self_attn.o_proj.weight
    return weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type != "meta"


def norms_fusable(model: PreTrainedModel) -> bool:
    """Whether ``model``'s layers use a SiLU-gated MLP and RMSNorms that compute exactly the
    formula :func:`flashspec.kernels.decode_linear.decode_linear` folds in (checked by running one
    on a random input, not by trusting the class name)."""
    if getattr(model.config, "hidden_act", None) not in ("silu", "swish") or not sixteen_bit(model):
        return False
    layer = model.model.layers[0]
    return all(folds_in(norm) for norm in (layer.input_layernorm, layer.post_attention_layernorm))


def folds_in(norm: torch.nn.Module) -> bool:
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


def final_norm_fusable(model: PreTrainedModel) -> bool:
    """Whether ``model``'s final norm computes the RMSNorm that ``decode_linear`` folds in and its
    output head is a plain linear map (bit-exact mode computes them as one, SPEC.md §14)."""
    return isinstance(model.lm_head, torch.nn.Linear) and folds_in(model.model.norm)


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
# copied back — work that grows with the cache's capacity, not with the context (SPEC.md §3).
# Declared this way, the compiled graph writes in place.
write_kv = _register_write_kv()


def fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
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

