"""Several n-gram continuations in one draft tree (``NgramDrafter.expand``; SPEC.md §7, "Several n-gram
continuations"): the continuations it finds and their order, repeats removed, the breadth-first
layout cut at the node budget, a valid tree for any history (Hypothesis), greedy output equal to the
target's own on several architectures, and the sampled law (χ², 10,000 samples)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_helpers import ALPHA
from test_tree_decode import ARCHS, NEW, NOISY, PROMPTS, engine, exact_law, hf_greedy, pvalue, sample

from flashspec import TreeExpansion
from flashspec.draft_tree import DraftTree
from flashspec.drafters.base import History
from flashspec.drafters.expansion import candidates
from flashspec.drafters.ngram import NgramDrafter


def history(*rows: list[int], capacity: int = 20) -> History:
    tokens = torch.zeros(len(rows), capacity, dtype=torch.long)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row)
    return History(tokens, torch.tensor([len(r) for r in rows]))


def branches_of(tree, count: int, depth: int) -> list[list[int]]:
    """The breadth-first layout read back as ``count`` chains of ``depth`` tokens (row 0)."""
    flat = tree.tokens[0].tolist()
    return [[flat[d * count + j] for d in range(depth)] for j in range(count)]


def test_the_latest_distinct_continuations_of_the_longest_match_come_first():
    """The context ends in ``1 2``, which ``1 2`` has continued as ``3 9 1``, ``4 1 2`` and ``5 6 1``:
    the latest first (it is what propose drafts), breadth first, each node's parent the node above it."""
    h = history([1, 2, 3, 9, 1, 2, 4, 1, 2, 5, 6, 1, 2])
    drafter = NgramDrafter()
    tree = drafter.expand(h, 3, 3, 9, None)
    assert branches_of(tree, 3, 3) == [[5, 6, 1], [4, 1, 2], [3, 9, 1]]
    assert branches_of(tree, 3, 3)[0] == drafter.propose(h, 3, None, None).tokens[0].tolist()
    assert tree.parents[0].tolist() == [-1, -1, -1, 0, 1, 2, 3, 4, 5]
    assert tree.depths[0].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    cut = drafter.expand(h, 3, 3, 5, None)  # the budget cuts the deepest level first
    assert cut.tokens[0].tolist() == [5, 4, 3, 6, 1] and cut.parents[0].tolist() == [-1, -1, -1, 0, 1]


def test_a_longer_match_outranks_a_later_one_and_repeats_are_removed():
    """``7 1 2`` matched by 3 tokens once (continued ``8``) outranks the later 2-token matches; the
    text ``1 2 5`` repeated twice is one branch, not two; with too few continuations the pending token
    fills in (a guess like any other)."""
    h = history([7, 1, 2, 8, 1, 2, 5, 1, 2, 5, 7, 1, 2])
    tree = NgramDrafter().expand(h, 1, 4, 4, None)
    # 8 (the 3-gram), 5 (the latest 2-gram), the pending 2 (no other match), then the repeated 5 again
    assert tree.tokens[0].tolist() == [8, 5, 2, 5]
    looping = history([4, 4, 4, 4, 4, 4])
    assert NgramDrafter().expand(looping, 2, 2, 4, None).tokens[0].tolist() == [4, 4, 4, 4]


def test_more_nodes_than_topk_chains_hold_take_more_branches():
    h = history([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2])
    tree = NgramDrafter().expand(h, 2, 2, 7, None)  # ⌈7 / 2⌉ = 4 branches
    assert tree.tokens[0].tolist() == [6, 5, 4, 3, 1, 1, 1]
    assert tree.parents[0].tolist() == [-1, -1, -1, -1, 0, 1, 2]


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=18), min_size=1, max_size=3),
       depth=st.integers(1, 4), topk=st.integers(1, 4), pick=st.integers(0, 10**6))
def test_any_history_gives_a_valid_tree_whose_branches_continue_the_text(rows, depth, topk, pick):
    """Hypothesis over batch (1–3), histories, depth (1–4), topk (1–4) and any node budget they allow:
    the tree is valid (checked construction), of exactly the budget's nodes, closed under ancestors
    breadth first, its first branch is propose's chain, and every branch either continues an earlier
    occurrence of a suffix of the context or is the pending token repeated."""
    nodes = 1 + pick % candidates(depth, topk)
    h = history(*rows)
    drafter = NgramDrafter()
    tree = drafter.expand(h, depth, topk, nodes, None)
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (len(rows), nodes)
    DraftTree(tree.tokens, tree.parents)  # parents earlier nodes or the root
    chain = drafter.propose(h, depth, None, None).tokens
    count = max(topk, -(-nodes // depth))
    for b, row in enumerate(rows):
        flat = tree.tokens[b].tolist()
        first = [flat[d * count] for d in range(depth) if d * count < nodes]
        assert first == chain[b, : len(first)].tolist()
        for j in range(min(count, nodes)):
            branch = [flat[d * count + j] for d in range(depth) if d * count + j < nodes]
            texts = [row[s : s + len(branch)] for s in range(1, len(row))]
            assert branch in texts or branch == [row[-1]] * len(branch) or \
                any(t == branch[: len(t)] and all(x == row[-1] for x in branch[len(t):]) for t in texts)


@pytest.mark.parametrize("layout", ["alone", "ragged"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_ngram_continuations_equals_hf_generate(arch, layout):
    """n-gram continuations as a tree (3 branches of 3, 7 nodes) beside a noisy copy and the target
    itself: every row is the target's own greedy continuation, and the n-gram proposes its 7 nodes."""
    e = engine(arch)
    expand = {"ngram": TreeExpansion(3, 7)}
    prompts = [list(p) for p in PROMPTS]
    if layout == "alone":
        outs = [e.generate_tree([p], max_new_tokens=NEW, gammas=[3, 2, 2], expand=expand) for p in prompts]
        got, stats = [o.sequences[0] for o in outs], [o.stats for o in outs]
    else:
        out = e.generate_tree(prompts, max_new_tokens=NEW, gammas=[3, 2, 2], expand=expand)
        got, stats = out.sequences, [out.stats]
    assert got == [hf_greedy(arch, p, NEW) for p in PROMPTS]
    assert all(s.per_drafter["ngram"].proposed == 7 * s.row_steps for s in stats)


@pytest.mark.parametrize("depth, option", [(2, (3, 6)), (1, (3, 3))])
def test_sampled_decoding_with_ngram_continuations_follows_the_target_law(depth, option):
    """χ² (10,000 samples): the n-gram's continuations (depth 2: 3 branches, 6 point-mass nodes; depth 1,
    γ = 1: 3 sibling tokens) tested first, then a noisy copy's drawn chain, T = 0.7 with top-k and top-p."""
    temperature, top_k, top_p = 0.7, 5, 0.9
    out = sample(["ngram", NOISY], [depth, depth], temperature, top_k, top_p, expand_first=TreeExpansion(*option))
    p = pvalue(out, exact_law(temperature, top_k, top_p))
    assert p > ALPHA, f"χ² p-value {p:.2e}: the output law differs from the target's"
    assert all(per.accepted > 0 for per in out.stats.per_drafter.values())
