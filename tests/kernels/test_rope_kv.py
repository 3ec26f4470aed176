"""The fused rotary-embedding + KV-cache-write kernel (flashspec.kernels.rope_kv): equal to its PyTorch
reference and to the model's own rotation, writes only the fed positions, every shape (Hypothesis:
batch, width, heads, head size, capacity — 1 included), strided views of a fused projection, and
torch.compile. Without CUDA it runs through Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from flashspec.kernels.rope_kv import available, rope_write_kv, rope_write_kv_reference  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# The repository root: the child interpreter's working directory (never inherit a deleted one).
ROOT = Path(__file__).resolve().parents[2]
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)


def _problem(batch, width, heads, kv_heads, dim, capacity, dtype, seed=0):
    """A fused [B, q, (H + 2 H_kv) D] projection split into strided q/k/v views (as StaticLM
    holds them), rotary tables, distinct positions per row and a cache full of sentinels."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, width, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(batch, width, heads, dim), k.view(batch, width, kv_heads, dim), v.view(batch, width, kv_heads, dim)
    angles = torch.rand(batch, width, dim // 2, generator=gen) * 6.3
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    starts = torch.randint(0, capacity - width + 1, (batch,), generator=gen)
    positions = starts[:, None] + torch.arange(width)
    keys = torch.full((batch, kv_heads, capacity, dim), 7.0, dtype=dtype)
    values = torch.full((batch, kv_heads, capacity, dim), -7.0, dtype=dtype)
    move = lambda t: t.to(DEVICE)  # noqa: E731
    return tuple(map(move, (q, k, v, cos, sin, positions, keys, values)))


def _run_both(problem):
    q, k, v, cos, sin, positions, keys, values = problem
    keys_ref, values_ref = keys.clone(), values.clone()
    out = rope_write_kv(q, k, v, cos, sin, positions, keys, values)
    ref = rope_write_kv_reference(q, k, v, cos, sin, positions, keys_ref, values_ref)
    return out, ref, (keys, values), (keys_ref, values_ref)


def _assert_equal(out, ref, cache, cache_ref, dtype):
    # Same float32 arithmetic and one rounding; a fused multiply-add may differ in float32's
    # last bit, which rounding to 16 bits almost always absorbs. Triton's interpreter (CPU
    # tests) truncates float32 -> bfloat16 instead of rounding to nearest, so there the 16-bit
    # results are only within one unit in the last place.
    if dtype != torch.float32:
        torch.testing.assert_close(out, ref, atol=2 ** -7, rtol=2 ** -7)  # at most one 16-bit ulp
        if CUDA:
            assert (out != ref).float().mean() < 0.01
    else:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache[1], cache_ref[1], atol=0, rtol=0)  # values: a plain copy
    torch.testing.assert_close(cache[0], cache_ref[0], atol=2 ** -7 if dtype != torch.float32 else 1e-6,
                               rtol=2 ** -7 if dtype != torch.float32 else 1e-6)


def test_available_on_this_device():
    assert available(torch.empty(1, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_and_writes_only_fed_positions(dtype):
    problem = _problem(batch=3, width=5, heads=4, kv_heads=2, dim=32, capacity=40, dtype=dtype)
    out, ref, cache, cache_ref = _run_both(problem)
    assert out.shape == (3, 5, 4, 32) and out.is_contiguous()
    _assert_equal(out, ref, cache, cache_ref, dtype)
    positions, keys = problem[5], cache[0]
    untouched = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=DEVICE)
    untouched.scatter_(1, positions, False)
    assert (keys.transpose(1, 2)[untouched] == 7.0).all()
    assert (cache[1].transpose(1, 2)[untouched] == -7.0).all()


def test_matches_the_model_rotation():
    """The tables and convention are the model's: transformers' own apply_rotary_pos_emb (float32,
    so no rounding question) gives the same queries and cached keys."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, v, cos, sin, positions, keys, values = _problem(2, 3, 4, 2, 16, 12, torch.float32, seed=1)
    out = rope_write_kv(q, k, v, cos, sin, positions, keys, values)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(out.transpose(1, 2), q_hf, atol=1e-6, rtol=1e-6)
    for b in range(2):
        for t in range(3):
            torch.testing.assert_close(keys[b, :, positions[b, t]], k_hf[b, :, t], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(values[b, :, positions[b, t]], v[b, t], atol=0, rtol=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 4),
    width=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    groups=st.integers(1, 3),
    half_dim=st.sampled_from([1, 4, 8, 12, 20, 32, 64]),
    extra=st.integers(0, 9),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_every_shape(batch, width, kv_heads, groups, half_dim, extra, dtype):
    dim = 2 * half_dim
    problem = _problem(batch, width, groups * kv_heads, kv_heads, dim, width + extra, dtype, seed=batch * width)
    out, ref, cache, cache_ref = _run_both(problem)
    _assert_equal(out, ref, cache, cache_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norms_match_the_reference_and_do_not_depend_on_the_call(dtype):
    """Qwen3's per-head RMSNorms folded in (bit-exact mode, SPEC.md §14): close to the PyTorch
    reference (transformers' formula, both roundings), and a token's rotated query and cached key
    are the same bits whether the call feeds it alone or with four others and another sequence."""
    q, k, v, cos, sin, positions, keys, values = _problem(batch=2, width=5, heads=4, kv_heads=2, dim=32,
                                                          capacity=40, dtype=dtype, seed=4)
    gen = torch.Generator().manual_seed(5)
    q_norm, k_norm = [(1 + 0.3 * torch.randn(32, generator=gen)).to(DEVICE, dtype) for _ in range(2)]
    norms = dict(q_norm=q_norm, k_norm=k_norm, q_eps=1e-6, k_eps=1e-5)
    keys_ref, values_ref = keys.clone(), values.clone()
    out = rope_write_kv(q, k, v, cos, sin, positions, keys, values, **norms)
    ref = rope_write_kv_reference(q, k, v, cos, sin, positions, keys_ref, values_ref, **norms)
    if dtype == torch.float32:
        _assert_equal(out, ref, (keys, values), (keys_ref, values_ref), dtype)
    else:  # two 16-bit roundings before the rotation: a unit of each, of the normalised values' size
        scale = 4 * 2 ** -7 * ref.float().abs().amax().item()
        torch.testing.assert_close(out, ref, atol=scale, rtol=0)
        torch.testing.assert_close(keys, keys_ref, atol=scale, rtol=0)
        assert torch.equal(values, values_ref)
        if CUDA:  # rounding to nearest there (the interpreter truncates): nearly every element equal
            assert (out != ref).float().mean() < 0.05
    one_keys, one_values = keys.clone().fill_(0), values.clone().fill_(0)
    one = rope_write_kv(q[1:, 3:4], k[1:, 3:4], v[1:, 3:4], cos[1:, 3:4], sin[1:, 3:4], positions[1:, 3:4],
                        one_keys[1:], one_values[1:], **norms)
    assert torch.equal(one[0, 0], out[1, 3])
    position = positions[1, 3]
    assert torch.equal(one_keys[1, :, position], keys[1, :, position])
    with pytest.raises(ValueError, match="come together"):
        rope_write_kv(q, k, v, cos, sin, positions, keys, values, q_norm=q_norm)
    with pytest.raises(ValueError, match="must be \\[D\\]"):
        rope_write_kv(q, k, v, cos, sin, positions, keys, values, q_norm=q_norm[:8], k_norm=k_norm)


def test_clear_errors():
    q, k, v, cos, sin, positions, keys, values = _problem(1, 2, 2, 1, 8, 6, torch.float32)
    with pytest.raises(ValueError, match="positions"):
        rope_write_kv(q, k, v, cos, sin, positions[:, :1], keys, values)
    with pytest.raises(ValueError, match="cos"):
        rope_write_kv(q, k, v, cos[..., :4], sin[..., :4], positions, keys, values)
    with pytest.raises(ValueError, match="cache"):
        rope_write_kv(q, k, v, cos, sin, positions, keys[:, :, :, :4], values[:, :, :, :4])
    with pytest.raises(ValueError, match="one dtype"):
        rope_write_kv(q, k, v, cos, sin, positions, keys.double(), values.double())
    with pytest.raises(ValueError, match=r"\[B, q, H, D\]"):
        rope_write_kv(q[0], k, v, cos, sin, positions, keys, values)
    odd = _problem(1, 1, 1, 1, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="even head size"):
        rope_write_kv(*[t[..., :7] if t.dim() > 2 else t for t in odd])


def test_under_torch_compile_writes_in_place():
    problem = _problem(2, 3, 4, 2, 16, 10, torch.float32, seed=3)
    q, k, v, cos, sin, positions, keys, values = problem
    keys_ref, values_ref = keys.clone(), values.clone()
    ref = rope_write_kv_reference(q, k, v, cos, sin, positions, keys_ref, values_ref)
    out = torch.compile(rope_write_kv, fullgraph=True)(q, k, v, cos, sin, positions, keys, values)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(keys, keys_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(values, values_ref, atol=0, rtol=0)


@pytest.mark.skipif(not CUDA, reason="StaticLM takes the fused path on CUDA only")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("compile", [False, True])
def test_static_lm_decode_forwards_equal_the_unfused_rotation(arch, compile, monkeypatch):
    """A float32 StaticLM with the fused kernel (eager, or compiled with the inputs graph apart)
    gives the same logits and cache as with the model's own rotation and the scatter write, for
    decode widths 1 and 5 after a prefill."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    import flashspec.models.static as cache
    from flashspec.models.static import StaticLM

    torch.manual_seed(0)
    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    kind = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    model = kind[1](kind[0](**shape)).to(DEVICE).eval()
    fused, plain = StaticLM(model, compile=compile), StaticLM(model)

    def unfused(q, k, v, cos, sin, positions, keys, values):
        """In place of the kernel: the model's own rotation, and the scatter write."""
        q, k = plain.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        cache.write_kv(keys, values, k, v.transpose(1, 2), positions[:, None, :, None].expand(k.shape))
        return q.transpose(1, 2)

    def plain_forward(tokens, start):
        with monkeypatch.context() as patch:
            patch.setattr(cache, "rope_write_kv", unfused)
            return plain.forward(tokens, start)

    prompt = torch.randint(0, 96, (2, 20), device=DEVICE)
    start = torch.zeros(2, dtype=torch.long, device=DEVICE)
    for lm in (fused, plain):
        lm.reset(2, 64)
        lm.forward(prompt, start)
    start = torch.tensor([20, 18], device=DEVICE)
    for width in (1, 5):
        tokens = torch.randint(0, 96, (2, width), device=DEVICE)
        torch.testing.assert_close(fused.forward(tokens, start), plain_forward(tokens, start), atol=1e-5, rtol=1e-5)
        start = start + width
    for i in range(2):
        torch.testing.assert_close(fused.keys[i][:, :, :26], plain.keys[i][:, :, :26], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused.values[i][:, :, :26], plain.values[i][:, :, :26], atol=1e-5, rtol=1e-5)


def test_static_lm_imports_and_runs_without_triton():
    """On a machine without Triton (macOS, Windows, a CPU install) the cache module, which
    imports this kernel's module, still imports and StaticLM runs on PyTorch alone."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'): raise ImportError('no triton')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from flashspec.kernels import rope_kv\n"
        "from flashspec.models.static import StaticLM\n"
        "assert rope_kv.triton is None and not rope_kv.available(torch.zeros(1))\n"
        "try:\n"
        "    rope_kv.rope_write_kv(*[torch.zeros(1, 1, 1, 2)] * 3, torch.ones(1, 1, 2), torch.zeros(1, 1, 2),\n"
        "                          torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))\n"
        "    raise SystemExit('no error without Triton')\n"
        "except ValueError as error:\n"
        "    assert 'gpu extra' in str(error), error\n"
        "config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
        "                     num_attention_heads=4, num_key_value_heads=2)\n"
        "lm = StaticLM(LlamaForCausalLM(config).eval())\n"
        "lm.reset(1, 64)\n"
        "print(tuple(lm.forward(torch.tensor([[1, 2, 3]]), torch.zeros(1, dtype=torch.long)).shape))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "(1, 3, 64)"
