"""The fused decode linear kernel (flashspec.decode_linear): equal to its PyTorch reference with
every combination of norm / bias / residual / gated, every shape (Hypothesis: rows 1..16, N, K
not multiples of the tiles), batch invariance (a row's result does not depend on the other
rows), weight row-slices, torch.compile, clear errors, and StaticLM with and without it. Without
CUDA it runs through Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from flashspec.decode_linear import MAX_ROWS, decode_linear, decode_linear_reference  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)


def _problem(rows, n, k, dtype, norm, bias, residual, gated, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(2 * n if gated else n, k, generator=gen) / k ** 0.5
    b = torch.randn(weight.shape[0], generator=gen) if bias else None
    g = 1 + 0.5 * torch.randn(k, generator=gen) if norm else None
    r = torch.randn(rows, n, generator=gen) if residual else None
    move = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return dict(x=move(x), weight=move(weight), bias=move(b), norm_weight=move(g), eps=1e-6,
                residual=move(r), gated=gated)


def _assert_close(out, ref):
    """Same arithmetic up to the float32 summation order; each 16-bit rounding can then differ by
    one unit in the last place, and Triton's interpreter (CPU tests) truncates float32 -> bf16
    instead of rounding, so allow a few units of the result's scale."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    ulp = 2 ** -7 if out.dtype == torch.bfloat16 else 2 ** -10
    scale = ref.float().abs().amax().clamp(min=1.0)
    torch.testing.assert_close(out.float(), ref.float(), atol=4 * ulp * scale, rtol=4 * ulp)
    if CUDA or out.dtype == torch.float16:  # rounding to nearest: nearly every element is equal
        assert (out != ref).float().mean() < 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm,bias,residual,gated", [
    (False, False, False, False), (True, True, False, False), (False, False, True, False),
    (True, False, False, True), (True, True, True, True), (False, True, True, False),
])
def test_matches_reference(dtype, norm, bias, residual, gated):
    problem = _problem(5, 40, 72, dtype, norm, bias, residual, gated)
    _assert_close(decode_linear(**problem), decode_linear_reference(**problem))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, MAX_ROWS), n=st.integers(1, 70), k=st.integers(1, 90),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
       seed=st.integers(0, 2 ** 16))
def test_every_shape(rows, n, k, flags, seed):
    """Rows 1..16, N and K from 1 (not multiples of the tiles), every combination of options."""
    norm, bias, residual, gated = flags
    problem = _problem(rows, n, k, torch.bfloat16, norm, bias, residual, gated, seed)
    _assert_close(decode_linear(**problem), decode_linear_reference(**problem))


@pytest.mark.parametrize("gated", [False, True])
def test_batch_invariance(gated):
    """A row's result is bit-identical whatever rows it is computed with: fed alone, with 4 or
    with 15 others (a 1-token forward and a verify forward agree on every linear map)."""
    problem = _problem(MAX_ROWS, 48, 200, torch.bfloat16, True, True, True, gated)
    full = decode_linear(**problem)
    for rows in (1, 5, MAX_ROWS - 1):
        part = dict(problem, x=problem["x"][:rows], residual=problem["residual"][:rows])
        assert torch.equal(decode_linear(**part), full[:rows])


def test_leading_axes_and_weight_slices():
    """``x [B, q, K]`` keeps its leading axes; a weight that is a row slice of a larger matrix
    (StaticLM's modules point into the fused q/k/v matrix) is read in place."""
    problem = _problem(6, 32, 64, torch.bfloat16, True, False, False, False)
    stacked = torch.cat([problem["weight"], torch.randn_like(problem["weight"])])
    x = problem["x"].view(2, 3, 64)
    out = decode_linear(x, stacked[:32], norm_weight=problem["norm_weight"], eps=1e-6)
    assert out.shape == (2, 3, 32)
    _assert_close(out.view(6, 32), decode_linear_reference(**problem))


def test_no_rows():
    problem = _problem(1, 8, 16, torch.bfloat16, False, False, False, False)
    assert decode_linear(problem["x"][:0], problem["weight"]).shape == (0, 8)


def test_torch_compile():
    problem = _problem(3, 24, 40, torch.bfloat16, True, True, True, True)
    compiled = torch.compile(lambda p: decode_linear(**p), dynamic=False)
    assert torch.equal(compiled(problem), decode_linear(**problem))


@pytest.mark.parametrize("change,message", [
    (dict(x=torch.zeros(2, 16)), "16-bit"),
    (dict(x=torch.zeros(MAX_ROWS + 1, 16, dtype=torch.bfloat16)), "at most 16 token rows"),
    (dict(x=torch.zeros(2, 15, dtype=torch.bfloat16)), r"must be \[..., K\]"),
    (dict(weight=torch.zeros(7, 16, dtype=torch.bfloat16), gated=True), "even number"),
    (dict(bias=torch.zeros(3, dtype=torch.bfloat16)), "bias"),
    (dict(norm_weight=torch.zeros(3, dtype=torch.bfloat16)), "norm_weight"),
    (dict(residual=torch.zeros(2, 3, dtype=torch.bfloat16)), "residual"),
    (dict(bias=torch.zeros(8, dtype=torch.float16)), "share x's dtype"),
    (dict(weight=torch.zeros(16, 8, dtype=torch.bfloat16).T), "unit stride"),
])
def test_clear_errors(change, message):
    args = dict(x=torch.zeros(2, 16, dtype=torch.bfloat16), weight=torch.zeros(8, 16, dtype=torch.bfloat16))
    args.update(change)
    args = {key: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for key, value in args.items()}
    with pytest.raises(ValueError, match=message):
        decode_linear(**args)


# ----------------------------------------------------------------------------------------------
# StaticLM: the decode forward with and without the fused linear maps
# ----------------------------------------------------------------------------------------------

def _tiny(dtype, arch="qwen2"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = (Qwen2ForCausalLM(Qwen2Config(**common)) if arch == "qwen2"
             else LlamaForCausalLM(LlamaConfig(**common, mlp_bias=True)))
    return model.to(DEVICE, dtype).eval()


def _decode_logits(model, fuse_linear, width):
    from flashspec.cache import StaticLM

    lm = StaticLM(model)
    lm.fuse_output_projection = fuse_linear
    if not CUDA:  # run the decode kernels through the interpreter
        lm._decode_kernels = lambda x: x.shape[1] <= StaticLM.COMPILED_WIDTHS
    lm.reset(2, 64)
    gen = torch.Generator().manual_seed(3)
    lm.forward(torch.randint(0, 128, (2, 20), generator=gen).to(DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE))
    tokens = torch.randint(0, 128, (2, width), generator=gen).to(DEVICE)
    return lm.forward(tokens, torch.tensor([20, 17], device=DEVICE))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # q/k/v bias; MLP bias
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_static_lm_fused_matches_unfused(arch, dtype):
    model = _tiny(dtype, arch)
    from flashspec.cache import StaticLM

    assert StaticLM(model).fuse_output_projection  # on by default for 16-bit models
    plain, fused = _decode_logits(model, False, 3), _decode_logits(model, True, 3)
    tolerance = 2 ** -5 if dtype == torch.bfloat16 else 2 ** -8
    torch.testing.assert_close(fused.float(), plain.float(), atol=tolerance, rtol=tolerance)
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.8


def test_static_lm_float32_keeps_cublas():
    """float32 models keep cuBLAS (and their token-for-token equality with generate())."""
    from flashspec.cache import StaticLM

    assert not StaticLM(_tiny(torch.float32)).fuse_output_projection
