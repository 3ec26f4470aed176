"""Draft trees (flashspec/draft_tree.py, SPEC.md §2 "Tree verification"): the output law is the
target's whatever made the tree — point masses (top-k expansions, n-gram continuations), tokens
drawn from a drafter's law, mixtures, duplicates across drafters, ragged rows — at T ≠ 1 with
top-k/top-p (χ², ≥ 10,000 samples); greedy takes the longest matching path; a chain is step 4's
rule bit for bit; positions and the attention mask follow the parents; bad trees are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from flashspec.draft_tree import DraftTree, ancestor_mask, depths, merge_chosen, tree_from_chains, verify_tree
from flashspec.sampling import SamplingParams, probabilities
from flashspec.verify import verify

V = 6
SAMPLES = 20_000
ROOT_TOKEN = 0
SAMPLED = SamplingParams(do_sample=True, temperature=0.7, top_k=5, top_p=0.95)
_gen = torch.Generator().manual_seed(0)
TARGET = torch.randn(4, V, V, generator=_gen) * 1.5  # the toy target: logits after (depth, last token)
DRAFT = TARGET + torch.randn(4, V, V, generator=_gen)  # a drafter's logits there: q ≠ p
OTHER = torch.randn(4, V, V, generator=_gen) * 2  # a second drafter (deterministic continuations)


def law(table: torch.Tensor, depth: torch.Tensor, last: torch.Tensor, params: SamplingParams = SAMPLED):
    return probabilities(table[depth, last], params)


class Builder:
    """Grows a batch of trees node by node, each node's token chosen or drawn given its path."""

    def __init__(self, batch: int, seed: int):
        self.batch, self.gen = batch, torch.Generator().manual_seed(seed)
        self.tokens, self.parents, self.laws, self.drawn, self.depth = [], [], [], [], []
        self.parent_laws = []  # the drafter's law at each node's parent, whether or not it drew from it

    def _context(self, parent: int):
        if parent < 0:
            return torch.zeros(self.batch, dtype=torch.long), torch.full((self.batch,), ROOT_TOKEN)
        return self.depth[parent], self.tokens[parent]

    def _add(self, parent: int, token: torch.Tensor, q: torch.Tensor | None) -> int:
        d, _ = self._context(parent)
        self.parent_laws.append(law(DRAFT, *self._context(parent)))
        self.tokens.append(token)
        self.parents.append(torch.full((self.batch,), parent))
        self.laws.append(q if q is not None else torch.zeros(self.batch, V))
        self.drawn.append(torch.full((self.batch,), q is not None))
        self.depth.append(d + 1)
        return len(self.tokens) - 1

    def draw(self, parent: int, table: torch.Tensor = DRAFT) -> int:
        """A child drawn from the drafter's law at the parent's path."""
        q = law(table, *self._context(parent))
        return self._add(parent, torch.multinomial(q, 1, generator=self.gen).squeeze(1), q)

    def top(self, parent: int, rank: int, table: torch.Tensor = DRAFT) -> int:
        """The parent's ``rank``-th most likely child under ``table``: a point mass."""
        logits = table[self._context(parent)]
        return self._add(parent, logits.argsort(dim=-1, descending=True)[:, rank], None)

    def tree(self, present: torch.Tensor | None = None) -> tuple[DraftTree, torch.Tensor]:
        tree = DraftTree(torch.stack(self.tokens, 1), torch.stack(self.parents, 1), torch.stack(self.laws, 1),
                         torch.stack(self.drawn, 1), present)
        root = TARGET[torch.zeros(self.batch, dtype=torch.long), torch.full((self.batch,), ROOT_TOKEN)]
        after = TARGET[torch.stack(self.depth, 1), tree.tokens]  # [B, N, V]
        return tree, torch.cat([root[:, None], after], dim=1)


def topk_tree(b: Builder) -> None:  # EAGLE-2-like: top-2 at each of two levels
    for first in (b.top(-1, 0), b.top(-1, 1)):
        b.top(first, 0)
        b.top(first, 1)


def drawn_tree(b: Builder) -> None:  # independent draws, duplicates among siblings allowed
    for first in (b.draw(-1), b.draw(-1), b.draw(-1)):
        b.draw(first)


def mixed_tree(b: Builder) -> None:  # a drawn chain, another drafter's continuation, top-k; tokens may repeat
    a = b.draw(-1)
    b.draw(a)
    c = b.top(-1, 0, OTHER)
    b.top(c, 0, OTHER)
    d = b.top(-1, 0)  # may equal c's or a's token: tested against the residual all the same
    b.top(d, 1)


def chain_tree(b: Builder) -> None:  # node budget 1 per level: a chain
    a = b.draw(-1)
    b.draw(b.draw(a))


def first_two(result, seed: int) -> torch.Tensor:
    """The output's first two tokens: the step's, the second one drawn from the target's own law
    where the step kept no draft (the next step's first token)."""
    t1 = result.tokens[:, 0]
    nxt = law(TARGET, torch.ones_like(t1), t1)
    t2 = torch.multinomial(nxt, 1, generator=torch.Generator().manual_seed(seed)).squeeze(1)
    return torch.stack([t1, torch.where(result.num_accepted >= 1, result.tokens[:, 1], t2)], dim=1)


def exact_pairs() -> np.ndarray:
    p0 = law(TARGET, torch.tensor(0), torch.tensor(ROOT_TOKEN)).double()
    p1 = law(TARGET, torch.ones(V, dtype=torch.long), torch.arange(V)).double()  # [V, V]
    joint = (p0[:, None] * p1).numpy()
    return joint / joint.sum()


def chi2_pvalue(pairs: torch.Tensor) -> float:
    expected = exact_pairs().ravel() * len(pairs)
    observed = np.bincount((pairs[:, 0] * V + pairs[:, 1]).numpy(), minlength=V * V).astype(float)
    assert observed[expected == 0].sum() == 0  # nothing the target could not have written
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep]).pvalue)


def run_tree(shape, seed: int, ragged: bool = False):
    b = Builder(SAMPLES, seed)
    shape(b)
    present = None
    if ragged:  # each row drops its own random set of leaves
        n = len(b.tokens)
        parents = torch.stack(b.parents, 1)
        children = torch.zeros(SAMPLES, n, dtype=torch.long).scatter_add(1, parents.clamp(min=0), (parents >= 0).long())
        is_leaf = children == 0
        drop = torch.rand(SAMPLES, n, generator=torch.Generator().manual_seed(seed + 1)) < 0.5
        present = ~(is_leaf & drop)
    tree, logits = b.tree(present)
    uniforms = torch.rand(SAMPLES, tree.tokens.shape[1] + 1, generator=torch.Generator().manual_seed(seed + 2))
    return tree, verify_tree(logits, tree, SAMPLED, uniforms)


@pytest.mark.parametrize("shape", [topk_tree, drawn_tree, mixed_tree, chain_tree])
def test_the_output_law_is_the_targets(shape):
    tree, result = run_tree(shape, seed=11)
    assert chi2_pvalue(first_two(result, seed=12)) > 1e-3
    assert result.num_accepted.float().mean() > 0.3  # the trees do get drafts accepted


def test_ragged_rows_keep_the_law():
    tree, result = run_tree(mixed_tree, seed=21, ragged=True)
    assert chi2_pvalue(first_two(result, seed=22)) > 1e-3
    on_path = result.path.clamp(min=0)
    assert bool(tree.present.gather(1, on_path)[result.path >= 0].all())  # absent nodes are never kept


def test_top_k_siblings_tested_against_their_law_would_bias_the_output():
    """Why point masses: top-k tokens are not draws from q; labelled as drawn from it, the test
    min(1, p/q) on them writes a different law, and χ² sees it (the test can fail)."""
    b = Builder(SAMPLES, 31)
    topk_tree(b)
    tree, logits = b.tree()
    wrong = DraftTree(tree.tokens, tree.parents, torch.stack(b.parent_laws, 1), torch.ones_like(tree.drawn))
    uniforms = torch.rand(SAMPLES, 7, generator=torch.Generator().manual_seed(32))
    assert chi2_pvalue(first_two(verify_tree(logits, wrong, SAMPLED, uniforms), seed=33)) < 1e-6
    assert chi2_pvalue(first_two(verify_tree(logits, tree, SAMPLED, uniforms), seed=33)) > 1e-3


@pytest.mark.parametrize("drawn", [True, False])
def test_a_chain_is_step_4_bit_for_bit(drawn):
    gen = torch.Generator().manual_seed(41)
    batch, k = 257, 4
    logits = torch.randn(batch, k + 1, V, generator=gen) * 2
    q = torch.softmax(torch.randn(batch, k, V, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(batch, k)
    uniforms = torch.rand(batch, k + 1, generator=gen)
    parents = torch.arange(-1, k - 1).expand(batch, k).clone()
    tree = DraftTree(drafts, parents, q if drawn else None, torch.ones(batch, k, dtype=torch.bool) if drawn else None)
    for params in (SAMPLED, SamplingParams()):
        chain = verify(logits, drafts, q if drawn else None, params, uniforms, backend="reference")
        walked = verify_tree(logits, tree, params, uniforms)
        assert torch.equal(walked.num_accepted, chain.num_accepted)
        assert torch.equal(walked.tokens, chain.tokens)


def _random_tree(data, batch: int, n: int) -> torch.Tensor:
    return torch.tensor([[data.draw(st.integers(-1, j - 1)) for j in range(n)] for _ in range(batch)])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), n=st.integers(1, 7), vocab=st.integers(2, 5))
def test_greedy_takes_the_longest_matching_path(data, batch, n, vocab):
    parents = _random_tree(data, batch, n)
    tokens = torch.tensor([[data.draw(st.integers(0, vocab - 1)) for _ in range(n)] for _ in range(batch)])
    logits = torch.tensor([[[data.draw(st.floats(-3, 3)) for _ in range(vocab)] for _ in range(n + 1)]
                           for _ in range(batch)])
    result = verify_tree(logits, DraftTree(tokens, parents), SamplingParams())
    for b in range(batch):
        current, path = -1, []
        while True:  # brute force: the first child in order that is the greedy token
            best = int(logits[b, current + 1].argmax())
            child = next((j for j in range(n) if parents[b, j] == current and tokens[b, j] == best), None)
            if child is None:
                break
            path.append(child)
            current = child
        assert int(result.num_accepted[b]) == len(path)
        assert result.path[b].tolist() == path + [-1] * (n - len(path))
        assert result.tokens[b].tolist() == [int(tokens[b, j]) for j in path] + [best] + [-1] * (n - len(path))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), n=st.integers(1, 8))
def test_positions_and_mask_follow_the_parents(data, batch, n):
    parents = _random_tree(data, batch, n)
    got_depths, mask = depths(parents), ancestor_mask(parents)
    for b in range(batch):
        for i in range(n):
            chain, j = {i}, int(parents[b, i])
            while j >= 0:
                chain.add(j)
                j = int(parents[b, j])
            assert int(got_depths[b, i]) == len(chain)
            assert {j for j in range(n) if mask[b, i, j]} == chain


@settings(max_examples=40, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_sampled_results_are_paths_of_the_tree(data, batch, n, seed):
    parents = _random_tree(data, batch, n)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (batch, n), generator=gen)
    laws = torch.softmax(torch.randn(batch, n, V, generator=gen), -1)
    drawn = torch.rand(batch, n, generator=gen) < 0.5
    logits = torch.randn(batch, n + 1, V, generator=gen)
    uniforms = torch.rand(batch, n + 1, generator=gen)
    result = verify_tree(logits, DraftTree(tokens, parents, laws, drawn), SAMPLED, uniforms)
    p = probabilities(logits, SAMPLED)
    for b in range(batch):
        kept = int(result.num_accepted[b])
        path = result.path[b, :kept].tolist()
        assert all(j >= 0 for j in path) and result.path[b, kept:].eq(-1).all()
        assert [int(parents[b, j]) for j in path] == ([-1] + path[:-1] if path else [])
        assert result.tokens[b, :kept].tolist() == [int(tokens[b, j]) for j in path]
        new = int(result.tokens[b, kept])
        assert p[b, (path[-1] + 1) if path else 0, new] > 0  # the new token is one the target could write
        assert result.tokens[b, kept + 1:].eq(-1).all()


@pytest.mark.parametrize("build, message", [
    (lambda: DraftTree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-1, 1]])), "earlier node"),
    (lambda: DraftTree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-1, -3]])), "earlier node"),
    (lambda: DraftTree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-1]])), r"\[B, N\]"),
    (lambda: DraftTree(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long)), "at least one"),
    (lambda: DraftTree(torch.zeros(1, 1), torch.tensor([[-1]])), "torch.long"),
    (lambda: DraftTree(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[-1]]), torch.ones(1, 1, V)), "together"),
    (lambda: DraftTree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-1, 0]]),
                       present=torch.tensor([[False, True]])), "parent must be present"),
    (lambda: DraftTree(torch.tensor([[-1]]), torch.tensor([[-1]])), ">= 0"),
    (lambda: DraftTree(torch.tensor([[V]]), torch.tensor([[-1]]), torch.ones(1, 1, V), torch.tensor([[True]])),
     "below the laws' vocabulary size"),
])
def test_bad_trees_are_clear_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_logits_and_uniforms_of_the_wrong_shape_are_clear_errors():
    tree = DraftTree(torch.zeros(2, 3, dtype=torch.long), torch.tensor([[-1, 0, 0]] * 2))
    with pytest.raises(ValueError, match=r"target_logits must be \[B, N \+ 1, V\]"):
        verify_tree(torch.zeros(2, 3, V), tree, SamplingParams())
    with pytest.raises(ValueError, match=r"uniforms of shape \[2, 4\]"):
        verify_tree(torch.zeros(2, 4, V), tree, SAMPLED, torch.rand(2, 3))
    drawn = DraftTree(tree.tokens, tree.parents, torch.full((2, 3, V + 1), 1 / (V + 1)), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="share one vocabulary"):
        verify_tree(torch.zeros(2, 4, V), drawn, SAMPLED, torch.rand(2, 4))


def _chain(table: torch.Tensor, first_rank: int, length: int, batch: int) -> torch.Tensor:
    """A drafter's chosen continuation: its ``first_rank``-th token after the root, then its greedy tokens."""
    token = table[0, ROOT_TOKEN].argsort(descending=True)[first_rank].expand(batch)
    out = [token]
    for d in range(1, length):
        out.append(table[d, out[-1]].argmax(dim=-1))
    return torch.stack(out, dim=1)


def test_chains_from_several_drafters_make_one_tree_with_the_targets_law():
    length = 3
    chains = torch.stack([_chain(DRAFT, 0, length, SAMPLES), _chain(OTHER, 0, length, SAMPLES),
                          _chain(DRAFT, 1, length, SAMPLES), _chain(TARGET, 0, length, SAMPLES)], dim=1)
    lengths = torch.randint(0, length + 1, (SAMPLES, 4), generator=torch.Generator().manual_seed(51))
    tree = tree_from_chains(chains, lengths)
    node_depth = torch.arange(length).repeat(4)[None].expand(SAMPLES, -1) + 1
    root = TARGET[0, ROOT_TOKEN].expand(SAMPLES, 1, V)
    logits = torch.cat([root, TARGET[node_depth, tree.tokens]], dim=1)
    uniforms = torch.rand(SAMPLES, tree.tokens.shape[1] + 1, generator=torch.Generator().manual_seed(52))
    result = verify_tree(logits, tree, SAMPLED, uniforms)
    assert chi2_pvalue(first_two(result, seed=53)) > 1e-3
    greedy = verify_tree(logits, tree, SamplingParams())
    best = torch.zeros(SAMPLES, dtype=torch.long)  # greedy: the longest prefix of any chain the target agrees with
    for i in range(4):
        agree = torch.ones(SAMPLES, dtype=torch.bool)
        context = torch.full((SAMPLES,), ROOT_TOKEN)
        run = torch.zeros(SAMPLES, dtype=torch.long)
        for d in range(length):
            agree &= (chains[:, i, d] == TARGET[d, context].argmax(-1)) & (d < lengths[:, i])
            run += agree.long()
            context = chains[:, i, d]
        best = torch.maximum(best, run)
    assert torch.equal(greedy.num_accepted, best)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), m=st.integers(1, 4), length=st.integers(1, 4),
       vocab=st.integers(1, 3))
def test_a_tree_of_chains_holds_each_chain_once(data, batch, m, length, vocab):
    chains = torch.tensor([[[data.draw(st.integers(0, vocab - 1)) for _ in range(length)] for _ in range(m)]
                           for _ in range(batch)])
    lengths = torch.tensor([[data.draw(st.integers(0, length)) for _ in range(m)] for _ in range(batch)])
    tree = tree_from_chains(chains, lengths)
    assert tree.tokens.shape == (batch, m * length)
    for b in range(batch):
        present = [j for j in range(m * length) if tree.present[b, j]]
        children: dict[int, list[int]] = {}
        for j in present:
            children.setdefault(int(tree.parents[b, j]), []).append(int(tree.tokens[b, j]))
        assert all(len(set(ts)) == len(ts) for ts in children.values())  # one node per token under a parent
        prefixes = {tuple(chains[b, i, :d + 1].tolist()) for i in range(m) for d in range(int(lengths[b, i]))}
        assert len(present) == len(prefixes)  # one node per distinct prefix
        for i in range(m):  # every chain is a path of present nodes
            node = -1
            for d in range(int(lengths[b, i])):
                node = next(j for j in present if int(tree.parents[b, j]) == node
                            and int(tree.tokens[b, j]) == int(chains[b, i, d]))


def test_bad_chains_are_clear_errors():
    with pytest.raises(ValueError, match=r"\[B, M, L\]"):
        tree_from_chains(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one chain"):
        tree_from_chains(torch.zeros(2, 0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="lengths must be"):
        tree_from_chains(torch.zeros(2, 1, 3, dtype=torch.long), torch.tensor([[4], [1]]))


# ---------------------------------------------------------------------------------- construction and merging
FIELDS = ("tokens", "parents", "laws", "drawn", "present")


def _valid_tree(data, batch: int, n: int, vocab: int, seed: int, laws: bool, ragged: bool):
    """Random valid tree tensors: parents earlier, a present node's parent present, drawn laws."""
    parents = _random_tree(data, batch, n)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
    present = None
    if ragged:
        present = torch.ones(batch, n, dtype=torch.bool)
        for j in range(n):
            above = present.gather(1, parents[:, j : j + 1].clamp(min=0)).squeeze(1) | (parents[:, j] < 0)
            present[:, j] = above & (torch.rand(batch, generator=gen) < 0.8)
    q = torch.softmax(torch.randn(batch, n, vocab, generator=gen), -1) if laws else None
    drawn = torch.rand(batch, n, generator=gen) < 0.5 if laws else None
    return tokens, parents, q, drawn, present


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), n=st.integers(1, 7), vocab=st.integers(1, 5), laws=st.booleans(),
       ragged=st.booleans(), seed=st.integers(0, 2**16))
def test_unchecked_trees_equal_checked_ones(data, batch, n, vocab, laws, ragged, seed):
    """On a valid tree ``DraftTree.unchecked`` holds the very tensors the checked constructor holds, so
    the walk reads them alike (greedy and sampled); ``tree_from_chains(check=False)`` equals the checked
    one. The unchecked constructor checks nothing (it takes a tree the checked one refuses)."""
    fields = _valid_tree(data, batch, n, vocab, seed, laws, ragged)
    checked, unchecked = DraftTree(*fields), DraftTree.unchecked(*fields)
    assert all(getattr(checked, f) is getattr(unchecked, f) for f in FIELDS)
    assert unchecked == checked and isinstance(unchecked, DraftTree)
    gen = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(batch, n + 1, vocab, generator=gen)
    uniforms = torch.rand(batch, n + 1, generator=gen)
    for params in (SamplingParams(), SAMPLED):
        a, b = verify_tree(logits, checked, params, uniforms), verify_tree(logits, unchecked, params, uniforms)
        assert torch.equal(a.path, b.path) and torch.equal(a.tokens, b.tokens)
    chains = fields[0][:, None].expand(batch, 2, n) % torch.tensor([1, 2])[None, :, None]
    lengths = torch.tensor([[n, n // 2]]).expand(batch, 2)
    for a, b in [(tree_from_chains(chains, lengths), tree_from_chains(chains, lengths, check=False)),
                 (tree_from_chains(chains), tree_from_chains(chains, check=False))]:
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "present"))
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree(fields[0], torch.full_like(fields[1], n))
    DraftTree.unchecked(fields[0], torch.full_like(fields[1], n))


def _node_keys(tokens: list[int], parents: list[int], present: list[bool], drawn: list[bool]) -> list:
    """What identifies a node after merging: a drawn node is itself; a chosen one is its parent's key
    and its token. None for an absent node."""
    keys: list = []
    for j, (token, parent) in enumerate(zip(tokens, parents)):
        if not present[j]:
            keys.append(None)
            continue
        above = keys[parent] if parent >= 0 else "root"
        keys.append(("drawn", j) if drawn[j] else (above, token))
    return keys


@settings(max_examples=80, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), n=st.integers(1, 8), vocab=st.integers(1, 3), laws=st.booleans(),
       ragged=st.booleans(), seed=st.integers(0, 2**16))
def test_merging_chosen_siblings_keeps_every_path_once(data, batch, n, vocab, laws, ragged, seed):
    """``merge_chosen``: a valid tree (the checked constructor takes it) whose present nodes are the
    original's distinct nodes — one per chosen token path, every drawn node kept — each standing where
    the original's were, with the same tokens; greedy, the walk keeps the longest path of the target's
    greedy tokens, at least as long as on the original tree (the target's logits a function of the path:
    depth and last token)."""
    tokens, parents, q, drawn, present = _valid_tree(data, batch, n, vocab, seed, laws, ragged)
    tree = DraftTree(tokens, parents, q, drawn, present)
    merged = merge_chosen(tree)
    DraftTree(merged.tokens, merged.parents, merged.laws, merged.drawn, merged.present)  # valid
    assert torch.equal(merged.tokens, tokens)
    flags = (present if present is not None else torch.ones_like(tokens, dtype=torch.bool)).tolist()
    is_drawn = drawn.tolist() if drawn is not None else [[False] * n] * batch
    for b in range(batch):
        before = _node_keys(tokens[b].tolist(), parents[b].tolist(), flags[b], is_drawn[b])
        after = _node_keys(tokens[b].tolist(), merged.parents[b].tolist(), merged.present[b].tolist(), is_drawn[b])
        kept = [k for k in after if k is not None]
        assert len(kept) == len(set(kept)) == len({k for k in before if k is not None})
        assert all(k in kept for k in before if k is not None)
        for j in range(n):  # a merged node's key is the first node's with it
            if flags[b][j] and not merged.present[b, j]:
                assert before[j] in after[:j]
    table = torch.randn(n + 1, vocab, vocab, generator=torch.Generator().manual_seed(seed))
    depth = depths(tree.parents)
    logits = torch.cat([table[0, 0].expand(batch, 1, vocab), table[depth, tokens]], dim=1)
    greedy = SamplingParams()
    if q is None:
        plain, joined = verify_tree(logits, tree, greedy), verify_tree(logits, merged, greedy)
        assert bool((joined.num_accepted >= plain.num_accepted).all())
        for b in range(batch):  # brute force: the deepest present node on the greedy path
            best, on = 0, {}
            for j in range(n):
                parent = int(parents[b, j])
                above = on.get(parent, False) if parent >= 0 else True
                context = table[int(depth[b, parent]), int(tokens[b, parent])] if parent >= 0 else table[0, 0]
                on[j] = bool(flags[b][j] and above and int(tokens[b, j]) == int(context.argmax()))
                best = max(best, int(depth[b, j]) if on[j] else 0)
            assert int(joined.num_accepted[b]) == best


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), m=st.integers(1, 4), length=st.integers(1, 4),
       vocab=st.integers(1, 3))
def test_merging_chains_is_tree_from_chains(data, batch, m, length, vocab):
    """Chains laid out as ``tree_from_chains`` lays them (chain ``i``'s token ``d`` at node ``i·L + d``,
    under node ``i·L + d − 1``) and merged: the tree ``tree_from_chains`` builds, node for node."""
    chains = torch.tensor([[[data.draw(st.integers(0, vocab - 1)) for _ in range(length)] for _ in range(m)]
                           for _ in range(batch)])
    lengths = torch.tensor([[data.draw(st.integers(0, length)) for _ in range(m)] for _ in range(batch)])
    expected = tree_from_chains(chains, lengths)
    real = (torch.arange(length)[None, None] < lengths[..., None]).reshape(batch, m * length)
    node = torch.arange(m * length)
    chain_parents = torch.where(node % length == 0, -1, node - 1).expand(batch, -1)
    laid = DraftTree(chains.reshape(batch, -1), torch.where(real, chain_parents, -1), present=real)
    merged = merge_chosen(laid)
    assert torch.equal(merged.present, expected.present)
    assert torch.equal(merged.parents, expected.parents)
