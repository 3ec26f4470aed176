"""The Triton verify backend (flashspec.kernels.verify): parity with the reference, the law it
samples, backend selection, and on a GPU no recompilation and no host synchronisation.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); with CUDA they are compiled and run natively.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from stats_helpers import ALPHA, chi2_pvalue  # noqa: E402

from flashspec.sampling import SamplingParams, probabilities, sample  # noqa: E402
from flashspec.verify import BACKENDS, verify  # noqa: E402

verify_module = importlib.import_module("flashspec.verify")  # (flashspec.verify is also the function)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

MODES = {
    "greedy": SamplingParams(do_sample=False),
    "t0.7": SamplingParams(do_sample=True, temperature=0.7),
    "t1.3_topk5": SamplingParams(do_sample=True, temperature=1.3, top_k=5),
    "topp0.9": SamplingParams(do_sample=True, top_p=0.9),
    "t0.7_topk_topp": SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.8),
}
DRAFTS = ["onehot", "from_q", "random_vs_q", "q_is_p"]


def make_inputs(batch, k, vocab, dtype, params, drafts, seed, device=DEVICE):
    """Logits ``[B, k+1, V]``, drafts, q and float64 uniforms, built on the CPU then moved.

    drafts: "onehot" (q = None; random drafts whose random-length prefix agrees with the
    argmax, so greedy accepts too), "from_q" (drafts drawn from an independent q: accepts and
    rejections), "random_vs_q" (uniform drafts with an independent q: mostly rejections),
    "q_is_p" (q equal to the target law, drafts drawn from it: nearly everything accepted).
    """
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, k + 1, vocab, generator=g) * 3).to(dtype)
    uniforms = torch.rand(batch, k + 1, dtype=torch.float64, generator=g)
    uniforms = torch.where(torch.rand(batch, k + 1, generator=g) < 0.1, 0.0, uniforms)
    law = params if params.do_sample else SamplingParams(do_sample=True)
    if drafts == "onehot":
        q = None
        tokens = torch.randint(0, vocab, (batch, k), generator=g)
        agree = torch.randint(0, k + 1, (batch,), generator=g)
        tokens = torch.where(torch.arange(k)[None, :] < agree[:, None], logits[:, :k].float().argmax(-1), tokens)
    else:
        if drafts == "q_is_p":
            q = probabilities(logits[:, :k], law)
        else:
            q = probabilities(logits[:, :k].float() + torch.randn(batch, k, vocab, generator=g) * 2, law)
        if drafts == "random_vs_q":
            tokens = torch.randint(0, vocab, (batch, k), generator=g)
        else:
            tokens = sample(q, torch.rand(batch, k, dtype=torch.float64, generator=g))
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(logits), move(tokens), move(q), move(uniforms)


def both(logits, tokens, q, params, uniforms):
    """Reference and Triton results; asserts they agree exactly and returns the Triton one."""
    ref = verify(logits, tokens, q, params, uniforms, backend="reference")
    tri = verify(logits, tokens, q, params, uniforms, backend="triton")
    assert tri.num_accepted.dtype == torch.long and tri.tokens.dtype == torch.long
    assert tri.num_accepted.device == logits.device and tri.tokens.device == logits.device
    assert torch.equal(ref.num_accepted, tri.num_accepted), (ref.num_accepted, tri.num_accepted)
    assert torch.equal(ref.tokens, tri.tokens), (ref.tokens, tri.tokens)
    return tri


def check(inputs, params):
    """:func:`both` on the output of :func:`make_inputs`."""
    logits, tokens, q, uniforms = inputs
    return both(logits, tokens, q, params, uniforms)


# ----------------------------------------------------------------------------------------------
# Parity with the reference for identical uniforms
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [8, 1000, 5003])
@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mode", list(MODES))
def test_parity_grid(mode, batch, k, vocab, dtype):
    params = MODES[mode]
    for drafts in DRAFTS:
        seed = zlib.crc32(f"{mode}-{batch}-{k}-{vocab}-{dtype}-{drafts}".encode())
        check(make_inputs(batch, k, vocab, dtype, params, drafts, seed), params)


@pytest.mark.parametrize("mode", ["greedy", "t0.7", "topp0.9"])
def test_parity_exercises_accept_and_reject(mode):
    """On a larger batch both branches occur: full acceptance (bonus token), rejections
    (residual draws), and with q == p (nearly) everything is accepted."""
    params = MODES[mode]
    batch, k, vocab = 64, 4, 1000
    seen = {"all": 0, "reject": 0}
    for seed, drafts in enumerate(["onehot", "from_q"] * 2):
        result = check(make_inputs(batch, k, vocab, torch.bfloat16, params, drafts, 100 + seed), params)
        n = result.num_accepted
        seen["all"] += int((n == k).sum())
        seen["reject"] += int((n < k).sum())
    if not params.do_sample:  # greedy: agreeing prefixes of random length
        assert seen["all"] > 0 and seen["reject"] > 0
    else:
        assert seen["reject"] > 0
        logits, tokens, q, uniforms = make_inputs(batch, k, vocab, torch.bfloat16, params, "q_is_p", 7)
        n = both(logits, tokens, q, params, uniforms).num_accepted
        assert (n == k).float().mean() > 0.9
        # drafts from an independent law with small temperature still get accepted at times
        logits, tokens, q, uniforms = make_inputs(256, 1, 8, torch.float32, params, "from_q", 8)
        n = both(logits, tokens, q, params, uniforms).num_accepted
        assert 0 < int(n.sum()) < 256


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_dtypes(dtype, q_dtype):
    params = MODES["t0.7"]
    logits, tokens, q, uniforms = make_inputs(3, 2, 300, dtype, params, "from_q", 11)
    both(logits, tokens, q.to(q_dtype), params, uniforms)
    both(logits, tokens, None, MODES["greedy"], None)


def test_non_contiguous_inputs():
    """Slices of larger tensors (as the engine passes uniforms[:, :k+1]) give the same result."""
    params = MODES["t0.7"]
    logits, tokens, q, uniforms = make_inputs(4, 3, 200, torch.float32, params, "from_q", 3)
    wide_logits = torch.randn(4, 6, 200, device=DEVICE)
    wide_logits[:, 1:5] = logits
    wide_u = torch.rand(4, 9, dtype=torch.float64, device=DEVICE)
    wide_u[:, 2:6] = uniforms
    wide_tokens = torch.zeros(4, 7, dtype=torch.long, device=DEVICE)
    wide_tokens[:, ::2][:, :3] = tokens
    wide_q = torch.rand(4, 3, 400, device=DEVICE)
    wide_q[..., ::2] = q  # last dimension strided: copied to contiguous rows
    args = (wide_logits[:, 1:5], wide_tokens[:, ::2][:, :3], wide_q[..., ::2], params, wide_u[:, 2:6])
    result = both(*args)
    expected = verify(logits, tokens, q, params, uniforms, backend="reference")
    assert torch.equal(result.tokens, expected.tokens)


def test_uniforms_float32_are_promoted():
    params = MODES["t0.7"]
    logits, tokens, q, uniforms = make_inputs(3, 2, 50, torch.float32, params, "from_q", 5)
    both(logits, tokens, q, params, uniforms.float())


def test_greedy_ties_take_lowest_index_across_chunks():
    vocab = 5003  # two chunks of 4096
    logits = torch.randn(2, 3, vocab, device=DEVICE)
    logits[0, 0, [100, 4500]] = 50.0  # tie across the chunk boundary: 100
    logits[0, 1, [4200, 4600]] = 50.0  # tie inside the second chunk: 4200
    logits[0, 2, :] = float("-inf")  # all -inf: 0, like torch.argmax
    logits[1, 0, [0, 4096]] = 50.0
    drafts = torch.tensor([[100, 4200], [0, 5]], device=DEVICE)
    result = both(logits, drafts, None, MODES["greedy"], None)
    assert result.tokens.tolist()[0] == [100, 4200, 0]
    assert result.num_accepted.tolist()[1] >= 1


def test_many_chunks():
    """V > 64 chunks: the partial folds and the chunk search take several steps."""
    vocab = 66 * 4096 + 5
    for mode in ["greedy", "t0.7", "topp0.9"]:
        for drafts in ["onehot", "from_q"]:
            check(make_inputs(2, 1, vocab, torch.bfloat16, MODES[mode], drafts, 9), MODES[mode])


def test_prefix_only_and_residual_by_hand():
    """The worked example of test_verify.py through the Triton backend."""
    params = SamplingParams(do_sample=True)
    target = torch.zeros(1, 4, 4, device=DEVICE)
    q = torch.full((1, 3, 4), 0.25, device=DEVICE)
    q[0, 0] = torch.tensor([0.1, 0.7, 0.1, 0.1])
    drafts = torch.tensor([[1, 2, 3]], device=DEVICE)
    u = torch.tensor([[0.9, 0.0, 0.0, 0.0]], dtype=torch.float64, device=DEVICE)
    assert verify(target, drafts, q, params, u, backend="triton").tokens.tolist() == [[0, -1, -1, -1]]
    u[0, 3] = 0.5
    assert verify(target, drafts, q, params, u, backend="triton").tokens.tolist() == [[2, -1, -1, -1]]
    u = torch.tensor([[0.3, 0.99, 0.5, 0.8]], dtype=torch.float64, device=DEVICE)
    r = verify(target, drafts, q, params, u, backend="triton")
    assert r.num_accepted.tolist() == [3] and r.tokens.tolist() == [[1, 2, 3, 3]]


@pytest.mark.parametrize("with_probs", [False, True])
def test_zero_probability_draft_rejected_with_zero_uniform(with_probs):
    params = SamplingParams(do_sample=True, top_k=2)
    target = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]], device=DEVICE)
    q = torch.tensor([[[0.1, 0.1, 0.7, 0.1]]], device=DEVICE) if with_probs else None
    u = torch.zeros(1, 2, dtype=torch.float64, device=DEVICE)
    r = verify(target, torch.tensor([[2]], device=DEVICE), q, params, u, backend="triton")
    assert r.num_accepted.tolist() == [0] and r.tokens.tolist() == [[0, -1]]
    r = verify(target, torch.tensor([[1]], device=DEVICE), q, params, u, backend="triton")
    assert r.num_accepted.tolist() == [1] and r.tokens.tolist() == [[1, 2]]


def test_zero_mass_residual_falls_back_to_p():
    params = SamplingParams(do_sample=True, temperature=0.8)
    target = torch.tensor([[[2.0, 0.5, -1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]]], device=DEVICE)
    p = probabilities(target, params)
    q = p[:, :1] * (1 + 1e-5)  # q slightly above p everywhere: no residual mass
    for u_final in [0.0, 0.3, 0.6, 0.999999]:
        u = torch.tensor([[1 - 1e-7, u_final]], dtype=torch.float64, device=DEVICE)
        r = both(target, torch.tensor([[0]], device=DEVICE), q, params, u)
        assert r.num_accepted.tolist() == [0]


@pytest.mark.parametrize("vocab", [1000, 2 * 4096 + 37], ids=["4 sequences per draw program", "3 chunks"])
def test_zero_mass_fallback_beside_sequences_with_mass(vocab):
    """The draw kernel computes p_n's chunk masses itself for sequences whose residual has no
    mass; sequences with mass in the same program (small V) or batch keep drawing from r."""
    params = SamplingParams(do_sample=True, temperature=0.8)
    g = torch.Generator().manual_seed(vocab)
    batch = 4
    target = torch.randn(batch, 2, vocab, generator=g) * 3
    p = probabilities(target, params)
    q = probabilities(torch.randn(batch, 1, vocab, generator=g) * 3, params)
    empty = torch.tensor([True, False, True, False])
    q[empty] = p[empty, :1] * (1 + 1e-5)  # q slightly above p everywhere: no residual mass
    drafts = torch.zeros(batch, 1, dtype=torch.long)
    target, q, drafts, empty = (t.to(DEVICE) for t in (target, q, drafts, empty))
    for u_final in [0.0, 0.37, 0.999999]:
        u = torch.tensor([[1 - 1e-7, u_final]] * batch, dtype=torch.float64, device=DEVICE)
        r = both(target, drafts, q, params, u)
        assert r.num_accepted[empty].tolist() == [0, 0]


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 4))
    k = draw(st.integers(0, 5))
    vocab = draw(st.integers(2, 300))
    mode = draw(st.sampled_from(list(MODES)))
    drafts = draw(st.sampled_from(DRAFTS))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, k, vocab, mode, drafts, dtype, seed


@settings(max_examples=25 if CUDA else 60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_parity_property(case):
    batch, k, vocab, mode, drafts, dtype, seed = case
    check(make_inputs(batch, k, vocab, dtype, MODES[mode], drafts, seed), MODES[mode])


# ----------------------------------------------------------------------------------------------
# The law: chi-square through the Triton path (SPEC.md §6 conventions)
# ----------------------------------------------------------------------------------------------

N_SAMPLES = 20_000
TARGET = torch.tensor(
    [
        [2.0, 1.2, 0.3, -0.5, 1.7, -1.0, 0.4, 0.9],
        [0.2, -0.4, 1.5, 1.1, -2.0, 0.9, 0.0, -0.3],
        [-1.0, 0.0, 1.0, 0.5, 0.7, 0.1, 1.3, 0.2],
    ]
)
DRAFTER = torch.tensor(
    [
        [0.1, 1.5, 1.0, 0.8, -0.3, 0.2, -1.0, 1.1],
        [1.0, 0.3, 0.2, -1.0, 1.4, 0.0, 0.6, -0.2],
    ]
)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(do_sample=True, temperature=0.8), SamplingParams(do_sample=True, temperature=1.3, top_k=6, top_p=0.9)],
    ids=["t0.8", "t1.3_topk_topp"],
)
def test_chi_square_through_triton(params):
    """20,000 rows of one call: the first token follows p_1, the second (given the first draft
    was accepted) follows p_2, and the acceptance rate is Σ min(p, q)."""
    k = 2
    g = torch.Generator().manual_seed(2024)
    q_one = probabilities(DRAFTER, params)  # [k, V], p != q
    q = q_one[None].expand(N_SAMPLES, -1, -1).contiguous()
    drafts = sample(q, torch.rand(N_SAMPLES, k, dtype=torch.float64, generator=g))
    uniforms = torch.rand(N_SAMPLES, k + 1, dtype=torch.float64, generator=g)
    logits = TARGET[None].expand(N_SAMPLES, -1, -1).contiguous().to(torch.bfloat16)
    result = verify(logits.to(DEVICE), drafts.to(DEVICE), q.to(DEVICE), params, uniforms.to(DEVICE), backend="triton")
    n, tokens = result.num_accepted.cpu(), result.tokens.cpu()
    p = probabilities(logits[0], params).double()  # [k+1, V]
    vocab = p.shape[1]

    first = np.bincount(tokens[:, 0].numpy(), minlength=vocab)
    assert chi2_pvalue(first, p[0].numpy()) > ALPHA, (first, p[0])
    second = np.bincount(tokens[n >= 1, 1].numpy(), minlength=vocab)
    assert second.sum() > 2_000
    assert chi2_pvalue(second, p[1].numpy()) > ALPHA, (second, p[1])

    rate = float((n >= 1).double().mean())
    expected = float(torch.minimum(p[0], q_one[0].double()).sum())
    assert 0.05 < expected < 0.95
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / N_SAMPLES) ** 0.5

    # power: the same samples reject the law at T = 1
    p_t1 = probabilities(logits[0, 0], SamplingParams(do_sample=True, top_k=params.top_k, top_p=params.top_p))
    assert chi2_pvalue(first, p_t1.double().numpy()) < ALPHA
    # and the reference agrees token for token on these inputs
    ref = verify(logits, drafts, q, params, uniforms, backend="reference")
    assert torch.equal(ref.tokens, tokens)


# ----------------------------------------------------------------------------------------------
# Backend selection and errors
# ----------------------------------------------------------------------------------------------


def _small(device=DEVICE):
    return make_inputs(2, 2, 16, torch.float32, MODES["t0.7"], "from_q", 1, device)


def _spy(monkeypatch):
    """Record which backend ran."""
    import flashspec.kernels.verify as vt

    ran = []
    real_triton, real_reference = vt.verify_triton, verify_module._verify_reference
    monkeypatch.setattr(vt, "verify_triton", lambda *a: ran.append("triton") or real_triton(*a))
    monkeypatch.setattr(verify_module, "_verify_reference", lambda *a: ran.append("reference") or real_reference(*a))
    return ran


def test_backends_listed():
    assert set(BACKENDS) == {"auto", "reference", "triton"}


def test_unknown_backend_names_the_choices():
    logits, tokens, q, u = _small()
    with pytest.raises(ValueError, match="auto, reference, triton"):
        verify(logits, tokens, q, MODES["t0.7"], u, backend="cuda")


def test_auto_picks_by_device(monkeypatch):
    monkeypatch.delenv(verify_module.BACKEND_ENV, raising=False)
    ran = _spy(monkeypatch)
    logits, tokens, q, u = _small()
    verify(logits, tokens, q, MODES["t0.7"], u)
    verify(logits.cpu(), tokens.cpu(), q.cpu(), MODES["t0.7"], u.cpu())
    assert ran == (["triton", "reference"] if CUDA else ["reference", "reference"])


@pytest.mark.parametrize("name", ["reference", "triton"])
def test_env_var_forces_backend(monkeypatch, name):
    monkeypatch.setenv(verify_module.BACKEND_ENV, name)
    ran = _spy(monkeypatch)
    logits, tokens, q, u = _small()
    verify(logits, tokens, q, MODES["t0.7"], u)
    assert ran == [name]
    verify(logits, tokens, q, MODES["t0.7"], u, backend="reference")  # an explicit choice wins
    assert ran == [name, "reference"]


def test_env_var_unknown_raises(monkeypatch):
    monkeypatch.setenv(verify_module.BACKEND_ENV, "fast")
    logits, tokens, q, u = _small()
    with pytest.raises(ValueError, match="FLASHSPEC_VERIFY_BACKEND.*reference, triton"):
        verify(logits, tokens, q, MODES["t0.7"], u)


@pytest.mark.parametrize("how", ["argument", "env"])
def test_triton_missing(monkeypatch, how):
    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" now raises ImportError
    logits, tokens, q, u = _small()
    kwargs = {"backend": "triton"}
    if how == "env":
        monkeypatch.setenv(verify_module.BACKEND_ENV, "triton")
        kwargs = {}
    with pytest.raises(ValueError) as info:
        verify(logits, tokens, q, MODES["t0.7"], u, **kwargs)
    assert str(info.value) == "The Triton verify backend needs Triton: pip install 'flashspec[gpu]' (Linux only)."
    # auto quietly falls back to the reference
    monkeypatch.delenv(verify_module.BACKEND_ENV, raising=False)
    ref = verify(logits, tokens, q, MODES["t0.7"], u)
    assert torch.equal(ref.tokens, verify(logits, tokens, q, MODES["t0.7"], u, backend="reference").tokens)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    logits, tokens, q, u = _small(torch.device("cpu"))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        verify(logits, tokens, q, MODES["t0.7"], u, backend="triton")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_validation_before_dispatch(backend):
    logits, tokens, q, u = _small()
    params = MODES["t0.7"]
    with pytest.raises(ValueError, match="target_logits"):
        verify(logits[:, :2], tokens, q, params, u, backend=backend)
    with pytest.raises(ValueError, match="uniforms"):
        verify(logits, tokens, q, params, None, backend=backend)
    with pytest.raises(ValueError, match="uniforms"):
        verify(logits, tokens, q, params, u[:, :2], backend=backend)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(logits, tokens, q[..., :8], params, u, backend=backend)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(logits, tokens[0], q, params, u, backend=backend)
    verify(logits, tokens, None, MODES["greedy"], None, backend=backend)  # greedy needs no uniforms


@needs_cuda
def test_mixed_devices_raise():
    logits, tokens, q, u = _small()
    with pytest.raises(ValueError, match="uniforms"):
        verify(logits, tokens, q, MODES["t0.7"], u.cpu(), backend="triton")


# ----------------------------------------------------------------------------------------------
# GPU only: compilations, synchronisation, CUDA graphs
# ----------------------------------------------------------------------------------------------


@needs_cuda
def test_no_recompilation_across_batch_and_gamma():
    from flashspec.kernels.verify import compiled_variants

    vocab = 32000
    for mode, drafts in [("greedy", "onehot"), ("t0.7", "from_q"), ("t0.7", "onehot"), ("topp0.9", "from_q")]:
        params = MODES[mode]
        check(make_inputs(2, 3, vocab, torch.bfloat16, params, drafts, 0), params)  # compile once
        before = compiled_variants()
        assert before > 0
        for batch in (1, 4, 16):
            for k in (1, 4, 8):
                check(make_inputs(batch, k, vocab, torch.bfloat16, params, drafts, batch * 10 + k), params)
        assert compiled_variants() == before, (mode, drafts)


@needs_cuda
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("drafts", ["onehot", "from_q"])
def test_no_host_sync(mode, drafts):
    params = MODES[mode]
    inputs = make_inputs(8, 4, 32000, torch.bfloat16, params, drafts, 5)
    verify(*inputs[:3], params, inputs[3], backend="triton")  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = verify(*inputs[:3], params, inputs[3], backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = verify(*inputs[:3], params, inputs[3], backend="reference")
    assert torch.equal(result.tokens, expected.tokens)


@needs_cuda
def test_cuda_graph_capture():
    params = MODES["t0.7"]
    logits, tokens, q, uniforms = make_inputs(4, 3, 32000, torch.bfloat16, params, "from_q", 6)
    verify(logits, tokens, q, params, uniforms, backend="triton")  # compile
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        verify(logits, tokens, q, params, uniforms, backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = verify(logits, tokens, q, params, uniforms, backend="triton")
    for seed in range(3):
        uniforms.copy_(torch.rand(uniforms.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        expected = verify(logits, tokens, q, params, uniforms, backend="reference")
        assert torch.equal(out.tokens, expected.tokens)
        assert torch.equal(out.num_accepted, expected.num_accepted)
