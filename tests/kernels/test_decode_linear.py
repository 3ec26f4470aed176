"""The fused decode linear kernel (flashspec.kernels.decode_linear): equal to its PyTorch reference with
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

from flashspec.kernels.decode_linear import MAX_ROWS, decode_linear, decode_linear_reference  # noqa: E402

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


def _assert_close(out, ref, problem=None):
    """Same arithmetic up to the float32 summation order; each 16-bit rounding can then differ by
    one unit in the last place, and Triton's interpreter (CPU tests) truncates float32 -> bf16
    instead of rounding. Those units are of the intermediate values (the product before the
    residual add, the residual, the gate and up halves), which cancellation can make larger than
    the result: the tolerance is a few units of the largest of them."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    ulp = 2 ** -7 if out.dtype == torch.bfloat16 else 2 ** -10
    scale = ref.float().abs().amax().clamp(min=1.0)
    if problem is not None:
        linear = decode_linear_reference(problem["x"], problem["weight"], problem["bias"], problem["norm_weight"],
                                         problem["eps"])
        scale = torch.maximum(scale, linear.float().abs().amax())
        if problem["residual"] is not None:
            scale = torch.maximum(scale, problem["residual"].float().abs().amax())
    torch.testing.assert_close(out.float(), ref.float(), atol=(4 * ulp * scale).item(), rtol=4 * ulp)
    if CUDA or out.dtype == torch.float16:  # rounding to nearest: nearly every element is equal
        assert (out != ref).float().mean() < 0.1


@pytest.fixture(params=[False, True], ids=["cuda-cores", "tensor-cores"])
def variant(request, monkeypatch):
    """Both inner products of the kernel (the autotuner picks one per matrix on CUDA; here the
    fixed configuration is switched)."""
    import flashspec.kernels.decode_linear as module

    monkeypatch.setitem(module._FIXED, "USE_DOT", request.param)
    monkeypatch.setitem(module._FIXED, "BLOCK_N", 16 if request.param else 4)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm,bias,residual,gated", [
    (False, False, False, False), (True, True, False, False), (False, False, True, False),
    (True, False, False, True), (True, True, True, True), (False, True, True, False),
])
def test_matches_reference(dtype, norm, bias, residual, gated, variant):
    problem = _problem(5, 40, 72, dtype, norm, bias, residual, gated)
    _assert_close(decode_linear(**problem), decode_linear_reference(**problem), problem)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, MAX_ROWS), n=st.integers(1, 70), k=st.integers(1, 90),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
       seed=st.integers(0, 2 ** 16))
def test_every_shape(rows, n, k, flags, seed):
    """Rows 1..16, N and K from 1 (not multiples of the tiles), every combination of options."""
    norm, bias, residual, gated = flags
    problem = _problem(rows, n, k, torch.bfloat16, norm, bias, residual, gated, seed)
    _assert_close(decode_linear(**problem), decode_linear_reference(**problem), problem)


@pytest.mark.parametrize("gated", [False, True])
def test_batch_invariance(gated, variant):
    """A row's result is bit-identical whatever rows it is computed with: fed alone, with 4 or
    with 15 others (a 1-token forward and a verify forward agree on every linear map)."""
    problem = _problem(MAX_ROWS, 24, 100, torch.bfloat16, True, True, True, gated)
    full = decode_linear(**problem)
    for rows in (1, 5, MAX_ROWS - 1):
        part = dict(problem, x=problem["x"][:rows], residual=problem["residual"][:rows])
        assert torch.equal(decode_linear(**part), full[:rows])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 3 * MAX_ROWS + 3), n=st.integers(1, 40), k=st.integers(1, 70),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
       seed=st.integers(0, 2 ** 16))
def test_exact_mode_any_row_count_is_row_invariant(rows, n, k, flags, seed):
    """Bit-exact mode (SPEC.md §14): any number of rows (past 16: several row tiles), and every
    row's result bit-identical to the same row computed alone and within a prefix of the rows —
    the 1-token forward, a verify forward and a batch of them agree on every map — and close to
    the reference."""
    norm, bias, residual, gated = flags
    problem = _problem(rows, n, k, torch.bfloat16, norm, bias, residual, gated, seed)
    full = decode_linear(**problem, exact=True)
    _assert_close(full, decode_linear_reference(**problem), problem)
    cut = max(1, rows // 2)
    part = dict(problem, x=problem["x"][:cut], residual=None if residual is False else problem["residual"][:cut])
    assert torch.equal(decode_linear(**part, exact=True), full[:cut])
    last = rows - 1
    alone = dict(problem, x=problem["x"][last:], residual=None if residual is False else problem["residual"][last:])
    assert torch.equal(decode_linear(**alone, exact=True), full[last:])


def test_exact_mode_rows_do_not_depend_on_their_place_in_the_tile():
    """Row 24 of 33 (the ninth row of the second tile) computed alone sits first in its tile: its bits
    must not change. Interpreted, a matrix product by numpy would round it by its
    place here (seed 25, 24 columns, K = 64)."""
    problem = _problem(33, 24, 64, torch.bfloat16, False, False, False, False, 25)
    full = decode_linear(**problem, exact=True)
    for row in range(33):
        alone = decode_linear(**dict(problem, x=problem["x"][row:row + 1]), exact=True)
        assert torch.equal(alone, full[row:row + 1]), row


@pytest.mark.parametrize("n,k,gated", [(48, 100, False), (40, 72, True)] + (
    [(1536, 1536, False), (1536, 8960, False), (8960, 1536, True)] if CUDA else []))
def test_exact_mode_column_tiles_do_not_change_any_bit(n, k, gated, monkeypatch):
    """Bit-exact mode's autotuning class varies the column tile and the pipeline depth only
    (SPEC.md §14): each column's chain of tensor-core steps over K is the same in a 16-, 32- or
    64-column tile, loaded 3 or 5 blocks ahead, so whichever a process's autotuner picks, the
    bits agree (and two processes agree)."""
    import flashspec.kernels.decode_linear as module

    monkeypatch.setattr(module, "_TUNED_SIZE", float("inf"))  # the fixed configuration, patched below
    problem = _problem(21, n, k, torch.bfloat16, True, True, True, gated)
    outs = []
    for block_n, stages in ((16, 3), (32, 3), (64, 3), (16, 5), (32, 5)):
        monkeypatch.setitem(module._FIXED_EXACT, "BLOCK_N", block_n)
        monkeypatch.setitem(module._FIXED_EXACT, "num_stages", stages)
        outs.append(decode_linear(**problem, exact=True))
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_exact_mode_runs_tensor_core_tiles_for_one_row_too(monkeypatch):
    """In bit-exact mode a 1-row call runs the tensor-core product of several-row calls (its own
    autotuning class, one tile for every row count), where the default runs CUDA cores."""
    import flashspec.kernels.decode_linear as module

    assert module._row_class(1, exact=True) == module._row_class(40, exact=True) == 3
    assert module._row_class(1) == 1 and module._row_class(5) == 2
    configs = module._prune(module._configs(), {"row_class": 3, "N": 4096})
    assert configs and all(c.kwargs["USE_DOT"] for c in configs)
    # one K tile for the class, 3 or 5 stages (neither changes a bit: the test above); the default's
    # several-row class keeps its 3-stage tiles
    assert {c.kwargs["BLOCK_K"] for c in configs} == {module.EXACT_BLOCK_K}
    assert {c.num_stages for c in configs} == {3, 5}
    assert {c.num_stages for c in module._prune(module._configs(), {"row_class": 2, "N": 4096})} == {3}


def test_leading_axes_and_weight_slices():
    """``x [B, q, K]`` keeps its leading axes; a weight that is a row slice of a larger matrix
    (StaticLM's modules point into the fused q/k/v matrix) is read in place."""
    problem = _problem(6, 32, 64, torch.bfloat16, True, False, False, False)
    stacked = torch.cat([problem["weight"], torch.randn_like(problem["weight"])])
    x = problem["x"].view(2, 3, 64)
    out = decode_linear(x, stacked[:32], norm_weight=problem["norm_weight"], eps=1e-6)
    assert out.shape == (2, 3, 32)
    _assert_close(out.view(6, 32), decode_linear_reference(**problem))


def test_strided_bias_norm_and_residual():
    """Bias, norm weights and residual that are strided views give the same result as copies."""
    problem = _problem(3, 16, 40, torch.bfloat16, True, True, True, False)
    strided = dict(problem,
                   bias=torch.stack([problem["bias"], -problem["bias"]], dim=1)[:, 0],
                   norm_weight=torch.stack([problem["norm_weight"], 2 * problem["norm_weight"]], dim=1)[:, 0],
                   residual=torch.cat([problem["residual"], 5 * problem["residual"]], dim=1)[:, :16])
    assert strided["bias"].stride(0) == 2 and strided["norm_weight"].stride(0) == 2
    assert torch.equal(decode_linear(**strided), decode_linear(**problem))


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


def _decode_logits(model, maps, width, wide=None):
    from flashspec.models.static import StaticLM

    lm = StaticLM(model)
    lm.decode_maps = maps
    lm.decode_maps_wide = maps if wide is None else wide
    if not CUDA:  # run the decode kernels through the interpreter
        lm._decode_kernels = lambda x: x.shape[1] <= StaticLM.COMPILED_WIDTHS
    lm.reset(2, 64)
    gen = torch.Generator().manual_seed(3)
    lm.forward(torch.randint(0, 128, (2, 20), generator=gen).to(DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE))
    tokens = torch.randint(0, 128, (2, width), generator=gen).to(DEVICE)
    return lm.forward(tokens, torch.tensor([20, 17], device=DEVICE))


ALL_MAPS = {"qkv", "o", "gate_up", "down"}


@pytest.mark.parametrize("arch,dtype,maps", [  # Qwen2: q/k/v bias; this Llama: MLP bias
    ("qwen2", torch.bfloat16, {"o"}), ("llama", torch.bfloat16, ALL_MAPS),
    ("qwen2", torch.float16, ALL_MAPS), ("llama", torch.float16, {"o"}),
])
def test_static_lm_fused_matches_unfused(arch, dtype, maps):
    from flashspec.models.static import StaticLM

    model = _tiny(dtype, arch)
    lm = StaticLM(model)
    assert lm.decode_maps == {"qkv", "o", "down"} and lm.decode_maps_wide == {"o"}  # the 16-bit defaults
    plain, fused = _decode_logits(model, set(), 3), _decode_logits(model, maps, 3)
    tolerance = 2 ** -5 if dtype == torch.bfloat16 else 2 ** -8
    torch.testing.assert_close(fused.float(), plain.float(), atol=tolerance, rtol=tolerance)
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.8


def test_static_lm_one_row_and_wide_maps(monkeypatch):
    """Forwards of one token row use decode_maps, wider ones decode_maps_wide: a bad map set
    shows up only in the forwards that use it."""
    import flashspec.models.static as cache

    calls = []
    real = cache.decode_linear

    def counting(x, *args, **kwargs):
        calls.append(x.numel() // x.shape[-1])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(cache, "decode_linear", counting)
    model = _tiny(torch.bfloat16)
    _decode_logits(model, {"o"}, 3, wide=set())
    assert calls == []  # 2 rows × 3 tokens: the (empty) wide set
    lm = cache.StaticLM(model)
    lm.decode_maps, lm.decode_maps_wide = {"o", "down"}, set()
    if not CUDA:
        lm._decode_kernels = lambda x: x.shape[1] <= cache.StaticLM.COMPILED_WIDTHS
    lm.reset(1, 64)
    lm.forward(torch.randint(0, 128, (1, 20)).to(DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE))
    assert calls == []  # a 20-token prefill: cuBLAS
    lm.forward(torch.randint(0, 128, (1, 1)).to(DEVICE), torch.full((1,), 20, device=DEVICE))
    assert calls == [1] * 2 * len(model.model.layers)  # o and down of every layer, one row each


def test_static_lm_decode_maps_are_checked():
    """float32 models keep cuBLAS; maps that fold in a norm need the norm decode_linear computes;
    unknown names are refused — each with a ValueError that says why."""
    from flashspec.models.static import StaticLM

    lm = StaticLM(_tiny(torch.float32))
    assert lm.decode_maps == lm.decode_maps_wide == frozenset()
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        lm.decode_maps = {"o"}
    with pytest.raises(ValueError, match="decode_maps_wide needs a bfloat16"):
        lm.decode_maps_wide = {"o"}
    lm = StaticLM(_tiny(torch.bfloat16))
    with pytest.raises(ValueError, match="can hold"):
        lm.decode_maps = {"o_proj"}
    with pytest.raises(ValueError, match="decode_maps_wide can hold"):
        lm.decode_maps_wide = {"mlp"}
    lm.decode_maps = {"qkv", "gate_up"}  # Qwen2's own RMSNorm and SiLU: accepted

    class OffsetNorm(torch.nn.Module):  # Gemma's RMSNorm scales by 1 + weight
        def __init__(self, norm):
            super().__init__()
            self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                    * (1 + self.weight.float())).to(x.dtype)

    model = _tiny(torch.bfloat16)
    layer = model.model.layers[0]
    layer.post_attention_layernorm = OffsetNorm(layer.post_attention_layernorm)
    lm = StaticLM(model)
    assert lm.decode_maps == {"o", "down"}  # the default without a norm to fold: no q/k/v
    lm.decode_maps = {"o", "down"}  # no norm folded in: fine
    with pytest.raises(ValueError, match="norm or activation"):
        lm.decode_maps = {"gate_up"}
    with pytest.raises(ValueError, match="norm or activation"):
        lm.decode_maps_wide = {"gate_up"}
    model = _tiny(torch.bfloat16)
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="norm or activation"):
        StaticLM(model).decode_maps = {"qkv"}


@pytest.mark.parametrize("rows", [1, 2, 5, MAX_ROWS])
def test_autotuner_offers_one_inner_product_per_row_class(rows):
    """On CUDA the autotuner chooses per (N, K, options, row class): CUDA-core tiles for one token
    row, tensor-core tiles for several (the CUDA-core loop re-reads the weights per row), and no
    tile wider than the matrix unless none is narrower."""
    import flashspec.kernels.decode_linear as module

    row_class = module._row_class(rows)
    assert row_class == (1 if rows == 1 else 2)
    for n in (1536, 8):
        kept = module._prune(module._configs(), {"row_class": row_class, "N": n})
        assert kept and all(c.kwargs["USE_DOT"] == (rows > 1) for c in kept)
        assert all(c.kwargs["BLOCK_N"] <= max(n, 16) for c in kept)
    assert module._prune(module._configs(), {"row_class": row_class, "N": 1}) != []


def test_autotune_choice_is_per_pdl_setting():
    """The autotuner keys its choice on PDL as well: ``flashspec bench gpu`` times the defaults
    with PDL on and off in one process, and each must run the tile chosen under its own setting."""
    import flashspec.kernels.decode_linear as module

    assert {"N", "K", "row_class", "PDL"} <= set(module._tuned.keys)
