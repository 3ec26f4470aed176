"""The flash-decoding attention kernels (flashspec.kernels.attention): parity with the SDPA reference,
masking of stale cache entries, the split / row-block / layout variants, torch.compile, and
importing without Triton.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); with CUDA they are compiled and run natively.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from flashspec.kernels import attention  # noqa: E402
from flashspec.kernels.attention import (  # noqa: E402
    available,
    decode_attention,
    decode_attention_heads,
    decode_attention_reference,
    plan_splits,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
GARBAGE = 1e30  # stale cache entries: huge but finite in every dtype tested (bf16/fp32 max ~3.4e38)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _problem(batch, kv_heads, rows, dim, capacity, dtype, positions=None, seed=0):
    """Random query/cache/positions, plus the cache with every entry past each sequence's largest
    position overwritten by huge values (``stale``) and the same cache zeroed there (``clean``)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads, rows, dim, generator=gen)
    keys = torch.randn(batch, kv_heads, capacity, dim, generator=gen)
    values = torch.randn(batch, kv_heads, capacity, dim, generator=gen)
    if positions is None:
        positions = torch.randint(0, capacity, (batch, rows), generator=gen)
        positions[0, 0] = 0  # a row that sees one key
        positions[-1, -1] = capacity - 1  # a row that sees the whole cache
        if batch > 1:
            positions[1] = torch.randint(0, 3, (rows,), generator=gen)  # a sequence only 3 long
    beyond = torch.arange(capacity) > positions.max(dim=1).values[:, None]  # [B, C]
    beyond = beyond[:, None, :, None]
    sign = torch.where(torch.rand(keys.shape, generator=gen) < 0.5, -1.0, 1.0)
    stale_keys = torch.where(beyond, GARBAGE * sign, keys)
    stale_values = torch.where(beyond, GARBAGE * sign.flip(-1), values)
    clean_keys, clean_values = keys.masked_fill(beyond, 0.0), values.masked_fill(beyond, 0.0)

    def to(t):
        return t.to(device=DEVICE, dtype=dtype)

    return (to(query), to(stale_keys), to(stale_values), to(clean_keys), to(clean_values),
            positions.to(device=DEVICE, dtype=torch.int64))


def _check_parity(query, keys, values, clean_keys, clean_values, positions, scale, dtype, **kw):
    out = decode_attention(query, keys, values, positions, scale, **kw)
    assert out.shape == query.shape and out.dtype == dtype and out.device == query.device
    assert torch.isfinite(out).all(), "NaN/inf in the output"
    ref = decode_attention_reference(query, clean_keys, clean_values, positions, scale)
    err = _rel_err(out, ref)
    assert err < TOLERANCE[dtype], err
    return out


GRID = list(itertools.product((1, 3), (1, 2), (1, 3), (1, 5), (16, 64), (256, 512)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch,kv_heads,groups,width,dim,capacity", GRID,
                         ids=[f"B{b}-Hkv{h}-G{g}-q{q}-D{d}-C{c}" for b, h, g, q, d, c in GRID])
def test_parity_with_reference(batch, kv_heads, groups, width, dim, capacity, dtype):
    """Parity over the grid, stale huge entries past each sequence's positions ignored."""
    seed = hash((batch, kv_heads, groups, width, dim, capacity)) % 2**31
    problem = _problem(batch, kv_heads, groups * width, dim, capacity, dtype, seed=seed)
    _check_parity(*problem, dim ** -0.5, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_counts_agree(dtype):
    """One split (no combine kernel), two, the default and one per tile give the same output."""
    problem = _problem(3, 2, 6, 64, 512, dtype, seed=1)
    tiles = 512 // (attention.BLOCK_N_FP32 if dtype == torch.float32 else attention.BLOCK_N)
    outs = [_check_parity(*problem, 0.125, dtype, num_splits=n) for n in (1, 2, None, tiles, 10 * tiles)]
    for out in outs[1:]:
        assert _rel_err(out, outs[0]) < TOLERANCE[dtype]


def test_masking_is_exact_at_the_edges():
    """Every row at position 0 sees key 0 only: the output is value 0, whatever lies beyond;
    every row at C - 1 sees everything."""
    batch, kv_heads, rows, dim, capacity = 2, 2, 7, 32, 256
    zeros = torch.zeros(batch, rows, dtype=torch.int64)
    query, keys, values, _, _, positions = _problem(batch, kv_heads, rows, dim, capacity, torch.float32,
                                                    positions=zeros, seed=2)
    for num_splits in (1, None):
        out = decode_attention(query, keys, values, positions, 0.1, num_splits=num_splits)
        torch.testing.assert_close(out, values[:, :, :1].expand_as(out), rtol=0, atol=0)
    full = torch.full((batch, rows), capacity - 1, dtype=torch.int64, device=DEVICE)
    problem = _problem(batch, kv_heads, rows, dim, capacity, torch.float32, positions=full.cpu(), seed=3)
    _check_parity(*problem, 0.1, torch.float32)


def test_many_rows_use_row_blocks():
    """M = 80 query rows: more than one row block (64 rows for bf16, 16 for fp32)."""
    for dtype in (torch.float32, torch.bfloat16):
        problem = _problem(2, 1, 80, 16, 256, dtype, seed=4)
        _check_parity(*problem, 0.25, dtype)


def test_head_dims_not_powers_of_two():
    for dim in (8, 80):
        problem = _problem(2, 2, 3, dim, 256, torch.float32, seed=5 + dim)
        _check_parity(*problem, dim ** -0.5, torch.float32)


def test_float16():
    problem = _problem(2, 2, 6, 64, 256, torch.float16, seed=6)
    _check_parity(*problem, 0.125, torch.float16)


def test_one_row_per_combine_program(monkeypatch):
    """Kernel 2 with one row per program (its CUDA configuration) under the interpreter too."""
    monkeypatch.setattr(attention, "COMBINE_ROWS", 1)
    for dtype in (torch.float32, torch.bfloat16):
        problem = _problem(2, 2, 5, 32, 512, dtype, seed=7)
        _check_parity(*problem, 0.2, dtype, num_splits=4)


def test_strided_query_and_positions():
    """A query that is a non-contiguous view and positions with a non-unit stride."""
    query, keys, values, clean_keys, clean_values, positions = _problem(2, 2, 6, 32, 256, torch.float32, seed=8)
    dim = 32
    wide = torch.zeros(2, 6, 2, dim, device=DEVICE).transpose(1, 2)  # [2, 2, 6, 32], strided
    wide.copy_(query)
    pos_wide = torch.stack([positions, positions], dim=-1)[..., 0]  # stride 2 along rows
    assert not wide.is_contiguous() and pos_wide.stride(1) == 2
    out = decode_attention(wide, keys, values, pos_wide, dim ** -0.5)
    ref = decode_attention_reference(query, clean_keys, clean_values, positions, dim ** -0.5)
    assert _rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_heads_layout_as_static_lm(dtype):
    """decode_attention_heads on StaticLM's tensors: query [B, H, q, D] as the transpose of
    [B, q, H, D], positions [B, q] = start + j; output [B, q, H, D] equals SDPA over the folded
    query (StaticLM's current code)."""
    batch, heads, kv_heads, width, dim, capacity = 3, 6, 2, 4, 32, 256
    groups = heads // kv_heads
    gen = torch.Generator().manual_seed(9)
    start = torch.tensor([0, 17, capacity - width])
    positions = (start[:, None] + torch.arange(width)).to(DEVICE)
    query = torch.randn(batch, width, heads, dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    keys = torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(DEVICE, dtype)
    values = torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(DEVICE, dtype)
    for num_splits in (1, None):
        out = decode_attention_heads(query, keys, values, positions, dim ** -0.5, num_splits=num_splits)
        assert out.shape == (batch, width, heads, dim) and out.is_contiguous()
        folded = query.reshape(batch, kv_heads, groups * width, dim)
        query_positions = positions[:, None, :].expand(batch, groups, width).reshape(batch, groups * width)
        ref = decode_attention_reference(folded, keys, values, query_positions, dim ** -0.5)
        ref = ref.reshape(batch, heads, width, dim).transpose(1, 2)
        assert _rel_err(out, ref) < TOLERANCE[dtype]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 3), width=st.integers(1, 6), groups=st.sampled_from([1, 3]), data=st.data())
def test_exact_mode_token_outputs_do_not_depend_on_the_call(batch, width, groups, data):
    """Bit-exact mode (SPEC.md §14): token ``j``'s output is the same bits whether the call feeds
    one token or ``width`` per sequence, and whether its sequence is alone or beside others (the
    1-token forward, the verify forward and a batch agree); and it matches the reference."""
    kv_heads, dim, capacity = 2, 32, 256
    heads = kv_heads * groups
    start = data.draw(st.lists(st.integers(0, capacity - width), min_size=batch, max_size=batch), label="start")
    positions = (torch.tensor(start)[:, None] + torch.arange(width)).to(DEVICE)
    gen = torch.Generator().manual_seed(batch * 100 + width * 10 + groups)
    query = torch.randn(batch, width, heads, dim, generator=gen).to(DEVICE, torch.bfloat16).transpose(1, 2)
    keys = torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(DEVICE, torch.bfloat16)
    values = torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(DEVICE, torch.bfloat16)
    full = decode_attention_heads(query, keys, values, positions, dim ** -0.5, exact=True)  # [B, q, H, D]
    folded = query.reshape(batch, kv_heads, groups * width, dim)
    query_positions = positions[:, None, :].expand(batch, groups, width).reshape(batch, groups * width)
    ref = decode_attention_reference(folded, keys, values, query_positions, dim ** -0.5)
    assert _rel_err(full, ref.reshape(batch, heads, width, dim).transpose(1, 2)) < TOLERANCE[torch.bfloat16]
    j = data.draw(st.integers(0, width - 1), label="token")
    one = decode_attention_heads(query[:, :, j:j + 1], keys, values, positions[:, j:j + 1], dim ** -0.5, exact=True)
    assert torch.equal(one[:, 0], full[:, j])
    b = data.draw(st.integers(0, batch - 1), label="sequence")
    alone = decode_attention_heads(query[b:b + 1], keys[b:b + 1], values[b:b + 1], positions[b:b + 1], dim ** -0.5,
                                   exact=True)
    assert torch.equal(alone[0], full[b])


def test_exact_mode_rows_do_not_depend_on_their_place_in_the_tile():
    """A token's row sits at another place of the 16-row tile in a 1-token call than in a 6-token
    call (3 query heads per key head): its bits must not change. Interpreted, a matrix product by numpy
    would round it by its place here (start 241, token 5)."""
    batch, width, groups, kv_heads, dim, capacity = 3, 6, 3, 2, 32, 256
    heads = kv_heads * groups
    gen = torch.Generator().manual_seed(batch * 100 + width * 10 + groups)
    query = torch.randn(batch, width, heads, dim, generator=gen).to(DEVICE, torch.bfloat16).transpose(1, 2)
    keys = torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(DEVICE, torch.bfloat16)
    values = torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(DEVICE, torch.bfloat16)
    for start in ([241, 0, 0], [241, 5, 0], [100, 250, 7]):
        positions = (torch.tensor(start)[:, None] + torch.arange(width)).to(DEVICE)
        full = decode_attention_heads(query, keys, values, positions, dim ** -0.5, exact=True)
        for j in range(width):
            one = decode_attention_heads(query[:, :, j:j + 1], keys, values, positions[:, j:j + 1], dim ** -0.5,
                                         exact=True)
            assert torch.equal(one[:, 0], full[:, j]), (start, j)


def test_exact_mode_tiles_and_splits_come_from_the_capacity_alone():
    """In bit-exact mode the row tile is 16 whatever the number of query rows, and the key-axis
    split is the one of a single row block, whatever the batch."""
    assert attention._tiles(1, torch.bfloat16, exact=True)[0] == attention._tiles(48, torch.bfloat16, exact=True)[0] == 16
    assert attention._tiles(48, torch.bfloat16)[0] == 64  # the default widens it
    device = torch.device("cpu")
    assert plan_splits(1, 768, device) != plan_splits(32, 768, device)  # the default: from the row blocks


def test_torch_compile_fullgraph():
    """Under torch.compile the call is one opaque custom op: no graph break, same values."""
    problem = _problem(2, 2, 6, 32, 256, torch.float32, seed=10)
    query, keys, values, clean_keys, clean_values, positions = problem

    def fn(q, k, v, p):
        return decode_attention(q, k, v, p, 0.2) * 2.0

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(query, keys, values, positions), fn(query, keys, values, positions))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3),
    rows=st.integers(1, 20),
    dim=st.sampled_from([16, 32, 64]),
    data=st.data(),
)
def test_property_parity(batch, rows, dim, data):
    capacity = 256
    positions = data.draw(st.lists(st.lists(st.integers(0, capacity - 1), min_size=rows, max_size=rows),
                                   min_size=batch, max_size=batch), label="positions")
    num_splits = data.draw(st.sampled_from([None, 1, 3]), label="num_splits")
    problem = _problem(batch, 1, rows, dim, capacity, torch.float32, positions=torch.tensor(positions),
                       seed=batch * 1000 + rows * 10 + dim)
    _check_parity(*problem, dim ** -0.5, torch.float32, num_splits=num_splits)


def test_plan_splits_is_shape_only_and_tiles_the_cache():
    for rows, capacity in itertools.product((1, 2, 6, 64, 1000), (256, 768, 4096, 32768)):
        splits, split_keys = plan_splits(rows, capacity, torch.device("cpu"))
        assert split_keys % attention.BLOCK_N == 0
        assert (splits - 1) * split_keys < capacity <= splits * split_keys
    assert plan_splits(1, 512, torch.device("cpu"), num_splits=1) == (1, 512)
    assert plan_splits(1, 512, torch.device("cpu"), num_splits=100) == (8, 64)


def test_bad_arguments():
    query, keys, values, _, _, positions = _problem(1, 2, 3, 16, 256, torch.float32)
    with pytest.raises(ValueError):
        decode_attention(query, keys, values[:, :1], positions, 1.0)
    with pytest.raises(ValueError):
        decode_attention(query, keys, values, positions[:, :2], 1.0)
    with pytest.raises(ValueError):
        decode_attention(query.to(torch.bfloat16), keys, values, positions, 1.0)
    with pytest.raises(ValueError):
        decode_attention_heads(torch.zeros(1, 3, 1, 16, device=DEVICE), keys, values, positions[:, :1], 1.0)


def test_available():
    assert available(torch.zeros(1, device=DEVICE))
    if not CUDA:
        assert available(torch.zeros(1))  # the interpreter runs CPU tensors


def test_imports_without_triton(monkeypatch):
    """A second copy of the module, loaded while ``import triton`` fails: it imports, reports
    itself unavailable and its reference still works."""
    import flashspec.kernels

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    # A fresh copy of the shim too (it holds the optional triton import); both put back after.
    monkeypatch.delitem(sys.modules, "flashspec.kernels.shim")
    monkeypatch.delattr(flashspec.kernels, "shim")
    spec = importlib.util.spec_from_file_location("flashspec_attention_without_triton", attention.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.triton is None
    assert not module.available(torch.zeros(1))
    query, keys, values, _, _, positions = _problem(1, 1, 2, 16, 256, torch.float32)
    assert module.decode_attention_reference(query, keys, values, positions, 0.25).shape == query.shape
