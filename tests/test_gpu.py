"""SPEC.md §7 on a CUDA GPU: the decode loop that never waits on the host.

Skipped without CUDA (CI has none); run on the GPU machine with ``pytest tests/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from flashspec import SpeculativeEngine
from flashspec.models.static import StaticLM
from flashspec.decode.loop import _Run
from flashspec.decode.request import Request
from flashspec.stats import DrafterStats, GenerationStats
from flashspec.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny(arch: str, seed: int, dtype: torch.dtype = torch.float32, vocab: int = 96):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch](**common)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def feature_checkpoint(target) -> str:
    """An untrained (seeded) feature drafter for ``target``, saved (SPEC.md §11)."""
    import tempfile

    from flashspec import FeatureHead
    from flashspec.drafters.checkpoint import save_drafter

    folder = tempfile.mkdtemp(prefix="flashspec-feature-gpu-")
    torch.manual_seed(3)
    save_drafter(FeatureHead(target.config, 1), target, folder)
    return folder


def compact_checkpoint(target) -> str:
    """A compact feature drafter (SPEC.md §11.4): narrow MLP, 2 query heads, a draft vocabulary of
    every third token, int8 storage."""
    import tempfile

    from flashspec import FeatureHead
    from flashspec.drafters.checkpoint import save_drafter

    folder = tempfile.mkdtemp(prefix="flashspec-compact-gpu-")
    torch.manual_seed(5)
    vocab = torch.arange(0, target.config.vocab_size, 3)
    save_drafter(FeatureHead(target.config, 1, width=48, heads=2, vocab=vocab), target, folder)
    return folder


def shallow_checkpoint(target) -> str:
    """An untrained (seeded) shallow drafter for ``target``: its first layer, then an adapter."""
    import tempfile

    from flashspec import ShallowHead
    from flashspec.drafters.checkpoint import save_drafter

    folder = tempfile.mkdtemp(prefix="flashspec-shallow-gpu-")
    torch.manual_seed(4)
    save_drafter(ShallowHead(target.config, 1, 1), target, folder)
    return folder


def drafters_for(drafter: str, target, dtype=torch.float32) -> list:
    arch = target.config.model_type
    return {"model": lambda: [tiny(arch, 1, dtype)], "ngram": lambda: ["ngram"], "none": lambda: [],
            "early-exit": lambda: ["early-exit:1"], "early-exit-all": lambda: ["early-exit:2"],
            "feature": lambda: [f"feature:{feature_checkpoint(target)}"],
            "shallow": lambda: [f"shallow:{shallow_checkpoint(target)}"],
            "compact": lambda: [f"feature:{compact_checkpoint(target)}"]}[drafter]()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("drafter", ["model", "ngram", "early-exit", "early-exit-all", "feature", "shallow", "compact",
                                     "none"])
def test_graphs_greedy_matches_hf_generate_float32(arch, gamma, drafter):
    target = tiny(arch, 0)
    drafters = drafters_for(drafter, target)
    engine = SpeculativeEngine(target, drafters)
    assert isinstance(engine._target_lm, StaticLM) and engine._graphs.enabled
    out = engine.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=gamma, eos_token_id=[])
    expected = [hf_greedy(target, p, 24) for p in PROMPTS]
    assert out.sequences == expected
    again = engine.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=gamma, eos_token_id=[])  # replays
    assert again.sequences == expected
    assert len(engine._graphs) >= 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("drafter", ["feature", "compact"])
def test_compiled_feature_proposals_in_graphs_match_hf_generate_float32(arch, drafter):
    """compile=True compiles a feature drafter's window feed and one-token steps (SPEC.md §11.5);
    captured in graphs, the output is still the target's, at γ = 1 and 4, replays included."""
    target = tiny(arch, 0)
    engine = SpeculativeEngine(target, drafters_for(drafter, target), compile=True)
    assert engine.drafters[0].compiled
    expected = [hf_greedy(target, p, 24) for p in PROMPTS]
    for gamma in (1, 4, 4):
        assert engine.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=gamma, eos_token_id=[]).sequences == expected


@pytest.mark.parametrize("drafter", ["model", "feature", "ngram"])
@pytest.mark.parametrize("gamma,size", [(4, 1), (5, 2), (4, 4)])
def test_chunked_drafting_on_cuda_matches_hf_generate_float32(drafter, gamma, size):
    """SPEC.md §2, "Chunked drafting", on CUDA: chunks drafted on a side stream while the target
    scores the chunk before on the current one, every chunk run (no read of the device); greedy
    output equals ``model.generate`` (float32), at batch 3 and 12, twice over."""
    target = tiny("llama", 0)
    engine = SpeculativeEngine(target, drafters_for(drafter, target), block_size=size, warmup=False)
    expected = [hf_greedy(target, p, 24) for p in PROMPTS]
    for prompts in (PROMPTS, PROMPTS * 4, PROMPTS):
        out = engine.generate(prompts, max_new_tokens=24, num_draft_tokens=gamma, eos_token_id=[])
        assert out.sequences == expected * (len(prompts) // len(PROMPTS))


def test_warmed_graphs_replay_once_right_after_capture():
    """Graphs.run(warm=True) replays a new graph once after capturing it (its first replay costs
    more than later ones, SPEC.md §7), and run_widths warms every other width, the asked one
    only when repeatable: counted on a tensor each run adds one to."""
    from flashspec.models.graphs import Graphs

    graphs, x = Graphs(enabled=True), torch.zeros(8, device="cuda")
    graphs.run("cold", lambda: x[0:1].add_(1))
    graphs.run("warm", lambda: x[1:2].add_(1), warm=True)
    graphs.run_widths([2, 4, 8], 4, ("k",), lambda w: x[2:3].add_(w))
    graphs.run_widths([2, 4, 8], 4, ("r",), lambda w: x[3:4].add_(w), repeatable=True)
    torch.cuda.synchronize()
    # eager run (+1); capture records only; warm replay (+1); other widths eager + warm replay
    assert x[:4].tolist() == [1, 2, 2 * 2 + 8 * 2 + 4, 2 * 2 + 8 * 2 + 4 * 2]
    graphs.run("cold", lambda: x[0:1].add_(1))
    torch.cuda.synchronize()
    assert x[0].item() == 2  # later calls replay once each, warmed or not


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_graph_prefills_match_hf_generate_float32(arch):
    """SPEC.md §7, "The prefill is a graph too": prompts of many lengths, alone and batched, fed at
    padded widths and replayed from graphs that the first prefill of a workspace captured at
    every width: the greedy output is still model.generate's."""
    from flashspec.models.graphs import window_widths

    target = tiny(arch, 0)
    engine = SpeculativeEngine(target, [tiny(arch, 1)], compile=True)
    prompts = [[(7 * i) % 90 + 1 for i in range(n)] for n in (3, 16, 17, 40, 100)]
    for prompt in prompts:
        assert engine.generate([prompt], max_new_tokens=12, eos_token_id=[]).sequences == [hf_greedy(target, prompt, 12)]
    batch = engine.generate(prompts[:3], max_new_tokens=12, eos_token_id=[]).sequences
    assert batch == [hf_greedy(target, p, 12) for p in prompts[:3]]
    capacity = engine._buffers.tokens.shape[1]
    prefills = {key[0] for key in engine._graphs._graphs if isinstance(key, tuple) and key[1:] == ("prefill",)}
    assert prefills == set(window_widths(capacity, 16))


def test_prefills_of_many_rows_run_eagerly_and_still_match_hf_generate():
    """SPEC.md §7: more than PREFILL_GRAPH_ROWS rows prefill eagerly (every width's graph would keep
    its activations); the output is unchanged."""
    from flashspec.decode.loop import PREFILL_GRAPH_ROWS

    target = tiny("qwen2", 0)
    engine = SpeculativeEngine(target, ["ngram"], warmup=False)
    prompts = [[(5 * i + r) % 90 + 1 for i in range(3 + 4 * r)] for r in range(PREFILL_GRAPH_ROWS + 1)]
    out = engine.generate(prompts, max_new_tokens=6, eos_token_id=[]).sequences
    assert out == [hf_greedy(target, p, 6) for p in prompts]
    assert not any(isinstance(key, tuple) and key[1:] == ("prefill",) for key in engine._graphs._graphs)


def test_tree_decoding_on_cuda_equals_generate():
    """SPEC.md §7, "Draft trees in the decode loop", on CUDA: n-gram and a model drafter's chains in
    one tree per step, scored by the tree forward over the static cache; greedy output equals
    ``model.generate`` (float32), ragged rows included."""
    target, other = tiny("qwen2", 0), tiny("qwen2", 1)
    engine = SpeculativeEngine(target, ["ngram", other, target], warmup=False)
    prompts = [[(7 * i + r) % 90 + 1 for i in range(4 + 5 * r)] for r in range(3)]
    out = engine.generate_tree(prompts, gammas=[3, 2, 4], max_new_tokens=12, eos_token_id=[])
    assert out.sequences == [hf_greedy(target, p, 12) for p in prompts]
    assert out.stats.per_drafter[engine.drafters[2].name].accepted > 0  # the target as its own drafter


def _tree_calls(engine, capture: bool = True) -> list:
    """Every tree step ``engine`` runs from now on, as ``(key, whether its graph was captured before)``;
    ``capture=False``: its tree steps run eagerly (keyed None), its other graphs as before."""
    calls, graphs, run = [], engine._graphs, engine._graphs.run

    def recording(key, fn, warm=False):
        if isinstance(key, tuple) and key[:1] == ("tree",):
            calls.append((key, key in graphs))
            key = key if capture else None
        return run(key, fn, warm)

    graphs.run = recording
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_steps_replayed_from_graphs_equal_eager_ones(arch, dtype):
    """SPEC.md §7, "Tree steps are graphs too": drafters [n-gram, a model, the target itself], a ragged
    batch of 3 (4 rows) and one row, draft lengths (3, 2, 4) and (1, 1, 1) (12 and 3 node slots) and
    ``"auto"``, each called twice on one engine: the tokens equal those of the same engine whose tree
    steps run eagerly (its prefill and proposals replayed as here: the comparison holds in bfloat16 too)
    and, in float32, those with every graph off and ``model.generate``'s. The first step of a new layout
    captures its graph and is cold; the second call of fixed lengths only replays (several steps of one
    key); seeded sampling (laws in the tree) gives the tokens of the eager tree steps too."""
    target, other = tiny(arch, 0, dtype), tiny(arch, 1, dtype)
    graphed, eager, plain = (SpeculativeEngine(target, ["ngram", other, target], warmup=False) for _ in range(3))
    assert graphed._graphs.enabled
    calls = _tree_calls(graphed)
    _tree_calls(eager, capture=False)
    plain._graphs.enabled = False
    ragged = [[(7 * i + r) % 90 + 1 for i in range(4 + 5 * r)] for r in range(3)]
    kwargs = dict(max_new_tokens=20, eos_token_id=[])
    for prompts in (ragged, ragged[1:2]):
        for gammas in ([3, 2, 4], [1, 1, 1], "auto"):
            first = graphed.generate_tree(prompts, gammas=gammas, **kwargs)
            since = len(calls)
            again = graphed.generate_tree(prompts, gammas=gammas, **kwargs)
            alone = eager.generate_tree(prompts, gammas=gammas, **kwargs).sequences
            if gammas != "auto":  # a budget may choose other lengths at each call (each one exact)
                assert first.sequences == again.sequences == alone, gammas
                assert first.stats.step_log[0].cold and first.stats.cold_steps >= 1  # a new layout: captured
                assert len(calls) - since >= 3 and all(replayed for _, replayed in calls[since:])
            if dtype == torch.float32:
                assert first.sequences == [hf_greedy(target, p, 20) for p in prompts], gammas
                assert first.sequences == plain.generate_tree(prompts, gammas=gammas, **kwargs).sequences, gammas
    nodes = {sum(layout.nodes for layout in key[1]) for key, replayed in calls if replayed}
    assert {3, 9} <= nodes  # (1, 1, 1) and (3, 2, 4) replayed
    sampled = dict(kwargs, gammas=[3, 2, 4], do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    a, b = (graphed.generate_tree(ragged, **sampled).sequences for _ in range(2))
    assert a == b == eager.generate_tree(ragged, **sampled).sequences
    assert any(layout.laws for key, replayed in calls if replayed for layout in key[1])


def test_expanded_tree_steps_replayed_from_graphs_equal_generate():
    """A feature head's top-k expansion (its nodes' parents and depths staged for the graph, the
    target's features written inside it) beside n-gram, from graph replays: greedy output equals
    ``model.generate`` (float32), a ragged batch and one row, fixed depths and ``"auto"``."""
    target = tiny("llama", 0)
    engine = SpeculativeEngine(target, [f"feature:{feature_checkpoint(target)}", "ngram"], warmup=False)
    calls = _tree_calls(engine)
    expand = {engine.drafters[0].name: (3, 6)}
    for prompts in (PROMPTS, PROMPTS[:1]):
        expected = [hf_greedy(target, p, 16) for p in prompts]
        for gammas in ([3, 2], [2, 2], "auto"):
            for _ in range(2):
                out = engine.generate_tree(prompts, gammas=gammas, expand=expand, max_new_tokens=16, eos_token_id=[])
                assert out.sequences == expected, gammas
    assert any(replayed and key[1][0].expanded for key, replayed in calls)


@pytest.mark.parametrize("drafter", ["feature", "compact"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(do_sample=True, temperature=0.7, top_p=0.9)])
def test_compiled_steps_do_not_synchronise(drafter, params):
    """With compile=True (compiled target, feature proposals, staging and bookkeeping), a
    steady-state step still issues no device-to-host synchronisation."""
    target = tiny("llama", 0, torch.bfloat16)
    engine = SpeculativeEngine(target, drafters_for(drafter, target, torch.bfloat16), compile=True)
    assert _steps_without_synchronising(engine, params, gamma=4, steps=8).steps == 11


@pytest.mark.parametrize("drafter", ["model", "ngram", "feature"])
def test_a_compiled_batch_on_cuda_equals_generate_and_compiles_nothing_after_its_warm_up(drafter):
    """Continuous batching on CUDA with compile=True (SPEC.md §12; the server's path): after the
    warm-up, requests of new prompt lengths (short ones the compiled forward would have taken,
    long ones) join and leave a running batch, each equals ``model.generate`` (float32, greedy),
    and nothing more is compiled (SPEC.md §12: no request pays for compilation)."""
    from torch._dynamo.utils import counters

    target = tiny("llama", 0)
    engine = SpeculativeEngine(target, drafters_for(drafter, target), compile=True)
    prompts = [[(5 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((3, 7, 13, 16, 29, 61))]
    with engine.batch(slots=3, max_length=128) as batch:
        batch.warmup(range(1, 17))
        graphs = counters["stats"]["unique_graphs"]
        got, names, pending = {}, {}, list(range(len(prompts)))
        while pending or batch.running:
            if pending and batch.free_slots:
                i = pending.pop(0)
                handle = batch.add(prompts[i], max_new_tokens=12)
                names[handle], got[handle] = i, []
            for update in batch.step():
                got[update.handle] += update.tokens
        assert counters["stats"]["unique_graphs"] == graphs
    for handle, i in names.items():
        assert got[handle] == hf_greedy(target, prompts[i], 12), i


@pytest.mark.parametrize("drafter", ["model", "ngram", "feature"])
def test_joins_replay_graphs_captured_at_warm_up_and_equal_generate(drafter):
    """SPEC.md §12, "Joins are graphs too": after the warm-up, joins are padded to the prefill
    widths 16, 32, 64, 128 (a cache of 128), the target's join and a model drafter's are captured
    for every slot at every width, prompts of new lengths (1 … 100) joining every slot replay
    them and capture nothing more, and each request equals ``model.generate`` (float32, greedy)."""
    from flashspec.drafters import ModelDrafter
    from flashspec.models.graphs import window_widths

    target = tiny("llama", 0)
    engine = SpeculativeEngine(target, drafters_for(drafter, target))
    prompts = [[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((1, 5, 16, 17, 40, 100, 3, 64))]
    models = [d for d in engine.drafters if isinstance(d, ModelDrafter)]
    with engine.batch(slots=3, max_length=128) as batch:
        batch.warmup([1, 4])
        run = batch._run
        widths = window_widths(128, 16)
        assert run.prefill_widths == tuple(widths) == (16, 32, 64, 128)
        keys = {("join", b, w) for b in range(3) for w in widths}
        assert all(key in run.join_graphs for key in keys) and len(run.join_graphs) == len(keys)
        assert all(key in d._graphs for d in models for key in keys)
        replayed, real_run = [], run.join_graphs.run
        run.join_graphs.run = lambda key, fn: (replayed.append(key), real_run(key, fn))[1]
        got, names, pending = {}, {}, list(range(len(prompts)))
        while pending or batch.running:
            if pending and batch.free_slots:
                i = pending.pop(0)
                handle = batch.add(prompts[i], max_new_tokens=12)
                names[handle], got[handle] = i, []
            for update in batch.step():
                got[update.handle] += update.tokens
        assert len(replayed) == len(prompts) and all(key in keys for key in replayed)
        assert {key[1] for key in replayed} == {0, 1, 2}  # every slot joined
        assert len(run.join_graphs) == len(keys)  # nothing captured inside a request
        assert all(key in d._graphs for d in models for key in keys)
    for handle, i in names.items():
        assert got[handle] == hf_greedy(target, prompts[i], 12), i


def test_a_batch_replays_its_steps_as_graphs_and_equals_the_same_batch_run_eagerly():
    """A batch's steps are captured per (γ, sets of sampling parameters), whichever slots use
    them (SPEC.md §12): greedy and seeded sampled rows (two sets) joining and leaving give, from
    graph replays, the tokens of the same batch run without graphs; greedy rows equal
    ``model.generate``; a bounded Graphs drops its graphs past its limit and captures again."""
    from flashspec.models.graphs import Graphs

    target, draft = tiny("llama", 0), tiny("llama", 1)
    prompts = [[(3 * i + j) % 90 + 1 for j in range(4 + 3 * i)] for i in range(6)]

    def run(graphs: bool):
        engine = SpeculativeEngine(target, [draft])
        out = {}
        with engine.batch(slots=3, max_length=128) as batch:
            batch._run.plan.graphs.enabled = graphs
            batch.warmup([1])
            names, pending = {}, list(range(len(prompts)))
            while pending or batch.running:
                if pending and batch.free_slots:
                    i = pending.pop(0)
                    sampling = {} if i % 2 == 0 else dict(do_sample=True, temperature=0.8, top_k=20, seed=i)
                    names[batch.add(prompts[i], max_new_tokens=14, **sampling)] = i
                    out[i] = []
                for update in batch.step():
                    out[names[update.handle]] += update.tokens
            captured = len(batch._run.plan.graphs)
        return out, captured

    graphed, captured = run(True)
    eager, _ = run(False)
    assert graphed == eager and captured >= 2
    for i in range(0, len(prompts), 2):
        assert graphed[i] == hf_greedy(target, prompts[i], 14)
    bounded = Graphs(enabled=True, limit=2)
    x = torch.zeros(4, device="cuda")
    for key in ("a", "b", "c"):
        bounded.run(key, lambda: x.add_(1))
    assert len(bounded) == 1 and float(x[0]) == 3


@pytest.mark.parametrize("do_sample", [False, True])
def test_graph_replays_equal_eager_steps(do_sample):
    """Same seed, same tokens with and without CUDA graphs (sampling included)."""
    kwargs = dict(max_new_tokens=40, num_draft_tokens=3, eos_token_id=[], do_sample=do_sample, temperature=0.8,
                  seed=5)
    target, draft = tiny("llama", 0, torch.bfloat16), tiny("llama", 1, torch.bfloat16)
    graphed = SpeculativeEngine(target, [draft])
    eager = SpeculativeEngine(target, [draft])
    eager._graphs.enabled = False
    eager.drafters[0]._graphs.enabled = False
    a = graphed.generate(PROMPTS, **kwargs).sequences
    b = graphed.generate(PROMPTS, **kwargs).sequences  # now from graph replays
    c = eager.generate(PROMPTS, **kwargs).sequences
    assert a == b == c


@pytest.mark.parametrize("batch,gamma", [(1, 1), (1, 4), (3, 2), (3, 5)])
def test_ngram_proposals_replayed_from_a_graph_equal_the_eager_search(batch, gamma):
    """SPEC.md §4: the n-gram drafter's proposal on CUDA replays one graph per k, reading the
    history's buffers in place: after every change of the committed tokens and lengths (rows of
    other lengths, repeats and no match included) it proposes what the eager search proposes; a
    new buffer is searched, not a freed one."""
    from flashspec.drafters import History, NgramDrafter

    gen = torch.Generator().manual_seed(batch * 10 + gamma)
    drafter, eager = NgramDrafter(), NgramDrafter()
    params, uniforms = SamplingParams(), torch.zeros(batch, gamma, device="cuda")
    for capacity in (64, 128):
        tokens = torch.zeros(batch, capacity, dtype=torch.long, device="cuda")
        length = torch.zeros(batch, dtype=torch.long, device="cuda")
        for trial in range(6):
            tokens.copy_(torch.randint(0, 5 if trial % 2 else 50, (batch, capacity), generator=gen))
            length.copy_(torch.randint(2, capacity - gamma, (batch,), generator=gen))
            history = History(tokens, length)
            got = drafter.propose(history, gamma, params, uniforms).tokens.clone()
            expected = eager._draft(tokens.clone(), length.clone(), gamma)
            assert torch.equal(got, expected), (capacity, trial)
        assert gamma in drafter._graphs  # the later trials replayed the graph captured at the first


@pytest.mark.parametrize("drafter", ["model", "ngram", "early-exit", "feature", "shallow", "compact", "none"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(do_sample=True, temperature=0.7),
                                    SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, top_k=20)])
def test_steady_state_steps_do_not_synchronise(drafter, params):
    """After warm-up (capture), a decode step issues no device-to-host synchronisation."""
    target = tiny("llama", 0, torch.bfloat16)
    drafters = drafters_for(drafter, target, torch.bfloat16)
    engine = SpeculativeEngine(target, drafters)
    stats = _steps_without_synchronising(engine, params, gamma=4, steps=8)
    assert stats.steps == 11


def _steps_without_synchronising(engine, params, gamma: int, steps: int) -> GenerationStats:
    """Prefill, 3 warm-up steps (eager first calls and graph captures), then ``steps`` steps with
    any device-to-host synchronisation raising an error; a final poll; the run's statistics."""
    request = Request(PROMPTS, params, eos=[], max_new_tokens=64, num_draft_tokens=gamma, seed=0, sync_every=1,
                      context=None)
    stats = GenerationStats(per_drafter={d.name: DrafterStats() for d in engine.drafters},
                            per_arm={engine.arm_label(a, gamma): DrafterStats() for a in range(len(engine.arms))})
    plan = engine.plan(rows=len(request.rows), length=request.longest + request.max_new_tokens,
                       num_draft_tokens=request.num_draft_tokens, num_eos=len(request.eos))
    run = _Run(plan, request, stats)
    run.prefill()
    for _ in range(3):
        run.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            run.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert run.poll() in (True, False)
    return stats


@pytest.mark.parametrize("do_sample", [False, True])
def test_compiled_bookkeeping_in_graphs(do_sample):
    """The compiled commit/log bookkeeping (what compile=True adds to a graph-replayed step) gives
    the tokens of the eager one, EOS cuts included, and its steady-state steps do not synchronise."""
    from flashspec.decode.commit import commit_step

    target, draft = tiny("llama", 0, torch.bfloat16), tiny("llama", 1, torch.bfloat16)
    kwargs = dict(max_new_tokens=40, num_draft_tokens=3, eos_token_id=[5, 9], do_sample=do_sample, seed=7)
    plain = SpeculativeEngine(target, [draft])
    compiled = SpeculativeEngine(target, [draft])
    compiled._commit_step = torch.compile(commit_step, dynamic=False)
    assert plain.generate(PROMPTS, **kwargs).sequences == compiled.generate(PROMPTS, **kwargs).sequences
    assert SpeculativeEngine(target, [draft], compile=True)._commit_step is not commit_step
    assert _steps_without_synchronising(compiled, SamplingParams(do_sample=do_sample), gamma=3, steps=6).steps == 9


def test_sync_every_does_not_change_output():
    target, draft = tiny("llama", 0), tiny("llama", 1)
    engine = SpeculativeEngine(target, [draft])
    kwargs = dict(max_new_tokens=30, num_draft_tokens=3, eos_token_id=[5], do_sample=True, seed=3)
    a = engine.generate(PROMPTS, sync_every=1, **kwargs).sequences
    b = engine.generate(PROMPTS, sync_every=16, **kwargs).sequences
    assert a == b


def test_new_request_shapes_after_captures_replace_graphs_cleanly():
    """A request of a new shape replaces the workspace and drops every captured graph; the next
    captures must not reuse the dropped graphs' memory pool (a PyTorch assertion, seen on the
    H200 when `bench select` went from its warm-up prompt to the workload). Arms switched by a
    bandit, γ changing, capacities and batch sizes changing, greedy output still the target's."""
    target, draft = tiny("llama", 0), tiny("llama", 1)
    engine = SpeculativeEngine(target, [draft, "ngram"], gammas=[2, 4], selector="thompson",
                               selector_options={"seed": 0})
    for prompts, n in [(PROMPTS[:1], 8), (PROMPTS, 24), ([PROMPTS[2] * 30], 40), (PROMPTS[1:], 300), (PROMPTS[:1], 8)]:
        out = engine.generate(prompts, max_new_tokens=n, eos_token_id=[])
        assert out.sequences == [hf_greedy(target, p, n) for p in prompts]


@pytest.mark.default_configuration
@pytest.mark.parametrize("compile", [False, True])
def test_the_default_configuration_on_cuda_equals_generate_and_guards_each_request(compile):
    """selector='auto' on CUDA (SPEC.md §8): the target-only arm's step is a graph of its own, the
    guard reads lagged CUDA-event times (sync_every 8, queued ahead), the output is the target's;
    a second request starts from the first one's measured arm costs."""
    target, draft = tiny("llama", 0), tiny("llama", 1)
    engine = SpeculativeEngine(target, [draft, "ngram"], gammas=[2, 4], compile=compile)
    assert engine.arm_label(engine.target_only_arm) == "target@0"
    for prompts, n in [(PROMPTS, 60), (PROMPTS[:1], 120)]:
        out = engine.generate(prompts, max_new_tokens=n, eos_token_id=[])
        expected = [hf_greedy(target, p, n) for p in prompts]
        differ = [(row, next(i for i, (a, b) in enumerate(zip(got, want)) if a != b))
                  for row, (got, want) in enumerate(zip(out.sequences, expected)) if got != want]
        arms = {label: (s.steps, s.accepted) for label, s in out.stats.per_arm.items()}
        assert not differ, f"(row, first differing token) {differ}; steps and accepted drafts per arm {arms}"
        assert out.stats.per_arm["target@0"].steps >= 1, f"steps and accepted drafts per arm {arms}"
    assert engine.arm_costs  # measured by the first request's guard


# ------------------------------------------------------------------ misuse on the CUDA path (SPEC.md §5)
@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("drafter", ["model", "ngram", "none"])
def test_non_finite_logits_are_caught_inside_graph_replays(do_sample, drafter):
    """The fault is noted inside the captured step and raised at a poll, with graphs replaying."""
    target = tiny("llama", 0, torch.bfloat16)
    drafters = {"model": [tiny("llama", 1, torch.bfloat16)], "ngram": ["ngram"], "none": []}[drafter]
    engine = SpeculativeEngine(target, drafters)
    kwargs = dict(max_new_tokens=40, num_draft_tokens=3, do_sample=do_sample, temperature=0.8, eos_token_id=[])
    engine.generate(PROMPTS, **kwargs)  # capture the graphs first
    with torch.no_grad():
        saved = target.lm_head.weight[7].clone()
        target.lm_head.weight[7] = float("nan")  # in place: the captured graphs read it
    try:
        with pytest.raises(ValueError, match=r"row \d+: the target's logits are not finite"):
            engine.generate(PROMPTS, **kwargs)
    finally:
        with torch.no_grad():
            target.lm_head.weight[7] = saved
    assert len(engine.generate(PROMPTS, **kwargs).sequences[0]) == 40  # and the engine still works


def test_drafted_ids_outside_the_vocabulary_never_reach_an_index_on_the_gpu():
    """Before: a device-side assert (which ends the CUDA context) or a raw RuntimeError."""
    from flashspec import Draft

    class Wild:
        name = "wild"

        def begin(self, batch_size):
            pass

        def propose(self, history, num_tokens, params, uniforms):
            return Draft(torch.full((history.tokens.shape[0], num_tokens), 10**6, device="cuda"), None)

    target = tiny("llama", 0, torch.bfloat16)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        SpeculativeEngine(target, [Wild()]).generate(PROMPTS, max_new_tokens=20, eos_token_id=[])
    assert len(SpeculativeEngine(target, ["ngram"]).generate(PROMPTS, max_new_tokens=8).sequences) == len(PROMPTS)


def test_the_users_model_keeps_its_parameters_on_the_gpu():
    model = tiny("qwen2", 0, torch.bfloat16).train()
    params = dict(model.named_parameters())
    flags = {k: p.requires_grad for k, p in params.items()}
    engine = SpeculativeEngine(model, ["ngram"])
    engine.generate(PROMPTS, max_new_tokens=12)
    after = dict(model.named_parameters())
    assert all(after[k] is params[k] and after[k].requires_grad == flags[k] for k in params)
    assert model.training


# ------------------------------------------------------------------ training on the GPU (SPEC.md §11.3, §11.6)
@pytest.mark.parametrize("vocab", [None, 48])
def test_feature_training_unrolled_in_bf16_on_the_gpu(vocab, tmp_path):
    """float32 master weights under bf16 autocast, three unrolled passes through chain_mask with
    the feature loss, a draft vocabulary or not: the loss falls, the estimate has three depths,
    and the saved head drafts the target's own greedy output."""
    from flashspec.drafters.checkpoint import save_drafter
    from flashspec.training.train import TrainOptions, train_head

    target = tiny("llama", 0, torch.bfloat16)
    data = torch.randint(0, 96, (64, 48), generator=torch.Generator().manual_seed(0))
    options = TrainOptions(steps=30, batch=8, seq_len=48, lr_layers=3e-3, lr_head=3e-3, estimate_every=15,
                           draft_vocab=vocab)
    head, log = train_head("feature", target, data[:56], options, estimate=data[56:], progress=False)
    assert next(head.parameters()).dtype == torch.bfloat16 and log["loss"][-1] < log["loss"][0]
    assert len(log["estimates"][-1]["alpha"]) == 3 and log["peak_memory_bytes"] > 0
    save_drafter(head, target, tmp_path)
    out = SpeculativeEngine(target, [f"feature:{tmp_path}"]).generate(PROMPTS, max_new_tokens=16, eos_token_id=[])
    plain = SpeculativeEngine(target, []).generate(PROMPTS, max_new_tokens=16, eos_token_id=[])
    assert len(out.sequences) == len(plain.sequences) and all(len(s) == 16 for s in out.sequences)


@pytest.mark.parametrize("kind,compile", [("feature", False), ("feature", True), ("shallow", False)])
def test_step_anatomy_of_a_drafter_made_from_the_target(kind, compile, tmp_path):
    """bench gpu's step anatomy with a drafter made from the target: its own forwards (the
    re-fed window and the one-token drafts; a shallow drafter's also run the target's first N
    layers) are timed, and the share outside the forwards is."""
    from flashspec.bench.gpu import bench_pair

    target = tiny("llama", 0, torch.bfloat16)
    prompts = {"random": [p * 4 for p in PROMPTS]}
    checkpoint = feature_checkpoint(target) if kind == "feature" else shallow_checkpoint(target)
    pair = bench_pair("tiny", target, f"{kind}:{checkpoint}", prompts, 1e12, max_new_tokens=24,
                      gamma=3, compile=compile)
    fwd = pair["forward_seconds"]
    assert {"drafter_1", "drafter_4"} <= set(fwd)
    if kind == "shallow":
        assert 0 < fwd["shared_layers_1"] < fwd["drafter_1"]
    assert 0 < pair["speculative_forwards_seconds"] and pair["speculative_overhead"] < 1


def test_calibration_on_cuda_times_graph_replays_and_reuses_its_cache(tmp_path, monkeypatch):
    """`flashspec calibrate` on CUDA (SPEC.md §13): a StaticLM's curve is timed as CUDA-graph
    replays, every width's cost is finite and positive, the key names the GPU, and a second call
    reads the cached curve back without timing again."""
    from flashspec.tuning import calibrate
    from flashspec.tuning import timing

    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path))
    lm = StaticLM(tiny("llama", 0, torch.bfloat16))
    curve, path = calibrate.measure(lm, 5, context=32, progress=False)
    assert curve.method == "CUDA-graph replay" and curve.max_width == 5 and path.is_file()
    assert all(0 < s < 1 for s in curve.seconds) and torch.cuda.get_device_name() in curve.device
    monkeypatch.setattr(timing, "forward_seconds", lambda *a, **k: pytest.fail("timed again"))
    again, _ = calibrate.measure(lm, 4, context=32, progress=False)
    assert again.seconds == curve.seconds[:4]


# ----------------------------------------------------------------------------------------------
# Bit-exact mode (SPEC.md §14), natively: the kernels' real tiles, autotuned configs,
# CUDA graphs and torch.compile.
# ----------------------------------------------------------------------------------------------

def real_shape(arch: str, layers: int = 2, vocab: int | None = None):
    """A random-weight bf16 model of a real model's shape, with few layers: Qwen2.5-1.5B (q/k/v
    biases, tied embeddings), Qwen3-1.7B (per-head query and key norms) or Llama-3-8B."""
    if arch == "qwen3":
        config = transformers.Qwen3Config(vocab_size=vocab or 151936, hidden_size=2048, intermediate_size=6144,
                                          num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(vocab_size=vocab or 151936, hidden_size=1536, intermediate_size=8960,
                                          num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=2,
                                          max_position_embeddings=4096, tie_word_embeddings=True)
    else:
        config = transformers.LlamaConfig(vocab_size=vocab or 128256, hidden_size=4096, intermediate_size=14336,
                                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                          max_position_embeddings=4096, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("compiled", [False, True])
def test_bit_exact_logits_do_not_depend_on_width_or_batch_on_cuda(arch, compiled):
    """Real shapes, natively: a 5-token forward and five 1-token forwards give bit-identical
    logits and caches; a sequence of a ragged batch of 8 decodes to the same bits alone. (Whether
    the default kernels differ here depends on the GPU and shape: on an H100 they agreed for these
    two-layer Llama and Qwen2 shapes and differed for Qwen3; the demo pair's default arms differ
    from target-only on most prompts, BENCHMARKS.md, "Exactness".)"""
    model = real_shape(arch)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (8, 40), generator=gen).cuda()
    feed = torch.randint(0, 1000, (8, 5), generator=gen).cuda()
    start = torch.tensor([40, 33, 7, 21, 40, 1, 38, 12], device="cuda")

    def lm_for(batch, exact=True):
        lm = StaticLM(model, compile=compiled and exact)
        lm.bit_exact = exact
        lm.reset(batch, 256)
        return lm

    wide, narrow = lm_for(8), lm_for(8)
    wide.forward(prompt, torch.zeros(8, dtype=torch.long, device="cuda"), eager=True)
    for lm in (narrow,):
        for mine, theirs in zip(lm.keys + lm.values, wide.keys + wide.values):
            mine.copy_(theirs)
    alone = lm_for(1)
    for mine, theirs in zip(alone.keys + alone.values, wide.keys + wide.values):
        mine.copy_(theirs[2:3])
    logits = wide.forward(feed, start).clone()
    steps = torch.cat([narrow.forward(feed[:, j:j + 1], start + j).clone() for j in range(5)], dim=1)
    assert torch.equal(steps, logits)
    for mine, theirs in zip(narrow.keys + narrow.values, wide.keys + wide.values):
        assert torch.equal(mine, theirs)
    assert torch.equal(alone.forward(feed[2:3], start[2:3])[0], logits[2])
    default = lm_for(8, exact=False)
    for mine, theirs in zip(default.keys + default.values, wide.keys + wide.values):
        mine.copy_(theirs)
    torch.testing.assert_close(logits.float(), default.forward(feed, start).float(), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("drafter", ["model", "ngram", "feature"])
@pytest.mark.parametrize("compiled", [False, True])
def test_bit_exact_greedy_speculative_equals_target_only_on_cuda(drafter, compiled):
    """A random-weight target of Qwen2.5-1.5B's shape (flat logits: near-ties everywhere, so any
    difference of rounding shows): in bit-exact mode greedy speculative output equals target-only
    output token for token, at batch 1 and in a ragged batch, with graphs and, compiled or not."""
    target = real_shape("qwen2")
    drafters = {"model": lambda: [real_shape("qwen2", layers=1)], "ngram": lambda: ["ngram"],
                "feature": lambda: [f"feature:{feature_checkpoint(target)}"]}[drafter]()
    prompts = [[int(t) for t in torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (60, 9, 31)]
    base = SpeculativeEngine(target, [], bit_exact=True, compile=compiled)
    engine = SpeculativeEngine(target, drafters, selector="fixed", bit_exact=True, compile=compiled)
    for batch in ([prompts[0]], prompts):
        expected = base.generate(batch, max_new_tokens=48, eos_token_id=[]).sequences
        out = engine.generate(batch, max_new_tokens=48, num_draft_tokens=4, eos_token_id=[])
        assert out.sequences == expected, (drafter, len(batch))


BIT_EXACT_LAW_CASES = [("noisy", 0.8, 0, 0.9, 3), ("self", 0.6, 5, 1.0, 1), ("ngram", 1.3, 0, 1.0, 2),
                       ("none", 0.7, 4, 0.9, 4)]


def test_bit_exact_sampling_follows_the_exact_law_of_its_logits_on_cuda():
    """Sampled output in bit-exact mode (SPEC.md §14 item 1, §6): 10,000 bf16 continuations of one
    prompt against the law of their first three tokens, enumerated from the mode's own forward
    (10 tokens: the exact kernels, so the logits the engine's prefill and decode steps compute)
    and warped by transformers' warpers, not FlashSpec's sampling code. Cases: p != q, drafter ==
    target, n-gram, target-only; one after another in one test (a 10,000-row batch's CUDA graphs
    are large: side by side in parallel test workers they ran an 80 GB GPU out of memory)."""
    import copy
    import itertools

    import numpy as np
    from stats_helpers import ALPHA
    from test_distribution import PROMPT, V, chi_square_pvalue, tiny_llama

    target = tiny_llama(0, hidden=64).to("cuda", torch.bfloat16)  # head size 16: the attention kernel's tiles
    lm = StaticLM(target)
    lm.bit_exact = True
    lm.reset(V * V, 16)
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)), device="cuda")  # [V², 2]
    ids = torch.cat([torch.tensor(PROMPT, device="cuda").expand(len(pairs), -1), pairs], dim=1)
    logits = lm.forward(ids, torch.zeros(len(pairs), dtype=torch.long, device="cuda"))[:, -3:].float().cpu()
    del lm

    def noisy():
        model = copy.deepcopy(target)
        gen = torch.Generator(device="cuda").manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.float().std() * torch.randn(p.shape, generator=gen, device="cuda").to(p.dtype))
        return model

    for drafter, temperature, top_k, top_p, gamma in BIT_EXACT_LAW_CASES:
        warpers = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(temperature)])
        if top_k:
            warpers.append(transformers.TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(transformers.TopPLogitsWarper(top_p))
        law = lambda z: torch.softmax(warpers(None, z), dim=-1).double()  # noqa: E731
        joint = (law(logits[:1, 0])[0][:, None, None] * law(logits[:, 1]).view(V, V, V)[:, 0][:, :, None]
                 * law(logits[:, 2]).view(V, V, V)).numpy()
        made = {"noisy": noisy, "self": lambda: target, "ngram": lambda: "ngram", "none": lambda: None}[drafter]()
        engine = SpeculativeEngine(target, [made] if made is not None else [], selector="fixed", bit_exact=True)
        out = engine.generate([PROMPT] * 10_000, max_new_tokens=5, do_sample=True, temperature=temperature,
                              top_k=top_k, top_p=top_p, num_draft_tokens=gamma, eos_token_id=[], seed=1234)
        samples = np.array([s[:3] for s in out.sequences])
        pvalue = chi_square_pvalue(samples, joint)
        assert pvalue > ALPHA, f"{drafter}: χ² p-value {pvalue:.2e}: bit-exact output law differs from its logits' law"
        if drafter == "self":
            assert out.stats.acceptance_rate > 0.95, drafter  # p ≈ q: the drafter runs the default kernels
        elif drafter != "none":
            assert 0.0 < out.stats.acceptance_rate < 1.0, drafter  # both the accept and the reject paths ran
        del engine, made, out
        torch.cuda.empty_cache()


@pytest.mark.default_configuration
@pytest.mark.parametrize("drafter", ["model", "feature"])
def test_requests_of_new_lengths_and_batch_sizes_compile_and_capture_nothing(drafter):
    """SPEC.md §7, "Warm shapes": with compile=True the constructor compiles and captures every
    arm's shapes (greedy and sampled, alone and after gaps) at the warmed batch size; requests of
    other prompt and output lengths, and sampled ones with the warm-up's parameters, then compile
    nothing and capture nothing, and none of their steps is cold."""
    from flashspec.decode.warmup import SAMPLED
    from flashspec.models.graphs import compile_events

    target = tiny("llama", 0, torch.bfloat16)
    draft = tiny("llama", 1, torch.bfloat16) if drafter == "model" else f"feature:{feature_checkpoint(target)}"
    engine = SpeculativeEngine(target, [draft, "ngram"], compile=True, max_length=512, warmup=True)
    assert engine.fixed_shapes and engine.warmup_seconds > 0
    before = compile_events()
    for length, new, sampling in [(5, 10, {}), (37, 90, {}), (200, 40, SAMPLED), (3, 250, {}), (300, 30, SAMPLED)]:
        out = engine.generate([list(range(1, length + 1))], max_new_tokens=new, eos_token_id=[], seed=0, **sampling)
        assert out.stats.cold_steps == 0 and len(out.sequences[0]) == new
    assert compile_events() == before
