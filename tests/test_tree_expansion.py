"""Top-k expansion of a feature drafter into a draft tree (flashspec/drafters/expansion.py and
``FeatureDrafter.expand`` / ``Eagle3Drafter``'s tree layer; SPEC.md §7, "Top-k expansion of a feature
drafter"): the nodes are EAGLE-2's selection (against a brute-force expansion), each node's value is
what chain forwards of its path give, ``topk = 1`` is the greedy chain, nothing is written past the
pending token, nothing is read back to the host, and bad options are clear errors."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

from flashspec import FeatureHead, TreeExpansion
from flashspec.drafters.base import History
from flashspec.drafters.eagle3 import Eagle3Drafter, Eagle3Head
from flashspec.drafters.expansion import MAX_NODES, MAX_TOPK, candidates, expand_tree
from flashspec.drafters.feature import FeatureDrafter
from flashspec.models.static import StaticLM
from flashspec.sampling import SamplingParams, process_logits

GREEDY = SamplingParams()
LAWS = {"greedy": GREEDY, "sampled": SamplingParams(do_sample=True, temperature=0.6),
        "filtered": SamplingParams(do_sample=True, temperature=1.3, top_k=3, top_p=0.9)}
VOCAB = 128


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def log_law(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return torch.log_softmax(process_logits(logits.double(), params), dim=-1)


def eagle2(logits_after, depth: int, topk: int, nodes: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Brute-force EAGLE-2 for one row: ``logits_after(path) -> [V]`` the drafter's logits after a path
    of draft ids. Depth 1: the root's ``topk`` best; each later depth: the ``topk`` best children of each
    of the previous depth's ``topk`` best candidates; then the ``nodes`` best of all. ``{path: value}``,
    values in float64; ``-inf`` candidates are left out (which of them a tree holds is a tie)."""
    def children(path: tuple[int, ...], value: float) -> list[tuple[tuple[int, ...], float]]:
        law = log_law(logits_after(path), params)
        best = sorted(range(len(law)), key=lambda t: -float(law[t]))[:topk]
        return [(path + (t,), value + float(law[t])) for t in best]

    level = children((), 0.0)
    pool = list(level)
    for _ in range(1, depth):
        level = sorted((c for p, v in level for c in children(p, v)), key=lambda c: -c[1])
        pool += level
        level = level[:topk]
    ranked = sorted(pool, key=lambda c: -c[1])[:nodes]
    return {p: v for p, v in ranked if v > -math.inf}


def tree_paths(tokens: list[int], parents: list[int], values: list[float]) -> dict[tuple[int, ...], float]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return {p: v for p, v in zip(paths, values) if v > -math.inf}


def check_tree(out, depth: int, topk: int, nodes: int) -> None:
    """Shapes and structure: parents earlier, depths one below them, distinct siblings."""
    batch = out.tokens.shape[0]
    assert out.tokens.shape == out.parents.shape == out.depths.shape == out.values.shape == (batch, nodes)
    for b in range(batch):
        siblings: dict[int, set[int]] = {}
        for j in range(nodes):
            parent = int(out.parents[b, j])
            assert -1 <= parent < j
            assert int(out.depths[b, j]) == (int(out.depths[b, parent]) + 1 if parent >= 0 else 1) <= depth
            assert float(out.values[b, j]) <= (float(out.values[b, parent]) if parent >= 0 else 0.0)
            token = int(out.tokens[b, j])
            assert token not in siblings.setdefault(parent, set())
            siblings[parent].add(token)


def close(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(abs(got[p] - expected[p]) < 1e-4 for p in got)


# ---------------------------------------------------------------------------------- the algorithm
@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), depth=st.integers(1, 4), topk=st.integers(1, 4), pick=st.integers(0, 10**6),
       vocab=st.integers(4, 9), law=st.sampled_from(sorted(LAWS)), mapped=st.booleans(), seed=st.integers(0, 2**16))
@example(batch=1, depth=1, topk=1, pick=0, vocab=4, law="greedy", mapped=False, seed=0)
def test_expansion_selects_eagle2s_nodes(batch, depth, topk, pick, vocab, law, mapped, seed):
    """A synthetic drafter whose logits after a path are a fixed random function of the row and the
    path: the expansion keeps exactly brute-force EAGLE-2's nodes with their values, as a tree whose
    parents come first; the step is called once per level with the frontier's parents and ancestors.
    With ``mapped`` the draft ids are a draft vocabulary's, mapped to target ids."""
    nodes = 1 + pick % candidates(depth, topk)  # any node budget the depth and topk allow
    params = LAWS[law]
    ids = torch.randperm(100, generator=torch.Generator().manual_seed(seed))[:vocab] if mapped else None

    @functools.cache
    def logits_after(row: int, path: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((seed, row, path)) % 2**31)
        return torch.randn(vocab, generator=gen, dtype=torch.float64).float() * 2

    fed: list[list[tuple[int, ...]]] = [[] for _ in range(batch)]  # per row, the path of each fed slot
    calls = []

    def step(tokens, parents, sees, level):
        calls.append((level, tokens.shape, sees.shape))
        out = []
        for b in range(batch):
            row = []
            for w in range(tokens.shape[1]):
                parent = int(parents[b, w])
                above = fed[b][parent] if parent >= 0 else ()
                assert [s for s in range(sees.shape[2]) if sees[b, w, s]] == _ancestors(fed[b], above)
                draft_id = int(tokens[b, w]) if ids is None else ids.tolist().index(int(tokens[b, w]))
                row.append(above + (draft_id,))
            fed[b] += row
            out.append(torch.stack([logits_after(b, p) for p in row]))
        return torch.stack(out)

    root = torch.stack([logits_after(b, ()) for b in range(batch)])
    out = expand_tree(root, step, depth, topk, nodes, params, ids)
    assert calls == [(d, (batch, topk), (batch, topk, (d - 1) * topk)) for d in range(1, depth)]
    check_tree(out, depth, topk, nodes)
    for b in range(batch):
        tokens = out.tokens[b].tolist() if ids is None else [ids.tolist().index(t) for t in out.tokens[b].tolist()]
        got = tree_paths(tokens, out.parents[b].tolist(), out.values[b].tolist())
        expected = eagle2(functools.partial(logits_after, b), depth, topk, nodes, params)
        assert close(got, expected), (got, expected)


def _ancestors(fed: list[tuple[int, ...]], path: tuple[int, ...]) -> list[int]:
    """The fed slots whose paths are prefixes of ``path`` (itself included)."""
    return [s for s, p in enumerate(fed) if path[: len(p)] == p and len(p) <= len(path) and p]


# ---------------------------------------------------------------------------------- the drafters
@functools.cache
def target(arch: str) -> transformers.PreTrainedModel:
    return tiny_model(arch, seed=3, vocab_size=VOCAB)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name else 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def make_drafter(kind: str) -> FeatureDrafter:
    """A random feature head over the last layer (Llama), one over fused taps (Qwen2), or an EAGLE-3
    head with a 48-token draft vocabulary (Llama)."""
    if kind == "feature":
        model = target("llama")
        torch.manual_seed(0)
        return FeatureDrafter(StaticLM(model), FeatureHead(model.config, 1))
    if kind == "taps":
        model = target("qwen2")
        torch.manual_seed(1)
        return FeatureDrafter(StaticLM(model), FeatureHead(model.config, 1, taps=(0, 1)))
    model = target("llama")
    return Eagle3Drafter(StaticLM(model), eagle3_head(model))


def eagle3_head(model: transformers.PreTrainedModel, draft_vocab: int = 48, seed: int = 2) -> Eagle3Head:
    """A random EAGLE-3 head over ``model``'s two layers' outputs, drafting from ``draft_vocab`` of its ids."""
    vocab_size = model.config.vocab_size
    config = transformers.LlamaConfig(hidden_size=model.config.hidden_size, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                                      vocab_size=vocab_size, max_position_embeddings=256, num_hidden_layers=1)
    vocab = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    head = Eagle3Head(config, (0, 1), vocab_size, draft_vocab, vocab).eval()
    _randomise(head, seed + 1)
    return head


DRAFTERS = {kind: make_drafter(kind) for kind in ("feature", "taps", "eagle3")}


def history(drafter: FeatureDrafter, prompts: list[list[int]], capacity: int = 32) -> History:
    """Committed rows and the target's features at every committed position, from a chain forward."""
    model = drafter.target.model
    lm = StaticLM(model)
    batch = len(prompts)
    tokens = torch.zeros(batch, capacity, dtype=torch.long)
    length = torch.tensor([len(p) for p in prompts])
    hidden = {n: torch.zeros(batch, capacity, model.config.hidden_size) for n in drafter.feature_layers}
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
        lm.reset(1, capacity)
        one = {n: h[b : b + 1] for n, h in hidden.items()}
        lm.forward(tokens[b : b + 1, : len(p)], torch.zeros(1, dtype=torch.long), hidden_out=one)
    drafter.begin(batch)
    return History(tokens, length, torch.ones(batch, dtype=torch.bool), int(length.max()), hidden)


def prompts_for(batch: int, seed: int, shortest: int = 1) -> list[list[int]]:
    """Ragged random prompts of ``shortest`` to 8 tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()
            for n in torch.randint(shortest, 9, (batch,), generator=gen)]


@torch.inference_mode()
def chain_logits(drafter: FeatureDrafter, h: History, row: int, path: tuple[int, ...]) -> torch.Tensor:
    """The drafter's logits after ``path`` (target ids) in row ``row``, as a chain proposal computes
    them: the window feed, then one-token forwards of the path's tokens."""
    logits = drafter._root_logits(h, h.length_bound())
    for i, token in enumerate(path):
        tokens = torch.full((h.tokens.shape[0],), token)
        logits = drafter._next(tokens, h.length + i)
    return logits[row]


def draft_ids(drafter: FeatureDrafter, tokens: list[int]) -> list[int]:
    vocab = None if drafter._subset is None else drafter._subset.vocab.tolist()
    return tokens if vocab is None else [vocab.index(t) for t in tokens]


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 2), depth=st.integers(1, 3), topk=st.integers(1, 3), pick=st.integers(0, 10**6),
       seed=st.integers(0, 2**16))
@example(batch=1, depth=1, topk=1, pick=0, seed=0)
def test_expanded_nodes_score_as_chains(kind, batch, depth, topk, pick, seed):
    """Each node's value is the sum of the log draft probabilities a chain proposal of its path
    computes (the tree attention sees the committed positions, the node's ancestors and itself), and
    the nodes are brute-force EAGLE-2's over those chain logits: feature heads (last layer; fused taps)
    and an EAGLE-3 head with a draft vocabulary, ragged rows."""
    nodes = 1 + pick % candidates(depth, topk)
    drafter = DRAFTERS[kind]
    h = history(drafter, prompts_for(batch, seed))
    out = drafter.expand(h, depth, topk, nodes, GREEDY)
    check_tree(out, depth, topk, nodes)
    vocab = None if drafter._subset is None else drafter._subset.vocab.tolist()
    for b in range(batch):
        @functools.cache
        def logits_after(path: tuple[int, ...]) -> torch.Tensor:
            return chain_logits(drafter, h, b, tuple(t if vocab is None else vocab[t] for t in path))

        got = tree_paths(draft_ids(drafter, out.tokens[b].tolist()), out.parents[b].tolist(), out.values[b].tolist())
        assert close(got, eagle2(logits_after, depth, topk, nodes, GREEDY))


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_topk_one_is_the_greedy_chain(kind):
    """``topk = 1`` keeps one child per level: the drafter's greedy chain, as ``propose`` drafts it."""
    drafter, depth = DRAFTERS[kind], 4
    prompts = prompts_for(3, 11)
    out = drafter.expand(history(drafter, prompts), depth, 1, depth, GREEDY)
    h = history(drafter, prompts)
    chain = drafter.propose(h, depth, GREEDY, torch.zeros(3, depth, dtype=torch.float64))
    assert torch.equal(out.tokens, chain.tokens)
    assert out.parents.tolist() == [[-1, 0, 1, 2]] * 3 and out.depths.tolist() == [[1, 2, 3, 4]] * 3


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_expansion_writes_nothing_past_the_pending_token(kind):
    """An expansion's nodes write nothing into the drafter's cache or predicted features (a chain
    proposal writes its drafts there): past every row's pending token they hold what they held before
    (rows of 4 tokens or more, so that the second proposal's 4-wide window feed ends at the pending
    token too), and the expansion from the same rows, re-fed, is the same tree."""
    drafter = DRAFTERS[kind]
    prompts = prompts_for(3, 5, shortest=4)
    h = history(drafter, prompts)
    first = drafter.expand(h, 3, 3, 8, GREEDY)
    caches = [drafter.lm.keys, drafter.lm.values] if kind == "eagle3" else [*drafter.lm.keys, *drafter.lm.values]

    def past(size: int) -> torch.Tensor:  # [B, size]: the positions past each row's pending token
        return torch.arange(size)[None] >= h.length[:, None]

    with torch.inference_mode():
        for cache in caches:
            cache.masked_fill_(past(cache.shape[2])[:, None, :, None], 7.0)
        drafter._features.masked_fill_(past(drafter._features.shape[1])[..., None], 7.0)
    second = drafter.expand(h, 3, 3, 8, GREEDY)
    for cache in caches:
        assert bool((cache.transpose(1, 2)[past(cache.shape[2])] == 7.0).all())
    assert bool((drafter._features[past(drafter._features.shape[1])] == 7.0).all())
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.parents, second.parents)
    torch.testing.assert_close(first.values, second.values, atol=1e-5, rtol=1e-5)


READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy")


@pytest.fixture
def no_reads(monkeypatch):
    """Within the test, reading a tensor back to the host raises."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor was read back to the host")

    def arm():
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, refuse)
        with pytest.raises(AssertionError, match="read back"):  # armed
            bool(torch.ones(1))
    return arm


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_expansion_reads_nothing_back(kind, no_reads):
    """A drafter's expansion after its first proposal of a request (which may set up its buffers) reads
    no tensor back to the host, greedy and sampled."""
    drafter = DRAFTERS[kind]
    h = history(drafter, prompts_for(2, 9))
    drafter.expand(h, 3, 2, 5, GREEDY)
    no_reads()
    drafter.expand(h, 3, 2, 5, GREEDY)
    drafter.expand(h, 2, 3, 6, LAWS["filtered"])


@settings(max_examples=80, deadline=None)
@given(topk=st.integers(-3, MAX_TOPK + 3), nodes=st.integers(-3, MAX_NODES + 3))
def test_bad_expansions_are_clear_errors(topk, nodes):
    """``TreeExpansion`` takes ``topk`` from 1 to 64 and ``nodes`` from 1 to 256; ``check`` asks for
    ``topk`` within the draft vocabulary and ``nodes`` within the ``K + (D − 1)·K²`` candidates."""
    if not 1 <= topk <= MAX_TOPK:
        with pytest.raises(ValueError, match=f"topk must be an integer from 1 to {MAX_TOPK}; got {topk}"):
            TreeExpansion(topk, max(nodes, 1))
        return
    if not 1 <= nodes <= MAX_NODES:
        with pytest.raises(ValueError, match=f"nodes must be an integer from 1 to {MAX_NODES}; got {nodes}"):
            TreeExpansion(topk, nodes)
        return
    option = TreeExpansion(topk, nodes)
    for depth in (1, 2, 3):
        if nodes > candidates(depth, topk):
            with pytest.raises(ValueError, match=f"at most {candidates(depth, topk)}"):
                option.check(depth, 1000, "feature")
        else:
            option.check(depth, 1000, "feature")
    if topk > 2:
        with pytest.raises(ValueError, match="draft vocabulary has 2 tokens"):
            option.check(4, 2, "feature")


@pytest.mark.parametrize("value", [True, 2.0, "3", None])
def test_non_integer_expansions_are_clear_errors(value):
    with pytest.raises(ValueError, match="topk must be an integer"):
        TreeExpansion(value, 3)
    with pytest.raises(ValueError, match="nodes must be an integer"):
        TreeExpansion(3, value)
