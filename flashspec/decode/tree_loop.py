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

Eager PyTorch only; the loop reads the device once per step (stop flag, faults, statistics).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from ..draft_tree import DraftTree, TreeVerifyResult, tree_from_chains, verify_tree
from ..drafters.base import Drafter, Growth, History, ReadsFeatures
from ..models.static import StaticLM
from ..models.tree import commit_path, tree_forward
from ..stats import DrafterStats, GenerationOutput, GenerationStats, StepRecord
from .commit import commit_step, note_fault
from .loop import _Run
from .request import MAX_DRAFT_TOKENS, Request
from .workspace import Plan, raise_fault

__all__ = ["check_tree_engine", "decode_tree", "sampled_tree"]


def check_tree_engine(engine: Any, gammas: Sequence[int] | None, num_draft_tokens: int) -> list[int]:
    """What tree decoding needs of ``engine`` (drafters with their own state, a ``StaticLM`` target on
    one device), as ``ValueError`` sentences; returns each drafter's γ: ``gammas``, else the largest γ
    of its arms (``num_draft_tokens`` for arms without one of their own)."""
    drafters: list[Drafter] = engine.drafters
    if not drafters:
        raise ValueError("generate_tree needs at least one drafter: the tree's branches are the drafters' chains.")
    for d in drafters:
        if isinstance(d, ReadsFeatures) or getattr(d, "target", None) is engine.target_lm:
            raise ValueError(f"Drafter {d.name!r} reads the target's features or shares its cache; tree decoding "
                             "supports drafters with their own state (n-gram, datastore, model drafters) for now.")
    if not isinstance(engine.target_lm, StaticLM):
        raise ValueError(f"Tree decoding needs a target of architecture {', '.join(StaticLM.ARCHITECTURES)} (over "
                         f"FlashSpec's static cache); this one is {engine.target.config.model_type!r}.")
    if engine.tensor_parallel is not None:
        raise ValueError("Tree decoding does not support tensor-parallel targets yet.")
    if engine.bit_exact:
        raise ValueError("Tree decoding scores trees eagerly (SPEC.md §3), outside bit-exact mode: use an engine "
                         "built with bit_exact=False.")
    if gammas is None:
        return [max(g or num_draft_tokens for a, g in engine.arms if a == d) for d in range(len(drafters))]
    if not isinstance(gammas, (list, tuple)) or len(gammas) != len(drafters):
        raise ValueError(f"gammas must be a list of one draft length per drafter ({len(drafters)}: "
                         f"{', '.join(d.name for d in drafters)}); got {gammas!r}.")
    for i, g in enumerate(gammas):
        if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_DRAFT_TOKENS:
            raise ValueError(f"gammas[{i}] (drafter {drafters[i].name!r}) must be an integer from 1 to "
                             f"{MAX_DRAFT_TOKENS}; got {g!r}.")
    return list(gammas)


def sampled_tree(chains: list[torch.Tensor], laws: list[torch.Tensor | None]) -> DraftTree:
    """The tree of a sampled step: each drafter's chain ``[B, γ_i]`` its own branch from the root, in
    drafter order, with the law each token was drawn from (``laws[i] [B, γ_i, V]``), or as point
    masses where the drafter gives none (n-gram, datastore). Drawn siblings are never merged: a
    repeated token is tested against the residual (SPEC.md §2, "Duplicates")."""
    tokens = torch.cat(chains, dim=1)
    batch, device = tokens.shape[0], tokens.device
    parents: list[int] = []
    for chain in chains:  # node first + d's parent is node first + d - 1, the root for d = 0
        first = len(parents)
        parents += [-1] + list(range(first, first + chain.shape[1] - 1))
    parents_t = torch.tensor(parents, dtype=torch.long, device=device).expand(batch, -1).contiguous()
    given = [q for q in laws if q is not None]
    if not given:
        return DraftTree(tokens, parents_t)
    vocab = given[0].shape[-1]
    full = [q.float() if q is not None else torch.zeros(batch, c.shape[1], vocab, device=device)
            for c, q in zip(chains, laws)]
    drawn = [torch.full(c.shape, q is not None, dtype=torch.bool, device=device) for c, q in zip(chains, laws)]
    return DraftTree(tokens, parents_t, torch.cat(full, dim=1), torch.cat(drawn, dim=1))


def greedy_tree(chains: list[torch.Tensor]) -> DraftTree:
    """The tree of a greedy step: the chains (point masses) merged where they agree
    (:func:`~flashspec.draft_tree.tree_from_chains`; chain ``i``'s token ``d`` is node ``i·L + d``,
    ``L`` the longest γ)."""
    depth = max(c.shape[1] for c in chains)
    if all(c.shape[1] == depth for c in chains):
        return tree_from_chains(torch.stack(chains, dim=1))
    padded = torch.stack([torch.nn.functional.pad(c, (0, depth - c.shape[1])) for c in chains], dim=1)
    lengths = torch.tensor([c.shape[1] for c in chains], device=padded.device).expand(padded.shape[0], -1)
    return tree_from_chains(padded, lengths)


@torch.inference_mode()
def decode_tree(
    engine: Any,
    input_ids: Any,
    *,
    gammas: Sequence[int] | None = None,
    attention_mask: Any = None,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    num_draft_tokens: int = 4,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | None = None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` per row with one draft tree per step made of every drafter's
    chain (``gammas``: one draft length per drafter; default: the engine's), verified exactly. The
    prompt and the other keywords are ``generate``'s. ``stats.per_drafter[name].accepted`` counts the
    tokens of that drafter's branch on each step's committed path (greedy: exactly what its chain
    alone would have had committed; SPEC.md §7). :meth:`SpeculativeEngine.generate_tree` calls it
    holding the engine's lock, with the models in eval mode."""
    request = engine.parse(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                           do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                           num_draft_tokens=num_draft_tokens, eos_token_id=eos_token_id, seed=seed,
                           sync_every=None, context=None)
    gammas = check_tree_engine(engine, gammas, request.num_draft_tokens)
    label = "+".join(f"{d.name}@{g}" for d, g in zip(engine.drafters, gammas))
    stats = GenerationStats(per_drafter={d.name: DrafterStats() for d in engine.drafters},
                            per_arm={label: DrafterStats()})
    sequences: list[list[int]] = [[] for _ in request.rows]
    if request.max_new_tokens > 0:
        # Room past the longest row for the deepest branch (the engine adds its arms' γ + 2).
        plan = engine.plan(rows=len(request.rows), length=request.longest + request.max_new_tokens + max(gammas),
                           num_draft_tokens=request.num_draft_tokens, num_eos=len(request.eos))
        run = _TreeRun(plan, request, stats, gammas, label)
        start = time.perf_counter()
        run.prefill()
        stats.prefill_seconds = time.perf_counter() - start
        forward_before = run.forward_seconds()
        running = bool(run.active.any())  # the prefill's first token may have been an EOS
        for _ in range(request.max_new_tokens - 1):  # every step commits >= 1 token per active row
            if not running:
                break
            running = run.tree_step()
        stats.seconds = time.perf_counter() - start
        stats.decode_seconds = stats.seconds - stats.prefill_seconds
        stats.forward_seconds = run.forward_seconds() - forward_before
        sequences = run.sequences()
    stats.new_tokens = sum(len(s) for s in sequences)
    text = None
    if engine.tokenizer is not None:
        text = [engine.tokenizer.decode(s, skip_special_tokens=True) for s in sequences]
    return GenerationOutput(sequences, stats, text)


class _TreeRun(_Run):
    """The chain loop's state (rows, caches, prefill, pending-token convention, seeded generator)
    with a tree step in place of its select → propose → score → verify → commit step."""

    def __init__(self, plan: Plan, request: Request, stats: GenerationStats, gammas: list[int], label: str) -> None:
        super().__init__(plan, request, stats)
        self.gammas, self.label = gammas, label
        self.offsets = [sum(gammas[:i]) for i in range(len(gammas))]  # drafter i's first node (sampled trees)
        self.nodes = sum(gammas)
        # Per step: drafting uniforms [B, N] (drafter i at its offsets), then verification [B, N + 1];
        # for one drafter this is the chain loop's layout, drawn from the same generator.
        self.random = torch.zeros(self.batch, 2 * self.nodes + 1, dtype=torch.float64, device=self.tokens.device)
        # Per drafter, how far a row may have grown past what its cache holds (its catch-up window,
        # SPEC.md §4): the committed tokens may come from another drafter's branch.
        self.growths = [Growth() for _ in gammas]

    def tree_step(self) -> bool:
        """One step: every drafter proposes, one tree is scored and verified, the path committed,
        the statistics updated; returns whether any row is still generating (the step's one read)."""
        started = time.perf_counter()
        ws, params, active = self.ws, self.params, self.active
        depth = max(self.gammas)
        self.random.uniform_(generator=self.rng)
        chains, laws = [], []
        for drafter, k, offset, growth in zip(self.plan.drafters, self.gammas, self.offsets, self.growths):
            history = History(self.tokens, self.length, active, self.max_length, None, growth)
            draft = drafter.propose(history, k, params, self.random[:, offset : offset + k])
            self._check_draft(drafter, draft, k)
            tokens = draft.tokens.long()
            outside = (tokens < 0) | (tokens >= self.vocab_size)  # noted, raised after the step, staged as 0
            note_fault(ws.fault, outside.any(dim=1) & active, 3, ws.steps_taken)
            chains.append(tokens.masked_fill(outside, 0))
            laws.append(draft.probs if params.do_sample else None)
        # A drafter's cache holds the committed tokens of this step only as far as they equal its own
        # chain (it fed all of it but the last token); the rest may come from another branch. So each
        # step counts twice in its Growth: the step itself, which a proposal's mark skips as in the
        # chain loop (2 unseen tokens), then what the drafter may not have fed beyond those 2.
        for growth in self.growths:
            growth.launched(depth)
            growth.launched(depth - 2)
        self.max_length += depth + 1

        tree = sampled_tree(chains, laws) if params.do_sample else greedy_tree(chains)
        start, before = self.length - 1, self.length.clone()
        pending = self.tokens.gather(1, start[:, None])
        logits, scratch = tree_forward(self.plan.target, torch.cat([pending, tree.tokens], dim=1), tree.parents,
                                       start, tree.present, check=False)
        result = verify_tree(logits, tree, params, self.random[:, self.nodes :])
        commit_path(self.plan.target, scratch, result.path, result.num_accepted, start)
        rows = active.sum()
        commit_step(ws.tokens, ws.length, ws.active, ws.generated, ws.max_new_tokens, ws.eos, result.tokens,
                    result.num_accepted, ws.log, ws.steps_taken, logits, ws.fault)
        taken = self.length - before  # tokens committed to each row (0: it was not active)
        kept = torch.minimum(result.num_accepted, taken)  # drafts committed
        counts, unseen = self._branch_counts(chains, result, taken)
        flags = torch.stack([self.active.any().long(), rows, taken.sum(), kept.sum()])
        values = torch.cat([ws.fault, flags, counts, unseen]).tolist()  # the step's one read
        raise_fault(values[:3])
        running, rows_read, committed, accepted = values[3:7]
        drafters = len(self.gammas)
        for growth, missed in zip(self.growths, values[7 + drafters :]):
            growth.polled(committed)
            growth.polled(max(missed - 2, 0))
        self._update(rows_read, committed, accepted, values[7 : 7 + drafters], time.perf_counter() - started)
        return bool(running)

    def _branch_counts(self, chains: list[torch.Tensor], result: TreeVerifyResult, taken: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per drafter: the tokens of its branch on the committed paths, summed over rows, and the most
        committed tokens of a row that its cache lacks. Greedy counts the longest prefix of its chain
        equal to the committed tokens: what its chain alone would have had committed (equal chains are
        one branch, so each drafter counts its own prefix); sampling counts its branch's kept nodes
        that were committed. Its cache holds that prefix (as far as it fed it: all but the last draft)."""
        counts, unseen = [], []
        slot = torch.arange(result.path.shape[1], device=taken.device)
        for chain, offset in zip(chains, self.offsets):
            k = chain.shape[1]
            column = torch.arange(k, device=chain.device)
            match = (chain == result.tokens[:, :k]) & (column < taken[:, None])
            prefix = match.long().cumprod(dim=1).sum(dim=1)
            unseen.append((taken - prefix.clamp(max=k - 1)).max())
            if self.params.do_sample:
                mine = (result.path >= offset) & (result.path < offset + k) & (slot < taken[:, None])
                counts.append(mine.sum())
            else:
                counts.append(prefix.sum())
        return torch.stack(counts), torch.stack(unseen)

    def _update(self, rows: int, committed: int, accepted: int, per_drafter: list[int], seconds: float) -> None:
        """The step into the statistics (a step after every row finished is not counted)."""
        if rows == 0:
            return
        stats = self.stats
        stats.step_log.append(StepRecord(self.label, accepted, rows, committed, seconds))
        stats.steps += 1
        stats.row_steps += rows
        stats.decode_tokens += committed
        stats.proposed += self.nodes * rows
        stats.accepted += accepted
        arm = stats.per_arm[self.label]
        arm.steps, arm.proposed, arm.accepted = arm.steps + 1, arm.proposed + self.nodes * rows, arm.accepted + accepted
        for drafter, k, count in zip(self.plan.drafters, self.gammas, per_drafter):
            per = stats.per_drafter[drafter.name]
            per.steps += 1
            per.proposed += k * rows
            per.accepted += count
