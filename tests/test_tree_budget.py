"""Choosing a draft tree's node budget from full information (flashspec/select/tree_budget.py,
``generate_tree(gammas="auto")``; SPEC.md §7, "Choosing the tree's node budget from full
information"): the allocator alone on synthetic streams — it converges, follows a change of domain,
keeps contexts apart, runs the target alone where drafting loses, always answers a valid allocation
and is deterministic — full information against bandit feedback on the same stream, and in the
engine: exact greedy output, what it learns, drafters left out that catch up, sampled runs, errors."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, noisy_copy, tiny_model

import flashspec
from flashspec.drafters.model import ModelDrafter
from flashspec.select import Observation, ThompsonSelector, UCB1Selector
from flashspec.select.tree_budget import TreeBudget


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads on a busy 2-core machine (as test_greedy.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------- a synthetic stream
class World:
    """Synthetic tree steps. Drafter ``i`` matches each next committed token with probability
    ``alphas[i]``, independently (its would-be accepted length is geometric, cut at its γ); a step
    costs ``verify[0] + verify[1]·N`` seconds plus ``fixed[i] + per_token[i]·γ_i`` per drafter that
    runs, each with 5 % gaussian noise."""

    def __init__(self, alphas, fixed, per_token, verify=(1.0, 0.05), rows=1, seed=0):
        self.alphas, self.fixed, self.per_token, self.verify, self.rows = list(alphas), fixed, per_token, verify, rows
        self.rng = random.Random(seed)

    def drafting(self, allocation):
        return [self.fixed[i] + self.per_token[i] * g if g else 0.0 for i, g in enumerate(allocation)]

    def mean_seconds(self, allocation):
        return self.verify[0] + self.verify[1] * sum(allocation) + sum(self.drafting(allocation))

    def mean_tokens(self, allocation):
        total = 1.0
        for d in range(1, max(allocation) + 1):
            miss = 1.0
            for a, g in zip(self.alphas, allocation):
                miss *= 1 - a**d if g >= d else 1.0
            total += 1 - miss
        return total

    def rate(self, allocation):
        return self.mean_tokens(allocation) / self.mean_seconds(allocation)

    def step(self, allocation):
        """``(lengths, taken, seconds, drafting)`` of one greedy step, as the tree loop reports them."""
        lengths, taken = [[] for _ in allocation], []
        for _ in range(self.rows):
            longest = 0
            for i, (a, g) in enumerate(zip(self.alphas, allocation)):
                p = 0
                while p < g and self.rng.random() < a:
                    p += 1
                lengths[i].append(p if g else -1)
                longest = max(longest, p if g else 0)
            taken.append(longest + 1)  # the longest matching chain, then the target's own token

        def jitter(s):
            return max(s * (1 + 0.05 * self.rng.gauss(0, 1)), 0.0)

        drafting = [jitter(s) for s in self.drafting(allocation)]
        seconds = max(jitter(self.verify[0] + self.verify[1] * sum(allocation)), 1e-3) + sum(drafting)
        return lengths, taken, seconds, drafting


def feed(world, budget, steps, context=None):
    """``steps`` steps of ``world`` chosen by ``budget`` and fed back to it; the choices."""
    chosen = []
    for _ in range(steps):
        allocation = budget.choose(context)
        budget.observe(allocation, *world.step(allocation), context=context)
        chosen.append(allocation)
    return chosen


def feed_bandit(world, candidates, selector, steps):
    """The bandit baseline: ``selector`` over the same candidate allocations, told only the chosen
    allocation's outcome (tokens and seconds: throughput), never what the other drafters would have had."""
    chosen = []
    for _ in range(steps):
        arm = selector.select()
        allocation = candidates[arm]
        _, taken, seconds, _ = world.step(allocation)
        accepted = sum(t - 1 for t in taken)
        selector.update(arm, Observation(accepted, sum(allocation) * len(taken), sum(taken), seconds))
        chosen.append(allocation)
    return chosen


def reach(chosen, best, window=20, share=0.8):
    """The first step from which the best allocation is chosen, and chosen in at least ``share`` of
    the ``window`` steps from there (exploration steps allowed); None if never."""
    for t in range(len(chosen) - window + 1):
        if chosen[t] == best and sum(c == best for c in chosen[t : t + window]) >= share * window:
            return t
    return None


# Three drafters: a good one of moderate cost, a cheap weak one, a costly useless one.
COMPARED = {"alphas": (0.9, 0.4, 0.05), "fixed": (0.2, 0.02, 0.4), "per_token": (0.05, 0.0, 0.1)}


def compare(seed=0, steps=600, gamma_max=(4, 4, 4)):
    """Full information against bandit feedback on one stream: per learner, the step it reaches the
    best allocation (``reach``) and its efficiency, the expected tokens per second of its choices
    over the best allocation's."""
    candidates = TreeBudget(gamma_max).candidates
    world = World(**COMPARED)
    best = max(candidates, key=world.rate)
    learners = {"full information": lambda w: feed(w, TreeBudget(gamma_max), steps),
                "thompson (bandit)": lambda w: feed_bandit(w, candidates, ThompsonSelector(len(candidates), seed=seed),
                                                           steps),
                "ucb1 (bandit)": lambda w: feed_bandit(w, candidates, UCB1Selector(len(candidates), seed=seed), steps)}
    out = {}
    for name, learn in learners.items():
        world = World(**COMPARED, seed=seed)
        chosen = learn(world)
        rate = sum(map(world.mean_tokens, chosen)) / sum(map(world.mean_seconds, chosen))
        out[name] = {"reach": reach(chosen, best), "efficiency": rate / world.rate(best)}
    return best, out


# ---------------------------------------------------------------------------------- the allocator alone
def test_it_converges_to_the_drafter_that_is_accepted_at_its_gamma_max():
    """A accepts almost everything, B nothing: within 30 steps the best allocation is A alone at its
    γ_max, and every step runs A at its γ_max, B only on exploration steps."""
    world = World(alphas=(0.98, 0.0), fixed=(0.1, 0.1), per_token=(0.05, 0.05))
    budget = TreeBudget([5, 3])
    feed(world, budget, 30)
    assert budget.best() == (5, 0)
    later = feed(world, budget, 50)
    assert all(a[0] == 5 for a in later)
    assert sum(a == (5, 0) for a in later) >= 0.85 * len(later)
    assert budget.survival(0)[-1] > 0.8
    assert budget.survival(1)[0] < 0.1


@pytest.mark.parametrize("seed", range(5))
def test_a_change_of_domain_is_followed_within_40_steps(seed):
    """A good then B good, in one context: within 40 steps of the change the best allocation is B
    alone at its γ_max, and stays so."""
    world = World(alphas=(0.95, 0.0), fixed=(0.1, 0.1), per_token=(0.05, 0.05), seed=seed)
    budget = TreeBudget([4, 4])
    feed(world, budget, 60)
    assert budget.best() == (4, 0)
    world.alphas = [0.0, 0.95]
    bests = []
    for _ in range(80):
        feed(world, budget, 1)
        bests.append(budget.best())
    followed = next(t for t in range(len(bests)) if all(b == (0, 4) for b in bests[t:]))
    assert followed <= 40


def test_each_context_gets_its_own_allocation():
    """Two contexts, interleaved step by step: where A is the good drafter A is chosen, where B is, B."""
    worlds = {"code": World(alphas=(0.9, 0.05), fixed=(0.1, 0.1), per_token=(0.05, 0.05), seed=1),
              "chat": World(alphas=(0.05, 0.9), fixed=(0.1, 0.1), per_token=(0.05, 0.05), seed=2)}
    budget = TreeBudget([4, 4])
    for _ in range(60):
        for context, world in worlds.items():
            feed(world, budget, 1, context)
    assert budget.best("code") == (4, 0)
    assert budget.best("chat") == (0, 4)
    assert budget.steps("code") == budget.steps("chat") == 60
    assert budget.steps(None) == 0  # the shared context saw nothing


def test_the_target_alone_where_drafting_loses_while_still_exploring():
    """No drafter is ever accepted and drafting costs more than a target step: after its first steps
    the allocator runs the target alone on at least 7 steps in 8, and still runs each drafter now and
    then (the exploration steps, one in ``explore_every``)."""
    world = World(alphas=(0.0, 0.0), fixed=(0.5, 0.8), per_token=(0.2, 0.1))
    budget = TreeBudget([4, 4])
    chosen = feed(world, budget, 200)[10:]
    alone = sum(a == (0, 0) for a in chosen)
    assert alone >= 0.85 * len(chosen)
    assert all(sum(a[i] > 0 for a in chosen) >= 5 for i in range(2))  # each drafter measured again and again
    assert budget.best() == (0, 0)


def test_the_counts_follow_the_formula():
    """One step by hand: drafter 0 at γ 3 over three rows — matched 3 of 4 committed, 1 of 2, and 1 of
    1 committed (cut short: depths 2–3 unobserved); drafter 1 left out. The survival is the product
    of the hazards (w·H + reached) / (w + at risk), H the long-run hazard, and the left-out drafter
    keeps its prior."""
    budget = TreeBudget([3, 2], cost=lambda a: 1.0)
    budget.observe((3, 0), [[3, 1, 1], [-1, -1, -1]], [4, 2, 1], 1.0)
    # depth 1: at risk 3, reached 3; depth 2: at risk 2 (the cut row is unobserved), reached 1;
    # depth 3: at risk 1, reached 1.
    w, expected, s = 2.0, [], 1.0
    for reached, at_risk in [(3, 3), (1, 2), (1, 1)]:
        long_run = (1 + reached) / (2 + at_risk)
        s *= (w * long_run + reached) / (w + at_risk)
        expected.append(s)
    assert budget.survival(0) == pytest.approx(expected)
    assert budget.survival(1) == pytest.approx([0.5, 0.25])
    # 1 + E[max] under independence, the left-out drafter's curve at its prior
    both = 1 + sum(1 - (1 - a) * (1 - b) for a, b in zip(expected, [0.5, 0.25])) + expected[2]
    assert budget.expected_tokens((3, 2)) == pytest.approx(both)
    assert budget.expected_tokens((0, 0)) == 1.0


def test_the_cost_model_learns_step_times():
    """Seconds per node count less the proposals (median of recent steps), plus each drafter's
    proposal at its γ; a node count never measured lies on the line through the measured ones."""
    budget = TreeBudget([4, 4])
    for _ in range(3):
        budget.observe((4, 0), [[2], [-1]], [3], 1.5, [0.3, 0.0])
        budget.observe((4, 4), [[2], [0]], [3], 2.1, [0.3, 0.2])
        budget.observe((0, 0), [[-1], [-1]], [1], 1.0)
    assert budget.seconds((4, 0)) == pytest.approx(1.5)
    assert budget.seconds((4, 4)) == pytest.approx(2.1)
    assert budget.seconds((0, 0)) == pytest.approx(1.0)
    # V(0) = 1.0, V(4) = 1.2, V(8) = 1.6: V(2) on their least-squares line; drafter 1 measured at 4 only,
    # so at 2 it costs half as much
    points = [(0, 1.0), (4, 1.2), (8, 1.6)]
    mx, my = 4, sum(y for _, y in points) / 3
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    line = my + slope * (2 - mx)
    assert budget.seconds((0, 2)) == pytest.approx(line + 0.2 * 2 / 4)


def test_node_counts_follow_the_expansion():
    """An expanded drafter's part is min(nodes, topk + (γ − 1)·topk²) nodes at depth γ, and the cost
    model's buckets are keyed by the tree's node count, not by Σγ."""
    budget = TreeBudget([4, 3])
    assert budget.node_count((2, 3)) == 5
    budget.expand({0: (2, 5)})
    assert [budget.nodes_at(0, g) for g in range(5)] == [0, 2, 5, 5, 5]
    assert budget.node_count((1, 0)) == 2 and budget.node_count((4, 3)) == 8 and budget.node_count((0, 2)) == 2
    for _ in range(3):
        budget.observe((2, 1), [[1], [0]], [2], 1.4, [0.2, 0.1])  # 6 nodes: V(6) = 1.1
        budget.observe((0, 0), [[-1], [-1]], [1], 1.0)
    assert budget.seconds((2, 1)) == pytest.approx(1.4)
    # (4, 1) is 5 + 1 = 6 nodes too: V(6) = 1.1, drafter 0 at 4 from its one γ (0.2 · 4 / 2), drafter 1 at 1
    assert budget.seconds((4, 1)) == pytest.approx(1.1 + 0.4 + 0.1)
    budget.expand({})
    assert budget.node_count((4, 3)) == 7
    for bad, message in [({5: (2, 2)}, "drafter index"), ({0: (0, 2)}, "topk"), ({0: (2, 0)}, "nodes"),
                         ({0: 3}, "a pair")]:
        with pytest.raises(ValueError, match=message):
            budget.expand(bad)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_stream_gives_valid_and_deterministic_choices(data):
    """Hypothesis over the number of drafters (1–3), their γ_max (1–6), rows, contexts and random
    count streams (any would-be lengths the loop can report, learned or fixed costs): every choice
    is a valid allocation, the best one a candidate, exploration raises one drafter to its γ_max, and
    two allocators fed the same history choose the same."""
    m = data.draw(st.integers(1, 3), label="drafters")
    gamma_max = data.draw(st.lists(st.integers(1, 6), min_size=m, max_size=m), label="gamma_max")
    rows = data.draw(st.integers(1, 3), label="rows")
    fixed_cost = data.draw(st.booleans(), label="fixed cost")
    options = {"cost": (lambda a: 1.0 + 0.1 * sum(a))} if fixed_cost else {}
    budgets = [TreeBudget(gamma_max, **options), TreeBudget(gamma_max, **options)]
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        context = data.draw(st.sampled_from([None, "a", ("b", 1)]))
        chosen = [b.choose(context) for b in budgets]
        best = budgets[0].best(context)
        assert chosen[0] == chosen[1] and best == budgets[1].best(context)
        allocation = chosen[0]
        assert len(allocation) == m and all(0 <= g <= top for g, top in zip(allocation, gamma_max))
        assert best in budgets[0].candidates
        raised = [i for i, (a, b) in enumerate(zip(allocation, best)) if a != b]
        assert budgets[0].steps(context) == 0 or len(raised) <= 1
        assert all(allocation[i] == gamma_max[i] for i in raised)
        taken = [data.draw(st.integers(0, max(allocation) + 1)) for _ in range(rows)]
        lengths = [[data.draw(st.integers(-1, min(g, t))) if g else -1 for t in taken] for g in allocation]
        seconds = data.draw(st.floats(1e-4, 10.0))
        drafting = [data.draw(st.floats(0.0, seconds)) if g else 0.0 for g in allocation]
        for b in budgets:
            b.observe(allocation, lengths, taken, seconds, drafting, context)


def test_full_information_reaches_the_best_allocation_before_bandit_feedback():
    """On one stream (fixed seed), the allocator told every drafter's would-be accepted length reaches
    the best allocation within a few steps, while bandits over the same candidate allocations, told
    only the chosen allocation's tokens and seconds, take hundreds of steps or do not get there in
    600; its choices are also the fastest."""
    best, result = compare(seed=0, steps=600)
    print(f"best allocation {best}:", result)
    full = result.pop("full information")
    assert full["reach"] is not None and full["reach"] <= 20
    for bandit in result.values():
        assert bandit["reach"] is None or bandit["reach"] > 10 * full["reach"] + 100
        assert full["efficiency"] > bandit["efficiency"] + 0.05
    assert full["efficiency"] > 0.9


# ---------------------------------------------------------------------------------- in the engine
VOCAB = 128
NEW = 16
PAD = 7
PROMPTS = ((11,), (5, 9, 17), (3, 8, 3, 8, 3, 8, 3))  # ragged; repeats give the n-gram drafter matches
ARCHS = ("llama", "qwen2")


@functools.cache
def target_model(arch: str):
    return tiny_model(arch, seed=ARCHITECTURES.index(arch), vocab_size=VOCAB)


@functools.cache
def noisy_model(arch: str):
    return noisy_copy(target_model(arch), 0.05, seed=1000 + ARCHITECTURES.index(arch))


@functools.cache
def engine(arch: str) -> flashspec.SpeculativeEngine:
    """Drafters [n-gram, a noisy copy of the target, the target itself]; the allocator it keeps learns
    across the tests that use it."""
    return flashspec.SpeculativeEngine(target_model(arch), ["ngram", noisy_model(arch), target_model(arch)],
                                       device="cpu")


@functools.cache
def hf_greedy(arch: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = target_model(arch).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                          do_sample=False, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def allocations(stats, drafters) -> list[tuple[int, ...]]:
    """Each step's allocation, read back from its ``step_log`` label."""
    out = []
    for record in stats.step_log:
        if record.arm is None:
            out.append(tuple(0 for _ in drafters))
            continue
        parts = dict(part.rsplit("@", 1) for part in record.arm.split("+"))
        out.append(tuple(int(parts[d.name]) for d in drafters))
    return out


@pytest.mark.parametrize("layout", ["alone", "ragged"])
@pytest.mark.parametrize("arch", ARCHS)
def test_auto_greedy_equals_hf_generate(arch, layout):
    """``gammas="auto"`` with drafters [n-gram, noisy copy, the target itself], batch 1 (each prompt
    alone) and a ragged batch of 3: every row is the target's own greedy continuation, whatever the
    allocator chose (target-only steps included); the statistics add up per allocation."""
    e = engine(arch)
    if layout == "alone":
        outs = [e.generate_tree([list(p)], max_new_tokens=NEW, gammas="auto") for p in PROMPTS]
        got, stats = [o.sequences[0] for o in outs], [o.stats for o in outs]
    else:
        out = e.generate_tree([list(p) for p in PROMPTS], max_new_tokens=NEW, gammas="auto", context=layout)
        got, stats = out.sequences, [out.stats]
    assert got == [hf_greedy(arch, p, NEW) for p in PROMPTS]
    for s in stats:
        assert sum(a.steps for a in s.per_arm.values()) == s.steps == len(s.step_log)
        assert sum(a.proposed for a in s.per_arm.values()) == s.proposed
        chosen = allocations(s, e.drafters)
        assert all(0 <= g <= 4 for a in chosen for g in a)
        for i, d in enumerate(e.drafters):
            assert s.per_drafter[d.name].steps == sum(a[i] > 0 for a in chosen)
    assert isinstance(e.tree_budget, TreeBudget)
    assert e.tree_budget.gamma_max == (4, 4, 4)


def test_the_target_as_a_drafter_gets_the_largest_gamma():
    """With the target itself among the drafters (100 % accepted) and a cost that grows with the
    nodes and the drafters run, the allocator learns to give the target's chain the largest γ — its
    γ_max — and to leave the others out but for exploration; the output stays the greedy one."""
    arch = "llama"
    e = flashspec.SpeculativeEngine(target_model(arch), ["ngram", noisy_model(arch), target_model(arch)],
                                    device="cpu")
    e.tree_budget = TreeBudget([4, 4, 4], cost=lambda a: 1.0 + 0.1 * sum(a) + 0.2 * sum(g > 0 for g in a))
    prompt = [5, 9, 17]
    out = e.generate_tree([prompt], max_new_tokens=48, gammas="auto")
    assert out.sequences == [hf_greedy(arch, tuple(prompt), 48)]
    assert e.tree_budget.best() == (0, 0, 4)
    chosen = allocations(out.stats, e.drafters)
    assert all(a[2] == 4 == max(a) for a in chosen[3:])
    assert sum(a == (0, 0, 4) for a in chosen[3:]) >= 0.75 * len(chosen[3:])
    self_stats = out.stats.per_drafter[e.drafters[2].name]
    assert self_stats.accepted >= self_stats.proposed - 4  # all but what the budget's end cut


class Scripted(TreeBudget):
    """A budget that plays a fixed cycle of allocations and records what each step reported."""

    def __init__(self, gamma_max, script):
        super().__init__(gamma_max, cost=lambda a: 1.0)
        self.script, self.reports = script, []

    def choose(self, context=None):
        return self.script[len(self.reports) % len(self.script)]

    def observe(self, allocation, lengths, taken, seconds, drafting=None, context=None, cold=False):
        self.reports.append((allocation, lengths, taken))
        super().observe(allocation, lengths, taken, seconds, drafting, context, cold=cold)


def test_a_drafter_left_out_catches_up_when_it_returns():
    """Allocations that leave drafters out for several steps (target-only steps among them) and bring
    them back: greedy output is still the target's, and the target as a drafter, whenever it runs,
    has its whole chain matched (up to what the row committed) — its cache caught up on every token
    committed while it was left out or drafted by another branch."""
    arch = "llama"
    target = target_model(arch)
    e = flashspec.SpeculativeEngine(target, [ModelDrafter(noisy_model(arch), VOCAB, name="noisy"),
                                             ModelDrafter(target, VOCAB, name="self")], device="cpu")
    script = [(3, 0), (0, 0), (2, 0), (0, 2), (0, 0), (0, 0), (4, 0), (1, 3), (0, 4), (0, 0), (2, 0), (0, 1)]
    e.tree_budget = Scripted([4, 4], script)
    prompts = [list(p) for p in PROMPTS]
    out = e.generate_tree(prompts, max_new_tokens=40, gammas="auto")
    assert out.sequences == [hf_greedy(arch, p, 40) for p in PROMPTS]
    reports = e.tree_budget.reports
    assert len(reports) == out.stats.steps and [r[0] for r in reports] == [script[i % len(script)]
                                                                           for i in range(len(reports))]
    ran = 0
    for (noisy_gamma, self_gamma), lengths, taken in reports:
        rows = len(PROMPTS)
        assert taken[rows:] == [0] * (len(taken) - rows)  # rows padded past the request's
        if self_gamma:
            ran += 1
            assert lengths[1] == [min(self_gamma, t) if t else lengths[1][b] for b, t in enumerate(taken)]
        else:
            assert lengths[1] == [-1] * len(taken)
        if not noisy_gamma:
            assert lengths[0] == [-1] * len(taken)
    assert ran >= 5


@functools.cache
def sampled_target():
    return tiny_model("llama", seed=3, vocab_size=16)


def test_sampled_auto_runs_and_a_seed_fixes_it():
    """Sampling with ``gammas="auto"``: with a fixed cost (choices depend on token counts only) a seed
    fixes the sample, as with fixed draft lengths; with the learned cost it runs too (its choices
    depend on measured times: the same law, not the same bits)."""
    target = sampled_target()
    drafters = ["ngram", noisy_copy(target, 0.3, seed=7)]
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5], [6]]

    def run(seed, cost=lambda a: 1.0 + 0.05 * sum(a)):
        e = flashspec.SpeculativeEngine(target, drafters, device="cpu")
        e.tree_budget = TreeBudget([3, 3], cost=cost)
        return e.generate_tree(prompts, max_new_tokens=12, gammas="auto", do_sample=True, temperature=0.9,
                               top_k=8, eos_token_id=[], seed=seed)

    runs = [run(5), run(5), run(6)]
    assert runs[0].sequences == runs[1].sequences != runs[2].sequences
    assert [r.arm for r in runs[0].stats.step_log] == [r.arm for r in runs[1].stats.step_log]
    learned = run(5, cost=None)
    assert [len(s) for s in learned.sequences] == [12, 12, 12]


# ---------------------------------------------------------------------------------- errors
def test_bad_gammas_and_budgets_are_clear_errors():
    e = flashspec.SpeculativeEngine(target_model("llama"), ["ngram", noisy_model("llama")], device="cpu")
    with pytest.raises(ValueError, match="'auto'.*got 'autox'"):
        e.generate_tree([[1, 2]], gammas="autox")
    with pytest.raises(ValueError, match="'auto'.*got -1"):
        e.generate_tree([[1, 2]], gammas=-1)
    with pytest.raises(ValueError, match=r"gammas\[0\].*from 1 to 64; got -2"):
        e.generate_tree([[1, 2]], gammas=[-2, 3])
    with pytest.raises(ValueError, match="context must be hashable"):
        e.generate_tree([[1, 2]], gammas="auto", context=[1])
    e.tree_budget = TreeBudget([3])
    with pytest.raises(ValueError, match="one γ_max per drafter"):
        e.generate_tree([[1, 2]], gammas="auto")
    e.tree_budget = TreeBudget([3, 65])
    with pytest.raises(ValueError, match="at most 64"):
        e.generate_tree([[1, 2]], gammas="auto")
    e.tree_budget = None
    assert len(e.generate_tree([[1, 2]], gammas="auto", max_new_tokens=3).sequences[0]) == 3
    assert e.tree_budget.gamma_max == (4, 4)
    for bad, match in [({"gamma_max": []}, "gamma_max"), ({"gamma_max": [0]}, r"gamma_max\[0\]"),
                       ({"gamma_max": [2], "forget": 0}, "forget"), ({"gamma_max": [2], "forget": 1.5}, "forget"),
                       ({"gamma_max": [2], "long_forget": 0.5}, "long_forget"),
                       ({"gamma_max": [2], "prior": (0, 1)}, "prior"), ({"gamma_max": [2], "shrink": -1}, "shrink"),
                       ({"gamma_max": [2], "explore_every": 0}, "explore_every"),
                       ({"gamma_max": [2], "window": 0}, "window"), ({"gamma_max": [2], "cost": 3}, "cost")]:
        with pytest.raises(ValueError, match=match):
            TreeBudget(**bad)
    budget = TreeBudget([3, 2])
    with pytest.raises(ValueError, match="one draft length per drafter"):
        budget.observe((3,), [[1]], [2], 1.0)
    with pytest.raises(ValueError, match=r"allocation\[1\] must be an integer from 0 to 2"):
        budget.observe((3, 3), [[1], [1]], [2], 1.0)
    with pytest.raises(ValueError, match=r"lengths\[0\] exceed"):
        budget.observe((2, 0), [[3], [-1]], [4], 1.0)
    with pytest.raises(ValueError, match=r"lengths\[0\] exceed"):
        budget.observe((3, 0), [[2], [-1]], [1], 1.0)
    with pytest.raises(ValueError, match="seconds"):
        budget.observe((3, 0), [[2], [-1]], [3], 0.0)
    with pytest.raises(ValueError, match="rows"):
        budget.observe((3, 0), [[2, 1], [-1]], [3], 1.0)
    assert budget.steps() == 0  # a refused observation records nothing
