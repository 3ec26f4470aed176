"""Drafters made from the target (``feature:DIR``, ``shallow:DIR``, SPEC.md §11) in a running
batch (SPEC.md §12): a row that joins gets, in the drafter's own cache, what ``generate``'s
prefill would have given it (``prefill_row``), so its output is ``generate``'s token for token,
its drafts are accepted as often as in ``generate``, and sampled rows keep the target's law."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import noisy_copy, tiny_model

from flashspec import (
    FeatureDrafter,
    FeatureHead,
    ShallowDrafter,
    ShallowHead,
    SpeculativeEngine,
)
from flashspec.drafters.checkpoint import save_drafter

ARCHS = ("llama", "qwen2", "mistral")
PROMPTS = [[(7 * i + 3 * j) % 128 for j in range(1 + 4 * i)] for i in range(6)]  # 1 … 21 tokens
BUDGETS = [17, 9, 24, 13, 20, 11]
NOISE = {"feature": 0.03, "shallow": 0.3}  # copies of the target accepted about half the time


def _one_layer(arch: str, seed: int = 5):
    """A tiny target of one decoder layer (its first), so that a feature drafter can equal it."""
    model = tiny_model(arch, seed=seed)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = model.config.layer_types[:1]
    return model


def _shallow_copy(model, noise: float = 0.0) -> ShallowHead:
    """A shallow head over the target's first layer whose adapter is the target's second layer
    (``noise``: plus gaussian noise) and whose MLP is zero: with no noise the drafter *is* the
    target, and a greedy draft is rejected only where the adapter's cache is wrong."""
    head = ShallowHead(model.config, 1, 1)
    layer = noisy_copy(model, noise, seed=1).model.layers[1] if noise else model.model.layers[1]
    head.layers[0].load_state_dict(layer.state_dict())
    return head


def _feature_copy(model, noise: float = 0.0) -> FeatureHead:
    """A feature head over a one-layer target whose layer is the target's and whose input is
    ``fc([f; e]) = e + noise · R f`` (``R`` random): with no noise the drafter *is* the target
    (the features are read and weighted by zero), and a greedy draft is rejected only where its
    cache is wrong; with noise it reads the target's features and is often, not always, right."""
    head = FeatureHead(model.config, 1)
    head.layers[0].load_state_dict(model.model.layers[0].state_dict())
    hidden = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.bias.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        if noise:
            mix = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(2)) / hidden**0.5
            head.fc.weight[:, :hidden] = noise * mix
    return head


def _engine(kind: str, arch: str, folder, noise: float | None, **options):
    """The engine of a target of ``arch`` and a drafter of ``kind``: ``noise=None``, an untrained
    (seeded) head over a two-layer target; else a copy of the target (one layer for ``feature``)
    with that much noise."""
    model = _one_layer(arch) if kind == "feature" and noise is not None else tiny_model(arch, seed=5)
    torch.manual_seed(3)
    if noise is None:
        head = FeatureHead(model.config, 1) if kind == "feature" else ShallowHead(model.config, 1, 1)
    else:
        head = _feature_copy(model, noise) if kind == "feature" else _shallow_copy(model, noise)
    save_drafter(head, model, folder, storage="same")
    return SpeculativeEngine(model, [f"{kind}:{folder}"], device="cpu", **options)


def _run_batch(engine, prompts, budgets, *, slots=3, gamma=4, cancel=(), warm=(1, 5), pad=None, setup=None,
               **sampling):
    """Rows join every other step (into slots others left), some are cancelled early; returns
    each prompt's tokens and its per-step token counts (the first count without the prefill's).
    ``warm``, ``pad``: the batch's warm-up lengths and whether joins are padded to them;
    ``setup(batch)``: called before the warm-up."""
    got, counts, names = {}, {}, {}
    pending, step = list(range(len(prompts))), 0
    with engine.batch(slots=slots, max_length=64, num_draft_tokens=gamma, eos_token_id=[]) as batch:
        if setup is not None:
            setup(batch)
        batch.warmup(list(warm), pad=pad)
        if pad:
            assert batch._run.prefill_width(5) == min(w for w in warm if w >= 5)
        while pending or batch.running:
            if pending and batch.free_slots and step % 2 == 0:
                i = pending.pop(0)
                h = batch.add(prompts[i], max_new_tokens=budgets[i], **sampling)
                names[h], got[i], counts[i] = i, [], []
            for u in batch.step():
                i = names[u.handle]
                counts[i].append(len(u.tokens) - (not got[i]))
                got[i] += u.tokens
                if i in cancel and len(got[i]) >= 5 and not u.finished:
                    batch.cancel(u.handle)
            step += 1
    return got, counts


def _generate(engine, prompt, n, gamma):
    out = engine.generate([prompt], max_new_tokens=n, num_draft_tokens=gamma, eos_token_id=[])
    return out.sequences[0], [r.committed for r in out.stats.step_log]


# ----------------------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind, noise", [("feature", None), ("feature", NOISE["feature"]), ("shallow", NOISE["shallow"])])
def test_rows_joining_and_leaving_equal_generate(kind, noise, arch, gamma, tmp_path):
    """Rows of different lengths join a running batch at different steps, into slots that other
    rows left; some leave early. Every row is token for token its own ``generate`` (float32)."""
    engine = _engine(kind, arch, tmp_path, noise)
    expected = [_generate(engine, p, n, gamma)[0] for p, n in zip(PROMPTS, BUDGETS)]
    got, _ = _run_batch(engine, PROMPTS, BUDGETS, gamma=gamma, cancel={1, 4})
    for i in range(len(PROMPTS)):
        if i in (1, 4):  # cancelled: what it had is a prefix of its output
            assert got[i] == expected[i][: len(got[i])] and 5 <= len(got[i]) < BUDGETS[i]
        else:
            assert got[i] == expected[i], f"row {i} (prompt of {len(PROMPTS[i])} tokens) differs"
    assert engine.generate([PROMPTS[2]], max_new_tokens=6, num_draft_tokens=gamma,
                           eos_token_id=[]).sequences[0] == expected[2][:6]  # generate works again after it


def test_shallow_drafter_with_verify_reuse_in_a_batch_equals_generate(tmp_path):
    """``reuse_shallow=True`` (SPEC.md §11) in a batch: the verify reuses the states of each row's
    drafts; every row still equals its own ``generate``."""
    engine = _engine("shallow", "qwen2", tmp_path, NOISE["shallow"], reuse_shallow=True)
    expected = [_generate(engine, p, n, 3)[0] for p, n in zip(PROMPTS, BUDGETS)]
    got, counts = _run_batch(engine, PROMPTS, BUDGETS, gamma=3)
    assert [got[i] for i in range(len(PROMPTS))] == expected
    assert any(c > 1 for row in counts.values() for c in row)  # drafts were accepted (states reused)


@pytest.mark.parametrize("kind", ["feature", "shallow", "model"])
def test_padded_joins_equal_generate_and_gain_what_generate_gains(kind, tmp_path):
    """Joins fed at warmed widths (SPEC.md §12, "Prefill widths"): each prompt padded with zeros
    to the narrowest warmed length that holds it, the target's prefill and every drafter's
    ``prefill_row`` over the padded width. Every greedy row equals its own ``generate``, and a
    drafter equal to the target still gains γ + 1 tokens at every step: the padding's cache
    entries never reach a real position."""
    if kind == "model":
        target = tiny_model("llama", seed=5)
        engine = SpeculativeEngine(target, [noisy_copy(target, 0.0, seed=1)], device="cpu")
    else:
        engine = _engine(kind, "llama", tmp_path, 0.0)
    gamma = 3
    alone = [_generate(engine, p, n, gamma) for p, n in zip(PROMPTS, BUDGETS)]
    got, counts = _run_batch(engine, PROMPTS, BUDGETS, gamma=gamma, warm=(2, 8, 16, 32), pad=True)
    assert [got[i] for i in range(len(PROMPTS))] == [tokens for tokens, _ in alone]
    assert [counts[i] for i in range(len(PROMPTS))] == [steps for _, steps in alone]
    assert alone[0][1] == _full_steps(BUDGETS[0], gamma)


def test_pad_is_checked():
    engine = SpeculativeEngine(tiny_model("llama"), [], device="cpu")
    with engine.batch(slots=1, max_length=32) as batch, pytest.raises(ValueError, match="pad must be"):
        batch.warmup([4], pad="yes")


# ----------------------------------------------------------------------------- acceptance
def _full_steps(budget: int, gamma: int) -> list[int]:
    """Tokens per step when every draft is accepted (the first token comes from the prefill)."""
    left = budget - 1
    return [min(gamma + 1, left - (gamma + 1) * s) for s in range(-(-left // (gamma + 1)))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["feature", "shallow"])
@pytest.mark.parametrize("noisy", [False, True])
def test_a_joining_row_accepts_its_drafts_as_in_generate(kind, arch, noisy, tmp_path):
    """A drafter equal to the target (the target's own layers, ``noise = 0``) drafts its greedy
    tokens exactly when its cache holds the target's entries: every row that joins the batch
    gains γ + 1 tokens per step, as in ``generate``. With noise, each row gains at each step what
    it gains at that step of its own ``generate``: its drafts are a function of its committed
    tokens alone, as SPEC.md §11's catch-up promises."""
    engine = _engine(kind, arch, tmp_path, NOISE[kind] if noisy else 0.0)
    gamma = 3
    alone = [_generate(engine, p, n, gamma)[1] for p, n in zip(PROMPTS, BUDGETS)]
    if not noisy:
        assert alone == [_full_steps(n, gamma) for n in BUDGETS]  # every draft accepted in generate
    else:
        assert alone != [_full_steps(n, gamma) for n in BUDGETS] and any(max(c) > 1 for c in alone)
    _, counts = _run_batch(engine, PROMPTS, BUDGETS, gamma=gamma)
    assert [counts[i] for i in range(len(PROMPTS))] == alone


@pytest.mark.parametrize("kind, cls", [("feature", FeatureDrafter), ("shallow", ShallowDrafter)])
def test_the_acceptance_test_has_power(kind, cls, tmp_path, monkeypatch):
    """The test above fails when a joining row's drafter cache is left as it was."""
    engine = _engine(kind, "llama", tmp_path, 0.0)
    monkeypatch.setattr(cls, "prefill_row", lambda self, history, row: None)
    _, counts = _run_batch(engine, PROMPTS, BUDGETS, gamma=3)
    assert sum(map(len, counts.values())) > sum(len(_full_steps(n, 3)) for n in BUDGETS) + 5  # drafts rejected


# ----------------------------------------------------------------------------- the law
@pytest.mark.parametrize("pad", [False, True])
def test_sampled_rows_with_a_feature_drafter_in_a_batch_have_the_targets_law(pad):
    """χ² (SPEC.md §6) of rows that join a running batch with a feature drafter (p != q), sampled
    drafts verified with their q (every row has the same parameters), γ = 2; ``pad``: every join
    fed at a wider warmed width (SPEC.md §12, "Prefill widths")."""
    from test_distribution import (
        ALPHA,
        BATCH_SAMPLES,
        FEATURE,
        PROMPT,
        TARGET,
        chi_square_pvalue,
        exact_law,
    )

    engine = SpeculativeEngine(TARGET, [f"feature:{FEATURE}"], device="cpu")
    samples = []
    torch.manual_seed(0)
    with engine.batch(slots=24, max_length=32, num_draft_tokens=2, eos_token_id=[]) as batch:
        if pad:
            batch.warmup([len(PROMPT) + 5], pad=True)
            assert batch._run.prefill_width(len(PROMPT)) == len(PROMPT) + 5
        tokens: dict[int, list[int]] = {}
        while len(samples) < BATCH_SAMPLES:
            for _ in range(batch.free_slots):
                tokens[batch.add(PROMPT, max_new_tokens=3, do_sample=True, temperature=0.8, top_k=5, top_p=0.9)] = []
            for update in batch.step():
                tokens[update.handle].extend(update.tokens)
                if update.finished:
                    samples.append(tokens.pop(update.handle))
    samples = np.array(samples[:BATCH_SAMPLES])
    assert samples.shape == (BATCH_SAMPLES, 3)
    assert 0.0 < batch.stats.acceptance_rate < 1.0  # both the accept and the reject paths ran
    pvalue = chi_square_pvalue(samples, exact_law(0.8, 5, 0.9))
    assert pvalue > ALPHA, f"χ² p-value {pvalue:.2e}: a batched row's law differs from the target's"


@pytest.mark.parametrize("gamma", [1, 2])
def test_sampled_rows_beside_greedy_rows_have_the_targets_law(gamma):
    """χ² (SPEC.md §6, §12) with two parameter sets in the batch: sampled rows (T = 0.8, top-k,
    top-p) share it with greedy rows, so every row is verified with both sets and keeps its own
    set's result (the masks), and drafts are greedy (one-hot q != p). The sampled rows keep the
    target's law; every greedy row is the target's greedy continuation."""
    from test_distribution import ALPHA, BATCH_SAMPLES, FEATURE, PROMPT, TARGET, chi_square_pvalue, exact_law

    engine = SpeculativeEngine(TARGET, [f"feature:{FEATURE}"], device="cpu")
    greedy = engine.generate([PROMPT], max_new_tokens=3, eos_token_id=[]).sequences[0]
    samples, greedy_rows = [], []
    torch.manual_seed(0)
    with engine.batch(slots=24, max_length=32, num_draft_tokens=gamma, eos_token_id=[]) as batch:
        tokens: dict[int, list[int]] = {}
        sampled: set[int] = set()
        turn = 0
        while len(samples) < BATCH_SAMPLES:
            for _ in range(batch.free_slots):
                turn += 1
                if turn % 2:
                    h = batch.add(PROMPT, max_new_tokens=3, do_sample=True, temperature=0.8, top_k=5, top_p=0.9)
                    sampled.add(h)
                else:
                    h = batch.add(PROMPT, max_new_tokens=3)
                tokens[h] = []
            assert len(batch._run.param_sets) == 2
            for update in batch.step():
                tokens[update.handle].extend(update.tokens)
                if update.finished:
                    (samples if update.handle in sampled else greedy_rows).append(tokens.pop(update.handle))
    assert greedy_rows and all(row == greedy for row in greedy_rows)
    samples = np.array(samples[:BATCH_SAMPLES])
    assert 0.0 < batch.stats.acceptance_rate < 1.0
    pvalue = chi_square_pvalue(samples, exact_law(0.8, 5, 0.9))
    assert pvalue > ALPHA, f"χ² p-value {pvalue:.2e}: a sampled row beside greedy rows lost the target's law"


# ----------------------------------------------------------------------------- join widths
class _Keys:
    """CUDA graphs on the CPU, for the joins: every key a capture; every run runs the function."""

    enabled = True

    def __init__(self) -> None:
        self.keys: set = set()

    def __contains__(self, key) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def run(self, key, fn, warm=False):
        if key is not None:
            self.keys.add(key)
        result = fn()
        if warm:
            fn()
        return result

    def reading(self, *inputs) -> None:
        """What the graphs read (no graph here to drop)."""

    def run_widths(self, widths, width, key, fn, repeatable=False):
        return fn(width)

    def clear(self) -> None:
        self.keys.clear()


SAMPLED = dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=3)


@pytest.mark.parametrize("slots, gamma, sampling", [(2, 3, {}), (1, 1, {}), (2, 3, SAMPLED), (1, 1, SAMPLED)])
def test_a_model_drafters_join_is_fed_at_a_captured_width_when_the_prompt_fills_one(slots, gamma, sampling):
    """SPEC.md §12, "Joins are graphs too": a model drafter's join feeds the prompt and its first
    token — one position more than the target's join — padded to the narrowest width it captured
    a join at, so that a prompt exactly as long as a captured width (16, 32) replays a graph
    rather than running eagerly (on the H200 a 16-token join took 19.9 ms instead of 8.0). The
    padding changes no token: greedy rows equal ``generate`` (drafter == target), and seeded
    sampled rows (T = 0.7, top-k and top-p on, a drafter ≠ the target) equal those of the same
    batch whose drafter joins unpadded."""
    target = tiny_model("llama", seed=5)
    prompts = [[(5 * i + j) % 100 + 1 for j in range(n)] for i, n in enumerate((16, 32, 5, 17, 15, 31))]
    budgets = [6, 5, 7, 6, 4, 6]
    runs = []
    for padded in (True, False):
        engine = SpeculativeEngine(target, [noisy_copy(target, 0.1 if sampling else 0.0, seed=1)], device="cpu",
                                   selector="fixed")
        drafter = engine.drafters[0]
        fed, feed = [], drafter._feed_row
        drafter._feed_row = lambda history, row, width, fed=fed, feed=feed: fed.append(width) or feed(history, row, width)

        def setup(batch, drafter=drafter, padded=padded, fed=fed):
            batch._run.join_graphs = _Keys()  # the target's joins padded alike in both runs
            if padded:  # the drafter's joins captured (on the CPU: stand-ins), so padded to their widths
                drafter._graphs = _Keys()
            batch.warmup = lambda lengths, pad, warmup=batch.warmup: (warmup(lengths, pad=pad), fed.clear())[0]

        got, _ = _run_batch(engine, prompts, budgets, slots=slots, gamma=gamma, warm=(16, 32, 64), pad=True,
                            setup=setup, **sampling)
        runs.append(([got[i] for i in range(len(prompts))], fed, drafter._join_widths))
    (padded, fed_padded, widths), (plain, fed_plain, no_widths) = runs
    assert widths == (16, 32, 64) and no_widths == ()
    # prompt + first token: 17 → 32 and 33 → 64, fed eagerly at 17 and 33 unpadded; 6 → 16, 18 → 32, ...
    assert fed_padded == [32, 64, 16, 32, 16, 32] and fed_plain == [17, 33, 16, 32, 16, 32]
    assert padded == plain
    if not sampling:
        assert padded == [_generate(SpeculativeEngine(target, [], device="cpu"), p, n, gamma)[0]
                          for p, n in zip(prompts, budgets)]
