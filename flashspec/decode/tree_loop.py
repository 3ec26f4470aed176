"""Decoding with one draft tree per step whose branches come from several drafters (SPEC.md §7,
"Draft trees in the decode loop").

Each step every drafter proposes its chain from the committed rows; the chains become one
:class:`~flashspec.draft_tree.DraftTree` (greedy: merged where they agree; sampling: one branch per
drafter, never merged), which the target scores in one forward
(:func:`~flashspec.models.tree.tree_forward`) and :func:`~flashspec.draft_tree.verify_tree` walks,
so the output law is exactly the target's (SPEC.md §2, "Tree verification"). The accepted path is
copied into the target's cache (:func:`~flashspec.models.tree.commit_path`) and committed as in the
chain loop. Because every drafter drafts every step, the statistics say what each drafter's branch
had accepted at every step, for no extra target forward.

With ``gammas="auto"`` a :class:`~flashspec.select.tree_budget.TreeBudget` chooses each step's draft
lengths from those counts (0 leaves a drafter out; all zeros is the chain loop's target-only step),
kept on the engine as ``engine.tree_budget`` (SPEC.md §7, "Choosing the tree's node budget from full
information"), behind a never-slower guard (:class:`~flashspec.select.tree_guard.TreeGuard`).

Drafters that read the target's features (feature heads, EAGLE-3) take part: the tree forward and
the commit write the committed positions' features as the chain loop's scoring forward does. With
``expand`` such a drafter's part is an EAGLE-2 top-k expansion instead of its chain (SPEC.md §7,
"Top-k expansion of a feature drafter"). Early-exit and shallow drafters, which draft inside the
target's own cache, are refused.

The loop reads the device once per step (stop flag, faults, statistics). On CUDA everything after
the proposals (the tree's build, its forward, verification, commit and counts) replays from one CUDA
graph per layout of the step's parts, whose inputs the step copies into buffers kept with the
workspace (:mod:`~flashspec.decode.tree_graph`; SPEC.md §7, "Tree steps are graphs too").
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..draft_tree import DraftTree, verify_tree
from ..drafters.base import CatchesUp, Drafter, Growth, History, ReadsFeatures
from ..drafters.expansion import TreeExpansion, candidates
from ..drafters.feature import FeatureDrafter
from ..models.graphs import compile_events
from ..models.static import StaticLM
from ..select.guard import DEFAULT_SLACK, check_slack
from ..models.tree import commit_path, tree_forward
from ..select.tree_budget import Allocation, TreeBudget
from ..select.tree_guard import RANKED, TreeGuard, TreeGuardMemory
from ..stats import DrafterStats, GenerationOutput, GenerationStats, StepRecord
from .commit import commit_step, note_fault
from .loop import _Run
from .request import MAX_DRAFT_TOKENS, Request
from .tree_build import Part, check_expand, expanded_part, greedy_tree, part_counts, sampled_tree, step_tree
from .tree_graph import graph_key, tree_inputs
from .workspace import Plan, raise_fault

AUTO = "auto"  # gammas="auto": the engine's TreeBudget chooses each step's draft lengths

__all__ = ["AUTO", "check_tree_engine", "decode_tree", "greedy_tree", "sampled_tree", "shares_target_cache",
           "tree_budget"]


def check_tree_engine(engine: Any, gammas: Sequence[int] | str | None, num_draft_tokens: int) -> list[int]:
    """What tree decoding needs of ``engine`` (drafters with their own state, a ``StaticLM`` target on
    one device), as ``ValueError`` sentences; returns each drafter's γ: ``gammas``, else (None or
    ``"auto"``) the largest γ of its arms (``num_draft_tokens`` for arms without one of their own)."""
    drafters: list[Drafter] = engine.drafters
    if not drafters:
        raise ValueError("generate_tree needs at least one drafter: the tree's branches are the drafters' chains.")
    for d in drafters:
        if shares_target_cache(d, engine.target_lm):
            raise ValueError(f"Drafter {d.name!r} drafts inside the target's own cache; tree decoding supports "
                             "drafters with their own state (n-gram, datastore, model drafters, and feature and "
                             "EAGLE-3 heads over the target's features) for now.")
    if not isinstance(engine.target_lm, StaticLM):
        raise ValueError(f"Tree decoding needs a target of architecture {', '.join(StaticLM.ARCHITECTURES)} (over "
                         f"FlashSpec's static cache); this one is {engine.target.config.model_type!r}.")
    if engine.tensor_parallel is not None:
        raise ValueError("Tree decoding does not support tensor-parallel targets yet.")
    if engine.bit_exact:
        raise ValueError("Tree decoding scores trees on the model's own modules (SPEC.md §3), outside bit-exact "
                         "mode: use an engine built with bit_exact=False.")
    if engine.block_size is not None:
        raise ValueError("Tree decoding scores every drafter's chain in one forward: there are no chunks to draft "
                         "in turn (SPEC.md §2). Use an engine built with block_size=None.")
    if gammas is None or (isinstance(gammas, str) and gammas == AUTO):
        return [max(g or num_draft_tokens for a, g in engine.arms if a == d) for d in range(len(drafters))]
    if not isinstance(gammas, (list, tuple)) or len(gammas) != len(drafters):
        raise ValueError(f"gammas must be 'auto' (chosen each step) or a list of one draft length per drafter "
                         f"({len(drafters)}: {', '.join(d.name for d in drafters)}); got {gammas!r}.")
    for i, g in enumerate(gammas):
        if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_DRAFT_TOKENS:
            raise ValueError(f"gammas[{i}] (drafter {drafters[i].name!r}) must be an integer from 1 to "
                             f"{MAX_DRAFT_TOKENS}; got {g!r}.")
    return list(gammas)


def shares_target_cache(drafter: Drafter, target: Any) -> bool:
    """Whether ``drafter`` runs the target's own layers over the target's cache (early-exit and
    shallow drafters): it writes its chain's entries there, and a shallow one hands states to a
    chain verify, which a tree step's scratch-and-commit does not account for (SPEC.md §7). Feature
    heads (:class:`FeatureDrafter`, EAGLE-3) keep a cache of their own and only read the target's
    features, which the tree step writes as the chain loop does."""
    if isinstance(drafter, FeatureDrafter):
        return False
    return isinstance(drafter, ReadsFeatures) or getattr(drafter, "target", None) is target


def tree_budget(engine: Any, gamma_max: Sequence[int]) -> TreeBudget:
    """The engine's :class:`TreeBudget` (``engine.tree_budget``), made with ``gamma_max`` at the first
    ``gammas="auto"`` call and kept, so that it learns across calls."""
    budget = getattr(engine, "tree_budget", None)
    if budget is None:
        budget = engine.tree_budget = TreeBudget(gamma_max)
    if not isinstance(budget, TreeBudget) or len(budget.gamma_max) != len(engine.drafters):
        raise ValueError(f"engine.tree_budget must be a TreeBudget with one γ_max per drafter "
                         f"({len(engine.drafters)}), or None; got {budget!r}.")
    if max(budget.gamma_max) > MAX_DRAFT_TOKENS:
        raise ValueError(f"engine.tree_budget's γ_max must be at most {MAX_DRAFT_TOKENS}; got {budget.gamma_max}.")
    return budget


@torch.inference_mode()
def decode_tree(
    engine: Any,
    input_ids: Any,
    *,
    gammas: Sequence[int] | str | None = None,
    expand: Mapping[str, TreeExpansion | tuple[int, int]] | None = None,
    attention_mask: Any = None,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    num_draft_tokens: int = 4,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    context: Hashable = None,
    slack: float | str | None = AUTO,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` per row with one draft tree per step made of the drafters'
    chains, verified exactly. ``gammas``: one draft length per drafter (default: the engine's), or
    ``"auto"``: chosen before each step by ``engine.tree_budget`` for ``context`` (a hashable label;
    None: one shared context), behind the never-slower guard at ``slack`` (``"auto"``: the engine's,
    else 0.01; None: no guard; SPEC.md §7). ``expand``: ``{drafter name: TreeExpansion(topk, nodes)}`` for feature
    and EAGLE-3 heads whose part is a top-k expansion of depth γ instead of a chain (SPEC.md §7). The
    prompt and the other keywords are ``generate``'s.
    ``stats.per_drafter[name].accepted`` counts the tokens of that drafter's branch on each step's
    committed path (greedy: exactly what its chain alone would have had committed; SPEC.md §7);
    ``stats.per_arm`` and ``stats.step_log`` are keyed by the step's allocation (``"ngram@3+noisy@0"``;
    ``"target@0"`` for a target-only step). :meth:`SpeculativeEngine.generate_tree` calls it holding
    the engine's lock, with the models in eval mode."""
    request = engine.parse(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                           do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                           num_draft_tokens=num_draft_tokens, eos_token_id=eos_token_id, seed=seed,
                           sync_every=None, context=context)
    auto = isinstance(gammas, str) and gammas == AUTO
    gammas = check_tree_engine(engine, gammas, request.num_draft_tokens)
    budget = tree_budget(engine, gammas) if auto else None
    guard = tree_guard(engine, budget, slack)
    expansions = check_expand(engine.drafters, expand, budget.gamma_max if auto else gammas)
    if budget is not None:  # the node counts its cost model reads (SPEC.md §7)
        budget.expand({i: (e.topk, e.nodes) for i, e in expansions.items()})
    deepest = max(budget.gamma_max) if budget is not None else max(gammas)
    stats = GenerationStats(per_drafter={d.name: DrafterStats() for d in engine.drafters})
    if budget is None:
        sizes = [_nodes_at(expansions, i, g) for i, g in enumerate(gammas)]
        stats.per_arm[_label(engine.drafters, tuple(gammas), expansions, sizes)] = DrafterStats()
    sequences: list[list[int]] = [[] for _ in request.rows]
    if request.max_new_tokens > 0:
        # Room past the longest row for the deepest branch (the engine adds its arms' γ + 2).
        plan = engine.plan(rows=len(request.rows), length=request.longest + request.max_new_tokens + deepest,
                           num_draft_tokens=request.num_draft_tokens, num_eos=len(request.eos))
        run = _TreeRun(plan, request, stats, tuple(gammas), budget, expansions, guard)
        start = time.perf_counter()
        run.prefill()
        stats.prefill_seconds = time.perf_counter() - start
        if guard is not None:
            guard.prefill(stats.prefill_seconds, request.longest)
        forward_before = run.forward_seconds()
        running = bool(run.active.any())  # the prefill's first token may have been an EOS
        for _ in range(request.max_new_tokens - 1):  # every step commits >= 1 token per active row
            if not running:
                break
            running = run.tree_step()
        stats.seconds = time.perf_counter() - start
        stats.guard_refused += guard.refused if guard is not None else 0
        stats.decode_seconds = stats.seconds - stats.prefill_seconds
        stats.forward_seconds = run.forward_seconds() - forward_before
        sequences = run.sequences()
    stats.new_tokens = sum(len(s) for s in sequences)
    text = None
    if engine.tokenizer is not None:
        text = [engine.tokenizer.decode(s, skip_special_tokens=True) for s in sequences]
    return GenerationOutput(sequences, stats, text)


def tree_guard(engine: Any, budget: TreeBudget | None, slack: Any) -> TreeGuard | None:
    """A fresh :class:`TreeGuard` for one ``gammas="auto"`` call at ``slack`` (``"auto"``: the engine's
    slack, else the default δ), or None (no budget, or ``slack=None``); the catch-up memory lives on
    the engine (``engine.tree_guard_memory``) so that later calls start from it."""
    if isinstance(slack, str) and slack == AUTO:
        slack = engine.slack if engine.slack is not None else DEFAULT_SLACK
    elif budget is None and slack is not None:
        raise ValueError(f'slack guards the choice of gammas="auto"; with fixed gammas leave it out (got {slack!r}).')
    slack = check_slack(slack)
    if budget is None or slack is None:
        return None
    memory = getattr(engine, "tree_guard_memory", None)
    if not isinstance(memory, TreeGuardMemory):
        memory = engine.tree_guard_memory = TreeGuardMemory()
    zeros = tuple(0 for _ in budget.gamma_max)

    def ratio(allocation: Allocation) -> float:
        return budget.seconds(allocation) / budget.seconds(zeros)

    return TreeGuard(len(budget.gamma_max), slack, ratio, memory,
                     {d: engine._layer_ratio(drafter) for d, drafter in enumerate(engine.drafters)},
                     measured=budget.measured)


def _nodes_at(expansions: Mapping[int, TreeExpansion], drafter: int, k: int) -> int:
    """Drafter ``drafter``'s nodes at draft length ``k``: ``k`` for a chain; an expansion keeps
    ``min(nodes, topk + (k − 1)·topk²)`` (its ``nodes`` at the depth it was checked for; SPEC.md §7)."""
    expansion = expansions.get(drafter)
    if expansion is None or k == 0:
        return k
    return min(expansion.nodes, candidates(k, expansion.topk))


def _label(drafters: Sequence[Drafter], allocation: Allocation, expansions: Mapping[int, TreeExpansion],
           sizes: Sequence[int]) -> str:
    """``"ngram@3+noisy@0"``, ``"feature@4(top3,12)"`` for an expansion (``sizes``: each drafter's
    nodes); ``"target@0"`` for a target-only step."""
    if not any(allocation):
        return "target@0"
    return "+".join(f"{d.name}@{g}" + (f"(top{expansions[i].topk},{n})" if i in expansions and g else "")
                    for i, (d, g, n) in enumerate(zip(drafters, allocation, sizes)))


class _TreeRun(_Run):
    """The chain loop's state (rows, caches, prefill, pending-token convention, seeded generator)
    with a tree step in place of its select → propose → score → verify → commit step."""

    def __init__(self, plan: Plan, request: Request, stats: GenerationStats, gammas: Allocation,
                 budget: TreeBudget | None, expansions: dict[int, TreeExpansion],
                 guard: TreeGuard | None = None) -> None:
        super().__init__(plan, request, stats)
        self.gammas, self.budget = gammas, budget  # fixed draft lengths, or a budget choosing them
        self.guard = guard  # the never-slower guard of the budget's choices (SPEC.md §7)
        self.widths: dict[int, int] = {}  # this step's catch-up widths, per drafting drafter
        self.expansions = expansions  # the drafters whose part is a top-k expansion
        # Per drafter, how far a row may have grown past what its cache holds (its catch-up window,
        # SPEC.md §4): the committed tokens may come from another drafter's branch, or from steps it
        # was left out of.
        self.growths = [Growth() for _ in plan.drafters]

    def _allocation(self) -> Allocation:
        """This step's draft lengths: the fixed ones, or the budget's choice (host time counted as
        the selector's)."""
        if self.budget is None:
            return self.gammas
        started = time.perf_counter()
        if self.guard is None:
            allocation = self.budget.choose(self.context)
        else:
            budget, context = self.budget, self.context

            def preferences() -> Any:
                yield budget.choose(context)
                yield from budget.ranking(context, RANKED)

            allocation = self.guard.choose(preferences(), self._catch_ups)
            self.widths = self._catch_ups(allocation)
        self.stats.selector_seconds += time.perf_counter() - started
        return allocation

    def _catch_ups(self, allocation: Allocation) -> dict[int, int]:
        """Per drafter of ``allocation``, the positions its proposal feeds beyond a steady step's
        (``CatchesUp.catch_up``, SPEC.md §4; 0 without a cache): host arithmetic only."""
        out = {}
        for i, (drafter, k, growth) in enumerate(zip(self.plan.drafters, allocation, self.growths)):
            if k and isinstance(drafter, CatchesUp):
                history = History(self.tokens, self.length, self.active, self.max_length, self.ws.hidden, growth)
                out[i] = drafter.catch_up(history)
        return out

    def tree_step(self) -> bool:
        """One step: the drafters of the allocation propose, one tree is scored and verified (no
        drafter: a target-only step), the path committed, the statistics and the budget updated;
        returns whether any row is still generating (the step's one read)."""
        allocation = self._allocation()
        started = time.perf_counter()
        events = compile_events()
        ws, params, active = self.ws, self.params, self.active
        inputs = tree_inputs(ws)  # the buffers the step's graph reads
        depth = max(allocation)
        every = [_nodes_at(self.expansions, i, k) for i, k in enumerate(allocation)]  # each drafter's part
        sizes = [n for n, k in zip(every, allocation) if k]
        # Drafting uniforms [B, Σγ] (drafter i at its offset), then verification [B, T + 1] for a tree of
        # T nodes (T = Σγ without expansions: for one drafter the chain loop's layout), in one draw.
        random = inputs.uniforms(sum(allocation) + sum(sizes) + 1).uniform_(generator=self.rng)
        parts, layouts, ran = [], [], []
        drafting = [0.0] * len(allocation)
        for i, (drafter, k, growth) in enumerate(zip(self.plan.drafters, allocation, self.growths)):
            if not k:
                continue
            began, offset = time.perf_counter(), sum(allocation[:i])
            history = History(self.tokens, self.length, active, self.max_length, ws.hidden, growth)
            if i in self.expansions:
                tree = drafter.expand(history, k, self.expansions[i].topk, every[i], params)
                self._check_draft(drafter, tree, every[i])
                part = expanded_part(drafter.name, tree, k)
            else:
                draft = drafter.propose(history, k, params, inputs.drafting(i, random[:, offset : offset + k]))
                self._check_draft(drafter, draft, k)
                part = Part(draft.tokens, draft.probs if params.do_sample else None)
            part, layout = inputs.stage(i, k, part)  # copied into its layout's buffers
            parts.append(part)
            layouts.append(layout)
            ran.append(i)
            drafting[i] = time.perf_counter() - began
        # A drafter's cache holds the committed tokens of this step only as far as they equal its own
        # chain (it fed all of it but the last token); the rest may come from another branch. So each
        # step counts twice in its Growth: the step itself, which a proposal's mark skips as in the
        # chain loop (2 unseen tokens), then what the drafter may not have fed beyond those 2 (for a
        # drafter left out, nothing: the step's own count already bounds what it missed). A feature
        # drafter re-feeds every position committed since its last proposal (the first count bounds
        # them), with the target's features that tree_forward (root) and commit_path (kept nodes) wrote;
        # an expanding one fed none of the step's tokens (part_counts counts them all in the second).
        for growth in self.growths:
            growth.launched(depth)
            growth.launched(max(depth - 2, -1))
        self.max_length += depth + 1

        # One CUDA graph per key on a GPU (none on tensor-parallel ranks); a plain call elsewhere.
        key = None if self.plan.tp is not None else graph_key(layouts, params, self.plan.acceptance)
        packed = self.plan.graphs.run(key, lambda: self._score_verify_commit_tree(parts, random))
        values = packed.tolist()  # the step's one read
        cold = compile_events() != events  # it captured a graph or compiled: a one-off cost (SPEC.md §8)
        raise_fault(values[:3])
        running, rows_read, committed, accepted = values[3:7]
        counts, missed = values[7 : 7 + len(ran)], dict(zip(ran, values[7 + len(ran) : 7 + 2 * len(ran)]))
        for i, growth in enumerate(self.growths):
            growth.polled(committed)
            growth.polled(max(missed.get(i, 0) - 2, 0))
        seconds = time.perf_counter() - started
        self._update(allocation, sizes, rows_read, committed, accepted, dict(zip(ran, counts)), seconds, cold)
        if self.budget is not None and rows_read:
            rest = values[7 + 2 * len(ran) :]
            per_row = dict(zip(ran, (rest[j * self.batch : (j + 1) * self.batch] for j in range(len(ran)))))
            unrun = [-1] * self.batch
            lengths, taken_rows = [per_row.get(i, unrun) for i in range(len(allocation))], rest[len(ran) * self.batch :]
            began, timed = time.perf_counter(), not cold
            if self.guard is not None:  # a stall's time is not a steady cost either (SPEC.md §7)
                timed = self.guard.observe(allocation, seconds, committed, rows_read, lengths, taken_rows,
                                           self.widths, drafting, cold)
            self.budget.observe(allocation, lengths, taken_rows, seconds, drafting, self.context, timed=timed)
            self.stats.selector_seconds += time.perf_counter() - began
        return bool(running)

    def _tree(self, parts: list[Part]) -> DraftTree:
        """The step's tree: chains alone through :func:`sampled_tree` or :func:`greedy_tree`, with an
        expansion through :func:`step_tree` (SPEC.md §7)."""
        if any(p.parents is not None for p in parts):
            return step_tree(parts, self.params.do_sample)
        if self.params.do_sample:
            return sampled_tree([p.tokens for p in parts], [p.laws for p in parts])
        return greedy_tree([p.tokens for p in parts])

    def _score_verify_commit_tree(self, parts: list[Part], random: torch.Tensor) -> torch.Tensor:
        """The step after the proposals, as tensor code over the step's buffers only (it is what a
        tree step's CUDA graph replays): the parts' ids outside the vocabulary noted (fault 3, raised
        after the step) and staged as 0; the tree built, scored, verified and its kept path copied into
        the cache (no part: the chain loop's target-only step); the commit; then what the host reads,
        packed: the fault, ``[running, rows, committed, accepted]``, per part its counts summed over rows
        and its unseen tokens, then per part its count per row and the tokens each row committed."""
        ws, params, active = self.ws, self.params, self.active
        checked = []
        for part in parts:
            outside = (part.tokens < 0) | (part.tokens >= self.vocab_size)
            note_fault(ws.fault, outside.any(dim=1) & active, 3, ws.steps_taken)
            checked.append(replace(part, tokens=part.tokens.masked_fill(outside, 0)))
        offsets = [sum(p.nodes for p in checked[:j]) for j in range(len(checked))]
        nodes = sum(p.nodes for p in checked)
        drafts = random.shape[1] - nodes - 1  # the drafting uniforms come first
        before = self.length.clone()
        if nodes:
            tree = self._tree(checked)
            start = self.length - 1
            pending = self.tokens.gather(1, start[:, None])
            # The target's features where drafters read them (SPEC.md §11): the root's written at
            # `start`, the nodes' kept until commit_path copies the kept path's, as a chain step writes them.
            logits, scratch = tree_forward(self.plan.target, torch.cat([pending, tree.tokens], dim=1), tree.parents,
                                           start, tree.present, check=False, **self._features)
            result = verify_tree(logits, tree, params, random[:, drafts:])
            commit_path(self.plan.target, scratch, result.path, result.num_accepted, start)
        else:  # the chain loop's target-only step: one forward over the pending token
            logits = self._score(0)
            result = self._verify(logits, ws.draft_tokens[:, :0], None, random[:, :1])
        rows = active.sum()
        commit_step(ws.tokens, ws.length, ws.active, ws.generated, ws.max_new_tokens, ws.eos, result.tokens,
                    result.num_accepted, ws.log, ws.steps_taken, logits, ws.fault)
        taken = self.length - before  # tokens committed to each row (0: it was not active)
        kept = torch.minimum(result.num_accepted, taken)  # drafts committed
        lengths, unseen = part_counts(checked, offsets, result, taken, params.do_sample)
        flags = torch.stack([self.active.any().long(), rows, taken.sum(), kept.sum()])
        return torch.cat([ws.fault, flags, lengths.clamp(min=0).sum(dim=1), unseen, lengths.flatten(), taken])

    def _update(self, allocation: Allocation, sizes: list[int], rows: int, committed: int, accepted: int,
                per_drafter: dict[int, int], seconds: float, cold: bool = False) -> None:
        """The step into the statistics (a step after every row finished is not counted); ``sizes``:
        the nodes of each drafter that ran; ``cold``: the step captured a graph or compiled."""
        if rows == 0:
            return
        stats, nodes = self.stats, sum(sizes)
        label = _label(self.plan.drafters, allocation, self.expansions,
                       [_nodes_at(self.expansions, i, k) for i, k in enumerate(allocation)])
        stats.step_log.append(StepRecord(label if nodes else None, accepted, rows, committed, seconds, cold))
        stats.steps += 1
        stats.cold_steps += cold
        stats.row_steps += rows
        stats.decode_tokens += committed
        stats.proposed += nodes * rows
        stats.accepted += accepted
        arm = stats.per_arm.setdefault(label, DrafterStats())
        arm.steps, arm.proposed, arm.accepted = arm.steps + 1, arm.proposed + nodes * rows, arm.accepted + accepted
        for (i, count), size in zip(per_drafter.items(), sizes):
            per = stats.per_drafter[self.plan.drafters[i].name]
            per.steps += 1
            per.proposed += size * rows
            per.accepted += count
