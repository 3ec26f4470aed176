"""Distribution exactness of the whole engine (SPEC.md §6).

20,000 continuations of one prompt, generated as one batch with a fixed seed, are compared with
the exact law of the target's first three tokens, enumerated over all V^3 continuations of a
tiny random-weight model. The exact law is computed with transformers' own logits warpers, not
with FlashSpec's sampling code, so a bug there cannot hide behind a shared implementation.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stats_helpers import ALPHA, chi2_pvalue

from flashspec import DatastoreDrafter, Draft, History, SamplingParams, SpeculativeEngine
from flashspec.models.graphs import Graphs

V = 8
SAMPLES = 20_000
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so the n-gram drafter finds matches


def tiny_llama(seed: int, hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init, so the laws are far from uniform
        model.lm_head.weight.mul_(8.0)
    return model


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    copy = tiny_llama(0)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return copy


TARGET = tiny_llama(0)


def _feature_checkpoint() -> str:
    """An untrained (seeded) feature drafter for TARGET, saved once: a drafter with p != q that
    reads the target's features (SPEC.md §11)."""
    import tempfile

    from flashspec import FeatureHead
    from flashspec.drafters.checkpoint import save_drafter

    folder = tempfile.mkdtemp(prefix="flashspec-feature-")
    torch.manual_seed(11)
    save_drafter(FeatureHead(TARGET.config, 1), TARGET, folder)
    return folder


def _shallow_checkpoint() -> str:
    """An untrained (seeded) shallow drafter for TARGET: its first layer, then an adapter."""
    import tempfile

    from flashspec import ShallowHead
    from flashspec.drafters.checkpoint import save_drafter

    folder = tempfile.mkdtemp(prefix="flashspec-shallow-")
    torch.manual_seed(12)
    head = ShallowHead(TARGET.config, 1, 1)
    with torch.no_grad():
        head.fc2.weight.normal_(0, 0.5)  # not the zero start: a head that changes the law
    save_drafter(head, TARGET, folder)
    return folder


def _compact_checkpoint() -> str:
    """A compact feature drafter (SPEC.md §11.4): a narrow MLP, 2 query heads, int8 storage and a
    draft vocabulary of 5 of the 8 tokens, so the other 3 come only from the residual."""
    import tempfile

    from flashspec import FeatureHead
    from flashspec.drafters.checkpoint import save_drafter

    folder = tempfile.mkdtemp(prefix="flashspec-compact-")
    torch.manual_seed(13)
    head = FeatureHead(TARGET.config, 1, width=16, heads=2, vocab=torch.tensor([0, 1, 2, 3, 5]))
    save_drafter(head, TARGET, folder)
    return folder


def _fused_checkpoint() -> str:
    """An untrained (seeded) fused-feature drafter for TARGET (SPEC.md §11, "Fused features"): it
    reads both layers' outputs, the last one first (the taps' order is the order fuse reads them)."""
    import tempfile

    from flashspec import FeatureHead
    from flashspec.drafters.checkpoint import save_drafter

    folder = tempfile.mkdtemp(prefix="flashspec-fused-")
    torch.manual_seed(14)
    head = FeatureHead(TARGET.config, 1, taps=(1, 0))
    with torch.no_grad():
        head.fuse.weight.mul_(4.0)  # a fused feature that moves the law
    save_drafter(head, TARGET, folder)
    return folder


FEATURE = _feature_checkpoint()
FUSED = _fused_checkpoint()
COMPACT = _compact_checkpoint()
SHALLOW = _shallow_checkpoint()


def exact_law(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """P(x1, x2, x3) for every continuation, shape [V, V, V], by enumeration."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))  # [V^2, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = TARGET(ids).logits[:, -3:].float()  # laws of x1, x2 | x1, x3 | x1 x2

    def law(z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(warpers(None, z), dim=-1).double()

    p1 = law(logits[:1, 0])[0]  # [V]
    p2 = law(logits[:, 1]).view(V, V, V)[:, 0]  # [x1, x2]; rows for x2-prefixes agree
    p3 = law(logits[:, 2]).view(V, V, V)  # [x1, x2, x3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.numpy()


def chi_square_pvalue(samples: np.ndarray, law: np.ndarray) -> float:
    """Pearson χ² of ``samples [N, 3]`` against ``law [V, V, V]`` (SPEC.md §6)."""
    observed = np.bincount(np.ravel_multi_index(samples.T, law.shape), minlength=law.size)
    return chi2_pvalue(observed, law.ravel())


# On a GPU machine the engine is also tested on CUDA: static cache, CUDA graphs, Triton verify.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def on(device: str, model):
    """``model`` on ``device`` (a copy on CUDA; drafter names and objects pass through)."""
    if device == "cpu" or not isinstance(model, torch.nn.Module):
        return model
    return copy.deepcopy(model).to(device)


def run(drafter, temperature, top_k=0, top_p=1.0, gamma=3, seed=1234, device="cpu") -> np.ndarray:
    # selector="fixed": every step drafts (the default's guard could let a slow drafter run rarely)
    engine = SpeculativeEngine(on(device, TARGET), [on(device, drafter)] if drafter is not None else [],
                               selector="fixed")
    out = engine.generate(
        [PROMPT] * SAMPLES,
        max_new_tokens=5,
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_draft_tokens=gamma,
        eos_token_id=[],
        seed=seed,
    )
    assert all(len(s) == 5 for s in out.sequences)
    return np.array([s[:3] for s in out.sequences]), out.stats


DRAFTERS = {
    "noisy": lambda: noisy_copy(TARGET, noise=1.0, seed=7),  # p != q, often accepted
    "independent": lambda: tiny_llama(99),  # p and q unrelated: many rejections
    "self": lambda: TARGET,  # drafter == target: zero-mass residual
    "ngram": lambda: "ngram",  # deterministic, verified with one-hot q
    # deterministic from a fixed store (seeded random text over the vocabulary): one-hot q
    "store": lambda: DatastoreDrafter(torch.randint(0, TARGET.config.vocab_size, (400,),
                                                    generator=torch.Generator().manual_seed(3))),
    "early-exit": lambda: "early-exit:1",  # the target's first layer, sharing its cache: p != q
    "early-exit-all": lambda: "early-exit:2",  # every layer: p == q up to rounding
    "feature": lambda: f"feature:{FEATURE}",  # reads the target's features: p != q
    "feature-fused": lambda: f"feature:{FUSED}",  # reads several of its layers (EAGLE-3): p != q
    "shallow": lambda: f"shallow:{SHALLOW}",  # the target's first layer and an adapter: p != q
    "compact": lambda: f"feature:{COMPACT}",  # a draft vocabulary: q is 0 on 3 of the 8 tokens
    "none": lambda: None,  # target-only decoding through the same loop
}

CASES = [
    ("noisy", 0.6, 0, 1.0, 3),
    ("noisy", 1.3, 5, 1.0, 1),
    ("noisy", 0.8, 0, 0.8, 3),
    ("noisy", 0.7, 4, 0.9, 2),
    ("independent", 1.0, 0, 1.0, 3),
    ("independent", 0.6, 0, 0.7, 1),
    ("self", 0.6, 0, 1.0, 3),
    ("self", 1.3, 6, 0.9, 1),
    ("ngram", 0.9, 6, 1.0, 3),
    ("ngram", 0.5, 0, 1.0, 1),
    ("store", 0.8, 0, 0.9, 3),
    ("store", 1.3, 5, 1.0, 1),
    ("early-exit", 0.7, 4, 0.9, 1),
    ("early-exit", 1.3, 0, 1.0, 3),
    ("early-exit-all", 0.6, 0, 0.8, 2),
    ("feature", 0.8, 5, 0.9, 1),
    ("feature", 1.2, 0, 1.0, 3),
    ("feature-fused", 0.9, 0, 0.9, 3),
    ("feature-fused", 1.2, 5, 1.0, 1),
    ("shallow", 0.7, 0, 0.85, 1),
    ("shallow", 1.1, 6, 1.0, 3),
    ("compact", 0.8, 0, 0.9, 3),
    ("compact", 1.3, 4, 1.0, 1),
    ("none", 0.7, 0, 0.9, 4),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drafter,temperature,top_k,top_p,gamma", CASES)
def test_engine_samples_the_exact_target_law(drafter, temperature, top_k, top_p, gamma, device):
    samples, run_stats = run(DRAFTERS[drafter](), temperature, top_k, top_p, gamma, device=device)
    pvalue = chi_square_pvalue(samples, exact_law(temperature, top_k, top_p))
    assert pvalue > ALPHA, f"χ² p-value {pvalue:.2e}: output law differs from the target's"
    if drafter in ("self", "early-exit-all"):
        assert run_stats.acceptance_rate > 0.99
    if drafter in ("noisy", "independent", "ngram", "store", "early-exit", "feature", "feature-fused", "shallow"):
        assert 0.0 < run_stats.acceptance_rate < 1.0  # both the accept and the reject paths ran


class _PaddedWidths(Graphs):
    """The widths that CUDA graphs impose, on the CPU: the prefill padded to a graph width and the
    drafters' windows rounded up (past the rows' ends), every call run eagerly (SPEC.md §4, §7)."""

    def __init__(self) -> None:
        super().__init__(enabled=False)
        self.enabled = True

    def run(self, key, fn, warm=False):
        return fn()

    def run_widths(self, widths, width, key, fn, repeatable=False):
        return fn(width)

    def clear(self) -> None:
        pass


@pytest.mark.parametrize("drafter,temperature,top_k,top_p,gamma", [
    ("noisy", 0.8, 5, 1.0, 1), ("noisy", 1.2, 0, 0.9, 3), ("feature", 0.7, 0, 0.85, 3), ("none", 0.6, 4, 1.0, 4)])
def test_the_padded_widths_of_cuda_graphs_keep_the_law(drafter, temperature, top_k, top_p, gamma):
    """The prefill fed at a padded graph width and the drafters' windows at their graph widths
    (SPEC.md §4, §7): samples still follow the target's exact law."""
    made = DRAFTERS[drafter]()
    engine = SpeculativeEngine(TARGET, [made] if made is not None else [], selector="fixed")
    engine._graphs = _PaddedWidths()
    for d in engine.drafters:
        d._graphs = _PaddedWidths()
    out = engine.generate([PROMPT] * SAMPLES, max_new_tokens=5, do_sample=True, temperature=temperature, top_k=top_k,
                          top_p=top_p, num_draft_tokens=gamma, eos_token_id=[], seed=99)
    samples = np.array([s[:3] for s in out.sequences])
    pvalue = chi_square_pvalue(samples, exact_law(temperature, top_k, top_p))
    assert pvalue > ALPHA, f"χ² p-value {pvalue:.2e}: output law differs from the target's"
    if drafter != "none":
        assert 0.0 < out.stats.acceptance_rate < 1.0


def test_power_temperature_ignored_would_fail():
    """The χ² test has power: T = 0.6 samples are rejected against the T = 1 law."""
    samples, _ = run(DRAFTERS["noisy"](), 0.6)
    assert chi_square_pvalue(samples, exact_law(1.0, 0, 1.0)) < ALPHA
    samples, _ = run(DRAFTERS["noisy"](), 1.0, top_k=3)
    assert chi_square_pvalue(samples, exact_law(1.0, 0, 1.0)) < ALPHA


class AdversarialSelector:
    """Causal but adversarial: picks the next (drafter, γ) arm from the previous step's accept
    pattern (and the step count), so drafter and draft length change with what was accepted."""

    def __init__(self, num_arms: int) -> None:
        self.num_arms, self.t, self.last = num_arms, 0, 0

    def select(self) -> int:
        self.t += 1
        if self.t <= self.num_arms:  # every arm once, then as a function of what was accepted
            return self.t - 1
        return (self.last * 3 + self.t) % self.num_arms

    def update(self, arm, observation) -> None:
        self.last = observation.accepted  # the accept count of the step just verified


def test_adversarial_selection_of_drafter_and_gamma_keeps_the_law():
    drafters = [noisy_copy(TARGET, 1.0, 7), "ngram"]
    engine = SpeculativeEngine(TARGET, drafters, gammas=[1, 3], selector=AdversarialSelector(4))
    out = engine.generate(
        [PROMPT] * SAMPLES, max_new_tokens=10, do_sample=True, temperature=0.8,
        eos_token_id=[], seed=5,
    )
    samples = np.array([s[:3] for s in out.sequences])
    assert chi_square_pvalue(samples, exact_law(0.8, 0, 1.0)) > ALPHA
    assert all(s.steps > 0 for s in out.stats.per_arm.values())  # every (drafter, γ) arm ran


@pytest.mark.parametrize("slack", [0.0, 1e9])
def test_target_only_arm_and_guard_keep_the_law(slack):
    """The adversarial selector over two drafting arms and the target-only arm, behind the
    never-slower guard (SPEC.md §8): with slack 0 the guard replaces many of its choices by the
    target-only arm, with a huge slack almost none; the law is the target's either way."""
    engine = SpeculativeEngine(TARGET, [noisy_copy(TARGET, 1.0, 7)], gammas=[1, 3], selector=AdversarialSelector(3),
                               target_only=True, slack=slack)
    out = engine.generate([PROMPT] * SAMPLES, max_new_tokens=10, do_sample=True, temperature=0.8, top_p=0.9,
                          eos_token_id=[], seed=6)
    samples = np.array([s[:3] for s in out.sequences])
    assert chi_square_pvalue(samples, exact_law(0.8, 0, 0.9)) > ALPHA
    assert out.stats.guard_refused >= 1  # the first step is always the target alone's
    assert out.stats.per_arm["target@0"].steps >= 1
    assert slack == 0.0 or out.stats.proposed > 0  # with room to draft, drafts were verified


class ConstantDrafter:
    """A deterministic drafter that always proposes token 0: the worst case for one-hot q."""

    name = "constant"

    def begin(self, batch_size: int) -> None:
        pass

    def propose(self, history: History, num_tokens: int, params: SamplingParams, uniforms) -> Draft:
        return Draft(torch.zeros(history.tokens.shape[0], num_tokens, dtype=torch.long, device=history.tokens.device), None)


def test_custom_deterministic_drafter_keeps_the_law():
    samples, _ = run(ConstantDrafter(), 0.7, top_k=5)
    assert chi_square_pvalue(samples, exact_law(0.7, 5, 1.0)) > ALPHA


# ------------------------------------------------------------------ continuous batching (SPEC.md §12)
BATCH_SAMPLES = 10_000


@pytest.mark.parametrize("gamma", [1, 3])
def test_rows_sharing_a_batch_with_other_parameters_sample_the_exact_law(gamma):
    """A batch whose rows sample with different parameters verifies them in groups and drafts
    greedily (one-hot q, SPEC.md §12): the tested rows (T = 0.7, top-k 5, top-p 0.9, a noisy
    drafter: p != q) still follow the target's law, while greedy and T = 1.3 rows share every step."""
    engine = SpeculativeEngine(TARGET, [noisy_copy(TARGET, noise=1.0, seed=7)], device="cpu",
                               selector="fixed")
    samples, handles = [], set()
    torch.manual_seed(0)
    with engine.batch(slots=24, max_length=32, num_draft_tokens=gamma, eos_token_id=[]) as batch:
        tokens: dict[int, list[int]] = {}
        while len(samples) < BATCH_SAMPLES:
            for i in range(batch.free_slots):
                kind = i % 3
                if kind == 0:  # the rows under test
                    handle = batch.add(PROMPT, max_new_tokens=3, do_sample=True, temperature=0.7, top_k=5, top_p=0.9)
                    handles.add(handle)
                elif kind == 1:
                    handle = batch.add(PROMPT, max_new_tokens=5)  # greedy
                else:
                    handle = batch.add(PROMPT, max_new_tokens=4, do_sample=True, temperature=1.3)
                tokens[handle] = []
            for update in batch.step():
                tokens[update.handle].extend(update.tokens)
                if update.finished and update.handle in handles:
                    samples.append(tokens[update.handle][:3])
    samples = np.array(samples[:BATCH_SAMPLES])
    assert samples.shape == (BATCH_SAMPLES, 3)
    pvalue = chi_square_pvalue(samples, exact_law(0.7, 5, 0.9))
    assert pvalue > ALPHA, f"χ² p-value {pvalue:.2e}: a batched row's law differs from the target's"
