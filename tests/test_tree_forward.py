"""Scoring a draft tree in one forward over StaticLM's cache (flashspec/models/tree.py, SPEC.md §3
"Scoring a draft tree"): every node's logits are the model's after the prompt and the path to that
node, for ragged batches with absent nodes, on every architecture StaticLM runs; the nodes write
nothing into the cache but the root; committing an accepted path leaves the cache as a chain
forward would; greedy decoding through trees reproduces ``generate()``; bad trees are clear errors."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, tiny_model

from flashspec.draft_tree import DraftTree, tree_from_chains, verify_tree
from flashspec.models.static import StaticLM
from flashspec.models.tree import commit_path, tree_forward, tree_layout
from flashspec.sampling import SamplingParams

ARCHS = [a for a in ARCHITECTURES if a in StaticLM.ARCHITECTURES] + ["qwen3"]
VOCAB = 128
TOL = {"atol": 5e-5, "rtol": 1e-5}  # float32: a tree forward and a chain forward differ by rounding only
# A hand-made tree: root → 0 → {2 → 5 → 6, 3}; root → 1 → 4.
HAND_PARENTS = [-1, -1, 0, 0, 1, 2, 5]


@functools.cache
def _model(arch: str) -> transformers.PreTrainedModel:
    if arch != "qwen3":
        return tiny_model(arch)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    for layer in model.model.layers:  # per-head norms that are not all ones, so that skipping them shows
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data = 1 + 0.3 * torch.randn(norm.weight.shape)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _prefilled(model, prompts: list[list[int]], capacity: int = 64) -> tuple[StaticLM, torch.Tensor, torch.Tensor]:
    """A StaticLM whose rows hold ``prompts`` (zero-padded; the padding is stale), the roots
    (each prompt's last token) and their positions ``start``."""
    lm = StaticLM(model)
    lm.reset(len(prompts), capacity)
    width = max(map(len, prompts))
    padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lm.prefill(padded, torch.zeros(len(prompts), dtype=torch.long))
    return lm, torch.tensor([p[-1] for p in prompts]), torch.tensor([len(p) - 1 for p in prompts])


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def _after(model, tokens: list[int]) -> torch.Tensor:
    """The model's own logits after ``tokens`` (Hugging Face forward, no cache)."""
    return model(torch.tensor([tokens])).logits[0, -1]


def _path(parents: list[int], tokens: list[int], node: int) -> list[int]:
    """The tokens from the root's first child down to ``node``."""
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def _check_nodes(model, prompts, nodes, parents, present, logits) -> None:
    """Row ``b``'s root and present nodes against the model run on prompt + path."""
    for b, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[b, 0], _after(model, prompt), **TOL)
        for j in range(parents.shape[1]):
            if present is None or present[b, j]:
                expected = _after(model, prompt + _path(parents[b].tolist(), nodes[b].tolist(), j))
                torch.testing.assert_close(logits[b, j + 1], expected, **TOL, msg=f"row {b}, node {j}")


def _hand_tree(batch: int, seed: int) -> DraftTree:
    """HAND_PARENTS in every row, random tokens; the last row lacks nodes 3, 5 and 6."""
    tokens = torch.randint(0, VOCAB, (batch, len(HAND_PARENTS)), generator=torch.Generator().manual_seed(seed))
    present = torch.ones(batch, len(HAND_PARENTS), dtype=torch.bool)
    present[-1, [3, 5, 6]] = False
    return DraftTree(tokens, torch.tensor(HAND_PARENTS).expand(batch, -1).clone(), present=present)


def _chains_tree(batch: int, seed: int) -> DraftTree:
    """Three chains of three tokens per row sharing prefixes (merged nodes are absent)."""
    chains = torch.randint(0, VOCAB, (batch, 3, 3), generator=torch.Generator().manual_seed(seed))
    chains[:, 1, :1] = chains[:, 0, :1]  # chain 1 branches off chain 0 after one token
    chains[0, 2, :2] = chains[0, 0, :2]  # row 0's chain 2 after two
    return tree_from_chains(chains, torch.tensor([[3, 3, 3]] + [[3, 2, 1]] * (batch - 1)))


@pytest.mark.parametrize("shape", ["hand", "chains"])
@pytest.mark.parametrize("arch", ARCHS)
def test_each_node_scores_as_the_model_after_its_path(arch, shape):
    """Ragged rows (prompts of 6, 10 and 3 tokens), absent nodes in some rows: the root's and
    every present node's logits equal the Hugging Face model's on prompt + path; the cache
    holds the same context afterwards and nothing new past the root."""
    model = _model(arch)
    prompts = _prompts([6, 10, 3], seed=1)
    lm, roots, start = _prefilled(model, prompts)
    tree = (_hand_tree if shape == "hand" else _chains_tree)(len(prompts), seed=2)
    before = [k.clone() for k in lm.keys]
    logits, scratch = tree_forward(lm, torch.cat([roots[:, None], tree.tokens], 1), tree.parents, start, tree.present)
    assert logits.shape == (3, tree.tokens.shape[1] + 1, VOCAB)
    assert scratch.keys[0].shape == (3, lm.num_kv_heads, tree.tokens.shape[1], lm.head_dim)
    _check_nodes(model, prompts, tree.tokens, tree.parents, tree.present, logits)
    for old, new in zip(before, lm.keys):
        for b in range(3):
            s = int(start[b])
            torch.testing.assert_close(new[b, :, : s + 1], old[b, :, : s + 1], **TOL)  # the root, rewritten
            assert torch.equal(new[b, :, s + 1 :], old[b, :, s + 1 :])  # nodes never touch the cache


def test_a_chain_scores_as_a_chain_forward():
    """A chain (parents j − 1) gives what StaticLM.forward gives fed the root and the drafts."""
    model = _model("llama")
    prompts = _prompts([5, 8], seed=3)
    drafts = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(4))
    tokens = torch.cat([torch.tensor([[p[-1]] for p in prompts]), drafts], 1)
    lm, _, start = _prefilled(model, prompts)
    logits, _ = tree_forward(lm, tokens, torch.arange(-1, 3).expand(2, -1).clone(), start)
    chain, _, _ = _prefilled(model, prompts)
    torch.testing.assert_close(logits, chain.forward(tokens, start), **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_commit_leaves_the_cache_of_the_accepted_chain(arch):
    """Rows keep 4, 2 and 0 nodes of the hand tree; after commit_path the cache up to
    ``start + kept`` equals a chain-fed cache's, and the next forward (two tokens at
    ``start + kept + 1``) equals the model on prompt + kept tokens + those tokens."""
    model = _model(arch)
    prompts = _prompts([7, 4, 9], seed=5)
    lm, roots, start = _prefilled(model, prompts)
    tree = _hand_tree(3, seed=6)
    _, scratch = tree_forward(lm, torch.cat([roots[:, None], tree.tokens], 1), tree.parents, start, tree.present)
    path = torch.full((3, len(HAND_PARENTS)), -1)
    path[0, :4] = torch.tensor([0, 2, 5, 6])
    path[1, :2] = torch.tensor([1, 4])
    kept = torch.tensor([4, 2, 0])
    commit_path(lm, scratch, path, kept, start)
    accepted = [tree.tokens[b, path[b, : kept[b]]].tolist() for b in range(3)]
    chain, _, _ = _prefilled(model, [p + a for p, a in zip(prompts, accepted)])
    for b in range(3):
        end = int(start[b] + kept[b]) + 1
        for ours, theirs in zip(lm.keys + lm.values, chain.keys + chain.values):
            torch.testing.assert_close(ours[b, :, :end], theirs[b, :, :end], **TOL)
    following = torch.randint(0, VOCAB, (3, 2), generator=torch.Generator().manual_seed(7))
    logits = lm.forward(following, start + kept + 1)
    for b in range(3):
        for c in range(2):
            expected = _after(model, prompts[b] + accepted[b] + following[b, : c + 1].tolist())
            torch.testing.assert_close(logits[b, c], expected, **TOL)


def _feature_buffers(lm: StaticLM, counts: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Zeroed feature buffers ``{n: [B, capacity, hidden]}`` over ``lm``'s cache."""
    return {n: torch.zeros(lm.batch, lm.capacity, lm.model.config.hidden_size) for n in counts}


def _chain_features(model, tokens: list[int], counts: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """The features a chain forward of ``tokens`` on a fresh batch-1 cache writes: ``{n: [len, hidden]}``."""
    lm = StaticLM(model)
    lm.reset(1, 64)
    buffers = _feature_buffers(lm, counts)
    lm.forward(torch.tensor([tokens]), torch.zeros(1, dtype=torch.long), hidden_out=buffers)
    return {n: b[0, : len(tokens)] for n, b in buffers.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_features_of_the_root_and_every_node_are_a_chain_forwards(arch):
    """With ``hidden_out`` for several layer counts at once (fused taps: 1 and 2 of 2 layers), over
    ragged rows with absent nodes: the root's features land in the buffer at ``start``, as a chain
    forward writes them; every present node's, kept in the scratch, equal those a chain forward of
    prompt + path writes at the node's position; nothing else in the buffers changes. After
    ``commit_path`` (rows keep 4, 0 and 2 nodes) the buffers up to ``start + kept`` hold a chain
    forward's features of prompt + kept tokens, and nothing past that changed."""
    model, counts = _model(arch), (1, 2)
    prompts = _prompts([6, 10, 3], seed=12)
    lm, roots, start = _prefilled(model, prompts)
    hidden = _feature_buffers(lm, counts)
    width = max(map(len, prompts))
    padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lm.prefill(padded, torch.zeros(3, dtype=torch.long), hidden_out=hidden)
    tree = _hand_tree(3, seed=13)
    before = {n: b.clone() for n, b in hidden.items()}
    _, scratch = tree_forward(lm, torch.cat([roots[:, None], tree.tokens], 1), tree.parents, start, tree.present,
                              hidden_out=hidden)
    _, depth = tree_layout(torch.where(tree.present, tree.parents, -1))
    for b, prompt in enumerate(prompts):
        s = int(start[b])
        for n in counts:
            torch.testing.assert_close(hidden[n][b, s], _chain_features(model, prompt, counts)[n][s], **TOL)
            assert torch.equal(hidden[n][b, :s], before[n][b, :s])
            assert torch.equal(hidden[n][b, s + 1 :], before[n][b, s + 1 :])  # nodes never touch the buffer
        for j in range(len(HAND_PARENTS)):
            if tree.present[b, j]:
                chain = _chain_features(model, prompt + _path(HAND_PARENTS, tree.tokens[b].tolist(), j), counts)
                for n in counts:
                    torch.testing.assert_close(scratch.features[n][b, j], chain[n][s + int(depth[b, j])], **TOL,
                                               msg=f"row {b}, node {j}, {n} layers")
    path = torch.full((3, len(HAND_PARENTS)), -1)
    path[0, :4] = torch.tensor([0, 2, 5, 6])
    path[2, :2] = torch.tensor([1, 4])
    kept = torch.tensor([4, 0, 2])
    written = {n: b.clone() for n, b in hidden.items()}
    commit_path(lm, scratch, path, kept, start)
    for b, prompt in enumerate(prompts):
        end = int(start[b] + kept[b]) + 1
        chain = _chain_features(model, prompt + tree.tokens[b, path[b, : kept[b]]].tolist(), counts)
        for n in counts:
            torch.testing.assert_close(hidden[n][b, :end], chain[n][:end], **TOL)
            assert torch.equal(hidden[n][b, end:], written[n][b, end:])


def test_commit_at_the_end_of_the_cache_writes_nothing_past_it():
    """A row whose kept path ends at the cache's last position: the slots past ``kept`` repeat
    the last kept entry instead of spilling anywhere, and the cache equals a chain-fed one."""
    model = _model("llama")
    capacity = 256  # StaticLM.reset rounds capacities up to a multiple of 256
    prompt = _prompts([capacity - 3], seed=9)[0]
    lm, roots, start = _prefilled(model, [prompt], capacity=capacity)
    tree = DraftTree(torch.tensor([[3, 4, 5, 6, 7]]), torch.tensor([[-1, 0, -1, 1, 2]]))  # depth 3 at node 3
    _, scratch = tree_forward(lm, torch.cat([roots[:, None], tree.tokens], 1), tree.parents, start)
    commit_path(lm, scratch, torch.tensor([[0, 1, 3, -1, -1]]), torch.tensor([2]), start)
    chain, _, _ = _prefilled(model, [prompt + [3, 4]], capacity=capacity)
    end = int(start[0]) + 3
    for ours, theirs in zip(lm.keys, chain.keys):
        torch.testing.assert_close(ours[:, :, :end], theirs[:, :, :end], **TOL)
    commit_path(lm, scratch, torch.tensor([[0, 1, 3, -1, -1]]), torch.tensor([3]), start)  # ends at capacity - 1
    chain, _, _ = _prefilled(model, [prompt + [3, 4, 6]], capacity=capacity)
    for ours, theirs in zip(lm.keys + lm.values, chain.keys + chain.values):
        torch.testing.assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_through_trees_equals_generate(arch):
    """Six steps over a ragged batch of two: each step's tree holds the greedy continuation (cut
    off by a wrong token at a varying depth: 0 to 4 tokens kept) and wrong branches; greedy
    verify_tree and commit_path produce exactly what ``generate(do_sample=False)`` produces."""
    model = _model(arch)
    prompts = _prompts([5, 9], seed=10)
    steps, length = 6, 4
    with torch.no_grad():
        greedy = [model.generate(torch.tensor([p]), do_sample=False,
                                 max_new_tokens=steps * (length + 1))[0, len(p):].tolist() for p in prompts]
    lm, roots, start = _prefilled(model, prompts)
    generator = torch.Generator().manual_seed(11)
    produced: list[list[int]] = [[], []]
    kept_total = 0
    for step in range(steps):
        chains = torch.randint(0, VOCAB, (2, 3, length), generator=generator)  # chain 0: a wrong branch
        for b in range(2):
            truth = torch.tensor(greedy[b][len(produced[b]) : len(produced[b]) + length])
            for chain, cut in ((1, (step + b) % (length + 1)), (2, (2 * step + 3 * b) % (length + 1))):
                chains[b, chain] = truth
                if cut < length:
                    chains[b, chain, cut] = (truth[cut] + 1 + chain) % VOCAB
        tree = tree_from_chains(chains)
        logits, scratch = tree_forward(lm, torch.cat([roots[:, None], tree.tokens], 1), tree.parents, start,
                                       tree.present)
        result = verify_tree(logits, tree, SamplingParams(do_sample=False))
        commit_path(lm, scratch, result.path, result.num_accepted, start)
        kept = result.num_accepted
        for b in range(2):
            produced[b] += result.tokens[b, : int(kept[b]) + 1].tolist()
        kept_total += int(kept.sum())
        roots = result.tokens.gather(1, kept[:, None]).squeeze(1)
        start = start + kept + 1
    for b in range(2):
        assert produced[b] == greedy[b][: len(produced[b])]
    assert kept_total > 0


@st.composite
def _random_trees(draw):
    batch = draw(st.integers(1, 3))
    n = draw(st.integers(1, 8))
    parents = [[draw(st.integers(-1, j - 1)) for j in range(n)] for _ in range(batch)]
    present = []
    for row in parents:  # absent at random, but a present node's parent is present
        flags: list[bool] = []
        for j, parent in enumerate(row):
            flags.append((parent < 0 or flags[parent]) and (j == 0 or draw(st.booleans()) or draw(st.booleans())))
        present.append(flags)
    lengths = [draw(st.integers(1, 12)) for _ in range(batch)]
    return parents, present, lengths, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None)
@given(_random_trees())
def test_random_trees_score_as_chains_on_fresh_caches(case):
    """Hypothesis over batch (1 to 3), node count (1 to 8), parents, absent nodes and ragged
    prompt lengths: each present node's logits equal a chain forward of prompt + path on a fresh
    batch-1 cache; depths follow the parents."""
    parents, present, lengths, seed = case
    model = _model("llama")
    prompts = _prompts(lengths, seed)
    nodes = torch.randint(0, VOCAB, (len(lengths), len(parents[0])), generator=torch.Generator().manual_seed(seed))
    parents_t, present_t = torch.tensor(parents), torch.tensor(present)
    lm, roots, start = _prefilled(model, prompts)
    logits, _ = tree_forward(lm, torch.cat([roots[:, None], nodes], 1), parents_t, start, present_t)
    _, depth = tree_layout(parents_t)
    fresh = StaticLM(model)
    for b, prompt in enumerate(prompts):
        for j in range(-1, len(parents[b])):
            if j >= 0 and not present[b][j]:
                continue
            path = _path(parents[b], nodes[b].tolist(), j)
            assert j < 0 or len(path) == depth[b, j]
            fresh.reset(1, 64)
            chain = fresh.forward(torch.tensor([prompt + path]), torch.zeros(1, dtype=torch.long))
            torch.testing.assert_close(logits[b, j + 1], chain[0, -1], **TOL)


def _bad_inputs():
    roots = torch.tensor([[1]])
    two = torch.tensor([[1, 2, 3]])
    return {
        "not topological": (two, torch.tensor([[1, -1]]), torch.tensor([4]), None, "earlier node"),
        "own parent": (two, torch.tensor([[0, 0]]), torch.tensor([4]), None, "earlier node"),
        "parents shape": (two, torch.tensor([[-1, 0, 1]]), torch.tensor([4]), None, "parents must be"),
        "no nodes": (roots, torch.zeros(1, 0, dtype=torch.long), torch.tensor([4]), None, "tokens must be"),
        "start shape": (two, torch.tensor([[-1, 0]]), torch.tensor([4, 4]), None, "start must be"),
        "batch": (two.expand(2, -1), torch.tensor([[-1, 0]] * 2), torch.tensor([4, 4]), None, "rows"),
        "dtype": (two.float(), torch.tensor([[-1, 0]]), torch.tensor([4]), None, "torch.long"),
        "token id": (torch.tensor([[1, 2, VOCAB]]), torch.tensor([[-1, 0]]), torch.tensor([4]), None, "Token ids"),
        "orphan": (two, torch.tensor([[-1, 0]]), torch.tensor([4]), torch.tensor([[False, True]]), "must be present"),
        "present dtype": (two, torch.tensor([[-1, 0]]), torch.tensor([4]), torch.tensor([[1, 1]]), "present must"),
        "negative start": (two, torch.tensor([[-1, 0]]), torch.tensor([-1]), None, ">= 0"),
        "past capacity": (two, torch.tensor([[-1, 0]]), torch.tensor([254]), None, "capacity"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_trees_are_clear_errors(case):
    tokens, parents, start, present, message = _bad_inputs()[case]
    lm = StaticLM(_model("llama"))
    lm.reset(1, 64)  # capacity 256: depth 2 from 254 is past it
    with pytest.raises(ValueError, match=message):
        tree_forward(lm, tokens, parents, start, present)


def test_bad_commits_and_an_empty_cache_are_clear_errors():
    lm = StaticLM(_model("llama"))
    with pytest.raises(ValueError, match="reset"):
        tree_forward(lm, torch.tensor([[1, 2]]), torch.tensor([[-1]]), torch.tensor([0]))
    lm.reset(1, 64)
    _, scratch = tree_forward(lm, torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="path must be"):
        commit_path(lm, scratch, torch.tensor([[0, 1, -1]]), torch.tensor([2]), torch.tensor([0]))
    with pytest.raises(ValueError, match="kept and start"):
        commit_path(lm, scratch, torch.tensor([[0, 1]]), torch.tensor([[2]]), torch.tensor([0]))
