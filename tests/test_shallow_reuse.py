"""Verify reuse of a shallow drafter's states (SPEC.md §11, ``reuse_shallow=True``): the target's
verify forward starts from the states after ``N`` layers that the drafter computed for the pending
token and every draft it fed, and runs the first ``N`` layers for the last draft only.

In float32 the output is token for token the output without reuse, the engine's target-only
output and ``model.generate(do_sample=False)``, on several architectures, γ and ragged batches;
sampling keeps the target's law (χ², the harness of tests/test_distribution.py); the verify really
runs the first layers over fewer rows; bad requests are ``ValueError``s. The tests at the end run
on a CUDA GPU only (graph capture, ``compile=True``, no synchronisation in a step)."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

from flashspec import Draft, FeatureHead, ShallowDrafter, ShallowHead, SpeculativeEngine
from flashspec.drafters.checkpoint import save_drafter

ARCHS = ("llama", "qwen2", "mistral")
PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def checkpoint(model, noise: float | None = None, seed: int = 0) -> str:
    """A shallow drafter for ``model`` (its first layer, then one adapter), saved unquantised:
    ``noise=None`` — untrained (mostly rejected); else the adapter is the target's second layer
    plus Gaussian noise of that size (``0``: the drafter *is* the target, every draft accepted)."""
    torch.manual_seed(seed)
    head = ShallowHead(model.config, 1, 1)
    if noise is not None:
        with torch.no_grad():
            head.layers[0].load_state_dict(model.model.layers[1].state_dict())
            for p in head.layers[0].parameters():
                p.add_(noise * torch.randn_like(p))
    folder = tempfile.mkdtemp(prefix="flashspec-shallow-reuse-")
    save_drafter(head, model, folder, storage="same")
    return folder


@pytest.fixture(scope="module")
def models():
    """Per architecture: the target and three shallow drafters (untrained, noisy, exact)."""
    out = {}
    for arch in ARCHS:
        model = tiny_model(arch, seed=5)
        out[arch] = model, {"untrained": checkpoint(model), "noisy": checkpoint(model, 0.05),
                            "exact": checkpoint(model, 0.0)}
    return out


def target_only(model, prompts, n):
    return SpeculativeEngine(model, [], device="cpu").generate(prompts, max_new_tokens=n, eos_token_id=[]).sequences


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def shallow(model, folder, reuse, **options):
    return SpeculativeEngine(model, [f"shallow:{folder}"], device="cpu", reuse_shallow=reuse, **options)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("kind", ["untrained", "noisy", "exact"])
def test_greedy_with_reuse_is_token_for_token_the_output_without_and_the_targets(models, arch, gamma, kind):
    model, folders = models[arch]
    engines = {reuse: shallow(model, folders[kind], reuse) for reuse in (False, True)}
    assert engines[True].drafters[0].reuse and not engines[False].drafters[0].reuse
    for prompts in (PROMPTS, PROMPTS[2:]):  # a ragged batch, then batch 1
        expected = target_only(model, prompts, 20)
        assert expected == [hf_greedy(model, p, 20) for p in prompts]
        for _ in range(2):  # the second request reuses the buffers
            outs = {r: e.generate(prompts, max_new_tokens=20, num_draft_tokens=gamma, eos_token_id=[])
                    for r, e in engines.items()}
            assert outs[True].sequences == outs[False].sequences == expected
            assert [s.accepted for s in outs[True].stats.step_log] == [s.accepted for s in outs[False].stats.step_log]
    if kind == "exact":  # every committed draft's first-layer cache entries were the drafter's
        assert outs[True].stats.acceptance_rate > 0.95


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(gamma=st.integers(1, 6), batch=st.integers(1, 3), new_tokens=st.integers(1, 24),
       arch=st.sampled_from(ARCHS), kind=st.sampled_from(["noisy", "exact"]), seed=st.integers(0, 3))
def test_greedy_with_reuse_for_any_gamma_batch_and_length(models, gamma, batch, new_tokens, arch, kind, seed):
    model, folders = models[arch]
    prompts = [[(seed + 5 * b + i) % 100 for i in range(1 + 3 * b)] for b in range(batch)]
    out = shallow(model, folders[kind], True).generate(prompts, max_new_tokens=new_tokens, num_draft_tokens=gamma,
                                                       eos_token_id=[])
    assert out.sequences == target_only(model, prompts, new_tokens)


def test_reuse_among_other_arms_under_a_bandit(models):
    """Steps of the shallow drafter reuse its states; steps of the others verify without reuse."""
    model, folders = models["llama"]
    engine = SpeculativeEngine(model, [f"shallow:{folders['noisy']}", "ngram", "early-exit:1"], gammas=[1, 3],
                               selector="ucb1", selector_options={"seed": 0}, device="cpu", reuse_shallow=True)
    for _ in range(2):
        out = engine.generate(PROMPTS, max_new_tokens=30, eos_token_id=[])
        assert out.sequences == target_only(model, PROMPTS, 30)
    assert all(out.stats.per_drafter[d.name].steps > 0 for d in engine.drafters)


def _rows_through(model, engine, prompts, gamma):
    """Token rows each target layer's attention output projection saw during ``generate``
    (prefill excluded), per layer, and the number of verify forwards."""
    seen = {i: [] for i in range(len(model.model.layers))}
    hooks = [layer.self_attn.o_proj.register_forward_hook(
        lambda module, args, out, i=i: seen[i].append(args[0].shape[0] * args[0].shape[1]))
        for i, layer in enumerate(model.model.layers)]
    try:
        out = engine.generate(prompts, max_new_tokens=16, num_draft_tokens=gamma, eos_token_id=[])
    finally:
        for hook in hooks:
            hook.remove()
    verifies = len(seen[1]) - 1  # the last layer runs in the prefill and in each verify only
    return {i: sum(rows[1:]) for i, rows in seen.items()}, verifies, out


@pytest.mark.parametrize("gamma", [1, 3])
def test_the_verify_skips_the_first_layers_for_the_drafted_rows(models, gamma):
    """Per step the first layer runs over ``B·k`` rows in the drafter; without reuse the verify
    runs it again over ``B·(k+1)``, with reuse over the ``B`` rows of the last draft only. The
    later layer runs over ``B·(k+1)`` rows in each verify either way."""
    model, folders = models["llama"]
    prompts = [[1, 2, 3, 4], [7, 8]]
    batch = len(prompts)
    (plain, plain_steps, a), (reused, reused_steps, b) = (
        _rows_through(model, shallow(model, folders["exact"], reuse), prompts, gamma) for reuse in (False, True))
    assert a.sequences == b.sequences and plain_steps == reused_steps > 0
    steps = reused_steps
    assert plain[0] == steps * batch * (2 * gamma + 1)
    assert reused[0] == steps * batch * (gamma + 1)
    assert plain[1] == reused[1] == steps * batch * (gamma + 1)


def _three_layer_llama():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(8)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def test_features_of_fewer_layers_are_still_the_targets_at_committed_positions():
    """Two shallow drafters sharing 2 and 1 of 3 layers: with reuse at the first one's steps the
    verify does not write ``History.hidden[1]`` at the positions it fed, so its own forwards do.
    The buffers at committed positions equal those of the engine without reuse."""
    model = _three_layer_llama()
    folders = []
    for shared in (2, 1):
        torch.manual_seed(shared)
        folder = tempfile.mkdtemp(prefix="flashspec-shallow-reuse-")
        save_drafter(ShallowHead(model.config, shared, 1), model, folder, storage="same")
        folders.append(f"shallow:{folder}")
    prompts = [[5, 6, 7, 5, 6, 7], [1, 2]]
    runs = {}
    for reuse in (False, True):
        engine = SpeculativeEngine(model, folders, device="cpu", reuse_shallow=reuse)  # "fixed": the 2-layer one
        out = engine.generate(prompts, max_new_tokens=20, num_draft_tokens=3, eos_token_id=[])
        ws = engine._buffers
        runs[reuse] = out.sequences, {n: h.clone() for n, h in ws.hidden.items()}, ws.length.clone()
    assert runs[True][0] == runs[False][0] == target_only(model, prompts, 20)
    length = runs[True][2]
    assert torch.equal(length, runs[False][2])
    for n in (1, 2):
        for b in range(len(prompts)):
            committed = slice(0, int(length[b]) - 1)
            torch.testing.assert_close(runs[True][1][n][b, committed], runs[False][1][n][b, committed],
                                       rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the law (χ², SPEC.md §6)
@pytest.mark.parametrize("temperature,top_k,top_p,gamma", [(0.7, 0, 0.85, 1), (1.1, 6, 1.0, 3)])
def test_sampling_with_reuse_has_the_targets_law(temperature, top_k, top_p, gamma):
    from stats_helpers import ALPHA
    from test_distribution import (
        PROMPT,
        SAMPLES,
        SHALLOW,
        TARGET,
        chi_square_pvalue,
        exact_law,
    )

    engine = SpeculativeEngine(TARGET, [f"shallow:{SHALLOW}"], device="cpu", reuse_shallow=True)
    out = engine.generate([PROMPT] * SAMPLES, max_new_tokens=5, do_sample=True, temperature=temperature, top_k=top_k,
                          top_p=top_p, num_draft_tokens=gamma, eos_token_id=[], seed=4321)
    samples = np.array([s[:3] for s in out.sequences])
    pvalue = chi_square_pvalue(samples, exact_law(temperature, top_k, top_p))
    assert pvalue > ALPHA, f"χ² p-value {pvalue:.2e}: output law with verify reuse differs from the target's"
    assert 0.0 < out.stats.acceptance_rate < 1.0  # both the accept and the reject paths ran


# ------------------------------------------------------------------ bad requests
def test_reuse_needs_a_shallow_drafter(models):
    model, folders = models["llama"]
    feature = tempfile.mkdtemp(prefix="flashspec-feature-reuse-")
    save_drafter(FeatureHead(model.config, 1), model, feature)
    for drafters in ([], ["ngram"], ["early-exit:1"], [f"feature:{feature}"], [tiny_model("llama", seed=6)]):
        with pytest.raises(ValueError, match="reuse_shallow=True .* no shallow drafter"):
            SpeculativeEngine(model, drafters, device="cpu", reuse_shallow=True)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="reuse_shallow must be True or False"):
            SpeculativeEngine(model, [f"shallow:{folders['noisy']}"], device="cpu", reuse_shallow=bad)
    engine = shallow(model, folders["noisy"], False)
    with pytest.raises(ValueError, match="reuse must be True or False"):
        ShallowDrafter(engine._target_lm, engine.drafters[0].head, reuse="no")


def test_reuse_refuses_a_tensor_parallel_target(models, monkeypatch):
    import flashspec.engine

    model, folders = models["llama"]
    monkeypatch.setattr(flashspec.engine, "tensor_parallel_of", lambda target: object())
    with pytest.raises(ValueError, match="tensor-parallel"):
        SpeculativeEngine(model, [f"shallow:{folders['noisy']}"], device="cpu", reuse_shallow=True)


def test_states_of_the_wrong_shape_or_layer_are_clear_errors(models):
    model, _ = models["llama"]

    class Handing:
        """A drafter that hands back states (the protocol's optional part) — wrongly."""

        name = "handing"

        def __init__(self, states_shape, layer):
            self.states_shape, self.layer = states_shape, layer

        def begin(self, batch_size):
            pass

        def propose(self, history, num_tokens, params, uniforms):
            tokens = history.tokens.gather(1, (history.length - 1)[:, None]).expand(-1, num_tokens)
            shape = tuple(history.length.shape[0] if s == "B" else num_tokens if s == "k" else s
                          for s in self.states_shape)
            return Draft(tokens, None, torch.zeros(shape), self.layer)

    hidden = model.config.hidden_size
    for states_shape, layer, message in ((("B", "k", hidden + 1), 1, "states of shape"),
                                         (("B", 1, hidden), 1, "states of shape"),
                                         (("B", "k", hidden), 2, "states_layer must be"),
                                         (("B", "k", hidden), 0, "states_layer must be")):
        engine = SpeculativeEngine(model, [Handing(states_shape, layer)], device="cpu")
        with pytest.raises(ValueError, match=message):
            engine.generate(PROMPTS, max_new_tokens=4, num_draft_tokens=2, eos_token_id=[])
    other = tiny_model("gpt2", seed=5)  # no static cache: nothing a drafter could have written
    engine = SpeculativeEngine(other, [Handing(("B", "k", other.config.hidden_size), 1)], device="cpu")
    with pytest.raises(ValueError, match="static cache"):
        engine.generate(PROMPTS, max_new_tokens=4, num_draft_tokens=2, eos_token_id=[])


def test_a_forward_from_a_layer_needs_its_states(models):
    model, folders = models["llama"]
    lm = shallow(model, folders["noisy"], True)._target_lm
    lm.reset(1, 16)
    start = torch.zeros(1, dtype=torch.long)
    states = torch.zeros(1, 1, model.config.hidden_size)
    for bad in (3, 0, -1, 1.0, True):
        with pytest.raises(ValueError, match="first_layer must be"):
            lm.resume(states, start, bad)


# ------------------------------------------------------------------ on a CUDA GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on_cuda(arch: str, dtype: torch.dtype):
    from test_gpu import tiny

    target = tiny(arch, 0, dtype)
    return target, checkpoint(target, 0.02 if dtype == torch.float32 else 0.0)


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("compile", [False, True])
def test_graphs_with_reuse_match_hf_generate_float32(arch, gamma, compile):
    from test_gpu import PROMPTS as GPU_PROMPTS
    from test_gpu import hf_greedy as hf_greedy_cuda

    target, folder = _on_cuda(arch, torch.float32)
    engine = SpeculativeEngine(target, [f"shallow:{folder}"], reuse_shallow=True, compile=compile)
    assert engine._graphs.enabled
    expected = [hf_greedy_cuda(target, p, 24) for p in GPU_PROMPTS]
    for _ in range(2):  # the second call replays the captured graphs
        out = engine.generate(GPU_PROMPTS, max_new_tokens=24, num_draft_tokens=gamma, eos_token_id=[])
        assert out.sequences == expected
    assert out.stats.accepted > 0
    assert any(isinstance(key, tuple) and len(key) == 4 and key[3] == 1 for key in engine._graphs._graphs)


@cuda
@pytest.mark.parametrize("do_sample", [False, True])
def test_steady_state_steps_with_reuse_do_not_synchronise(do_sample):
    from test_gpu import _steps_without_synchronising

    from flashspec.sampling import SamplingParams

    target, folder = _on_cuda("llama", torch.bfloat16)
    engine = SpeculativeEngine(target, [f"shallow:{folder}"], reuse_shallow=True)
    params = SamplingParams(do_sample=do_sample, temperature=0.7 if do_sample else 1.0)
    assert _steps_without_synchronising(engine, params, gamma=4, steps=8).steps == 11


@cuda
def test_bfloat16_reuse_runs_and_mostly_agrees():
    """In bf16 the verify with reuse may round differently from the one without (SPEC.md §11), so
    only near-agreement is asserted; the counts are printed (``pytest -s``)."""
    from test_gpu import PROMPTS as GPU_PROMPTS

    target, folder = _on_cuda("llama", torch.bfloat16)
    outs = [SpeculativeEngine(target, [f"shallow:{folder}"], reuse_shallow=reuse).generate(
        GPU_PROMPTS, max_new_tokens=48, num_draft_tokens=4, eos_token_id=[]) for reuse in (False, True)]
    same = sum(a == b for a, b in zip(outs[0].sequences, outs[1].sequences))
    print(f"bf16: {same} of {len(GPU_PROMPTS)} greedy rows equal with and without reuse; acceptance "
          f"{outs[0].stats.acceptance_rate:.3f} / {outs[1].stats.acceptance_rate:.3f}")
    assert outs[1].stats.acceptance_rate > 0.5
