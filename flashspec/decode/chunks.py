"""Chunked drafting (SPEC.md §2, "Chunked drafting"): a step's ``k`` drafts drafted, scored and
verified in chunks of at most ``b`` (``SpeculativeEngine(..., block_size=b)``), so that the target
scores chunk ``j`` while the drafter drafts chunk ``j + 1``, and drafting stops at the first
rejection.

Chunk ``j`` is verified against the target's laws given everything before it: the whole is the
token-wise verification of the chain ``d_1..d_k``, computed in pieces, with no bonus token between
chunks (the law after a whole chunk is the one the next chunk's first draft is tested against).
Under the block rule each chunk is a block of its own. On CUDA the drafter of a chunk works on a
side stream while the target's forward of the chunk before runs on the current one, and the host
reads nothing; on a CPU the same operations run in the same order, and the step stops drafting
once no row is live (CPU tensors: reading them waits for nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..checks import check_int
from ..drafters.base import Draft, DraftsInChunks
from ..sampling import SamplingParams
from ..verify import VerifyResult, verify

__all__ = ["MAX_BLOCK_SIZE", "ChunkTally", "check_block_size", "check_chunking", "chunk_spans", "chunked",
           "chunked_step", "stops_early", "verify_chunks"]

MAX_BLOCK_SIZE = 64  # the largest draft length (decode.request.MAX_DRAFT_TOKENS)


def check_block_size(block_size: Any) -> int | None:
    """``block_size`` itself when it is None (no chunks) or an integer from 1 to 64, else a
    ``ValueError`` naming it (bools and floats are not sizes)."""
    if block_size is None:
        return None
    return check_int("block_size (drafts per chunk, or None for none)", block_size, 1, MAX_BLOCK_SIZE)


def check_chunking(block_size: Any, *, tensor_parallel: Any = None, reuse_shallow: bool = False) -> int | None:
    """:func:`check_block_size`, and a ``ValueError`` for the engine settings chunks do not combine
    with (SPEC.md §2, "What combines, what is refused")."""
    block_size = check_block_size(block_size)
    if block_size is None:
        return None
    if tensor_parallel is not None:
        raise ValueError("block_size (chunked drafting) does not support tensor-parallel targets: every rank would "
                         "have to receive each chunk's drafts. Use block_size=None.")
    if reuse_shallow:
        raise ValueError("block_size (chunked drafting) cannot combine with reuse_shallow=True: the reuse hands the "
                         "one verify forward of the whole draft its states, and chunks are verified by several. "
                         "Choose one of them.")
    return block_size


def chunked(block_size: int | None, k: int) -> bool:
    """Whether a step of ``k`` drafts runs in chunks: more drafts than one chunk holds."""
    return block_size is not None and k > block_size


def chunk_spans(k: int, block_size: int) -> list[tuple[int, int]]:
    """The chunks of ``k`` drafts, ``[(0, b), (b, 2b), …]``, the last one shorter when ``b`` does
    not divide ``k``."""
    return [(a, min(a + block_size, k)) for a in range(0, k, block_size)]


def stops_early(device: torch.device) -> bool:
    """Whether a chunked step on ``device`` reads its live flags to stop drafting once every row
    stopped: on a CPU only, where reading a tensor waits for nothing (SPEC.md §7)."""
    return device.type == "cpu"


def chunk_uniforms(uniforms: torch.Tensor, begin: int, end: int, k: int) -> torch.Tensor:
    """The verification uniforms of chunk ``[begin, end)`` of a step of ``k`` drafts: those of its
    drafts, then ``u_{k+1}``, the step's one draw of a new token."""
    return torch.cat([uniforms[:, begin:end], uniforms[:, k : k + 1]], dim=1)


def chunk_laws(carry: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The target's logits a later chunk is verified with: ``carry [B, 1, V]``, the previous
    forward's last (the law after the previous chunk, which its first draft is tested against),
    then ``fresh [B, c, V]``, its own forward's (the laws after each of its drafts)."""
    return torch.cat([carry, fresh], dim=1)


class ChunkTally:
    """The rows' result over a step's chunks (tensor code only): which rows are live (active and
    every draft so far kept), how many drafts each kept and its new token."""

    def __init__(self, active: torch.Tensor, k: int) -> None:
        self.k = k
        self.live = active.clone()
        self.accepted = torch.zeros(active.shape, dtype=torch.long, device=active.device)
        self.new = torch.zeros_like(self.accepted)

    def take(self, result: VerifyResult, begin: int, end: int) -> None:
        """Chunk ``[begin, end)``'s verification: a live row that rejected one of its drafts stops
        with the chunk's new token (the residual draw), one that kept the whole last chunk with its
        bonus token; one that kept a whole earlier chunk stays live, and that chunk's new token (a
        bonus drawn from the law the next chunk's first draft is tested against) is not used."""
        kept = result.num_accepted
        whole = kept == end - begin
        stops = self.live & (~whole | (end == self.k))
        drawn = result.tokens.gather(1, kept[:, None])[:, 0]
        self.new = torch.where(stops, drawn, self.new)
        self.accepted = torch.where(self.live, begin + kept, self.accepted)
        self.live = self.live & whole & (end < self.k)

    def result(self, drafts: torch.Tensor) -> VerifyResult:
        """:func:`~flashspec.verify.verify`'s form: ``num_accepted [B]`` and ``tokens [B, k + 1]``,
        the kept drafts of ``drafts [B, k]``, the new token, then ``-1``."""
        columns = torch.arange(self.k + 1, device=drafts.device)
        n = self.accepted[:, None]
        kept = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
        tokens = torch.where(columns < n, kept, torch.where(columns == n, self.new[:, None], -1))
        return VerifyResult(self.accepted, tokens)


def verify_chunks(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                  params: SamplingParams, uniforms: torch.Tensor | None, block_size: int, *,
                  acceptance: str = "token", backend: str = "auto") -> VerifyResult:
    """What a chunked step decides, given the target's logits ``[B, k + 1, V]`` of the whole chain:
    :func:`~flashspec.verify.verify`'s arguments and result, the drafts verified chunk by chunk
    (SPEC.md §2, "Chunked drafting"). With ``acceptance="token"`` it equals ``verify`` on the whole
    chain; with ``"block"`` each chunk is verified as a block of its own."""
    batch, k = draft_tokens.shape
    if not chunked(check_block_size(block_size), k):
        return verify(target_logits, draft_tokens, draft_probs, params, uniforms, acceptance=acceptance,
                      backend=backend)
    tally = ChunkTally(torch.ones(batch, dtype=torch.bool, device=draft_tokens.device), k)
    for begin, end in chunk_spans(k, block_size):
        probs = None if draft_probs is None else draft_probs[:, begin:end]
        u = None if uniforms is None else chunk_uniforms(uniforms, begin, end, k)
        tally.take(verify(target_logits[:, begin : end + 1], draft_tokens[:, begin:end], probs, params, u,
                          acceptance=acceptance, backend=backend), begin, end)
    return tally.result(draft_tokens)


def chunked_step(run: Any, arm: int, k: int) -> None:
    """One step of ``k`` drafts of ``arm``'s drafter in chunks of ``run.plan.block_size``: propose,
    score, verify, commit (SPEC.md §2, "Chunked drafting"). ``run`` is the decode loop's state
    (:class:`~flashspec.decode.loop._Run`); the random numbers, the staged drafts, the commit and the
    log entry are an unchunked step's. Nothing is read from a CUDA device."""
    ws, plan = run.ws, run.plan
    run._draw_random()
    run.states_layer = None  # chunks are verified by several forwards: no verify reuse (SPEC.md §11)
    spans = chunk_spans(k, plan.block_size)
    drafter = plan.drafters[plan.arm_drafters[arm]]
    device = ws.tokens.device
    overlap = _Overlap(device) if device.type == "cuda" and isinstance(drafter, DraftsInChunks) else None
    pieces = _pieces(run, drafter, k, spans, overlap)
    tally = ChunkTally(run.active, k)
    start = run.length - 1  # the pending token's position
    scored: list[torch.Tensor] = []
    carry = None  # the previous forward's last law: the one this chunk's first draft is tested against
    has_probs = None
    try:
        for begin, end in spans:
            probs_given = next(pieces)  # this chunk drafted and staged (on CUDA: queued on the side stream)
            if has_probs is not None and probs_given != has_probs:
                raise ValueError(f"Drafter {drafter.name!r} gave draft probabilities with some chunks and not with "
                                 "others; a proposal gives them for every draft or for none.")
            has_probs = probs_given
            if overlap is not None:
                overlap.hand_over()
            drafts = ws.draft_tokens[:, begin:end]
            if carry is None:  # the first chunk: the pending token, then its drafts
                fed = torch.cat([run.tokens.gather(1, start[:, None]), drafts], dim=1)
                logits = fresh = plan.target.forward(fed, start, run.active[:, None].expand_as(fed), **run._features)
            else:  # a later chunk: its drafts after the previous chunk's, no rollback between them
                fresh = plan.target.forward(drafts, start + begin + 1, run.active[:, None].expand_as(drafts),
                                            **run._features)
                logits = chunk_laws(carry, fresh)
            scored.append(fresh)
            carry = logits[:, -1:]
            probs = ws.draft_probs[:, begin:end] if has_probs else None
            result = run._verify(logits, drafts, probs, chunk_uniforms(run.verify_uniforms, begin, end, k))
            tally.take(result, begin, end)
            if stops_early(device) and not bool(tally.live.any()):
                break  # every row stopped: drafting stops at the first rejection
    finally:
        pieces.close()
        if overlap is not None:
            overlap.finish()
    result = tally.result(ws.draft_tokens[:, :k])
    plan.commit_step(ws.tokens, ws.length, ws.active, ws.generated, ws.max_new_tokens, ws.eos, result.tokens,
                     result.num_accepted, ws.log, ws.steps_taken, torch.cat(scored, dim=1), ws.fault)


def _pieces(run: Any, drafter: Any, k: int, spans: list[tuple[int, int]], overlap: _Overlap | None) -> Iterator[bool]:
    """Draft and stage the chunks one by one as they are asked for; yields whether each came with
    its laws ``q``. A :class:`~flashspec.drafters.base.DraftsInChunks` drafter drafts each chunk
    when asked (on CUDA on the side stream); any other drafter proposes all ``k`` drafts at once."""
    history, params, uniforms = run.history(), run._draft_params(), run.draft_uniforms[:, :k]
    if not isinstance(drafter, DraftsInChunks):
        draft = drafter.propose(history, k, params, uniforms)
        run._check_draft(drafter, draft, k)
        _stage(run, draft, 0, k)
        for _ in spans:
            yield draft.probs is not None
        return
    chunks = drafter.propose_chunks(history, k, spans[0][1], params, uniforms)
    try:
        for begin, end in spans:
            with overlap.drafting() if overlap is not None else contextlib.nullcontext():
                draft = next(chunks, None)
                if draft is None:
                    raise ValueError(f"Drafter {drafter.name!r} handed over {begin} of {k} drafts in chunks; "
                                     "propose_chunks must yield every chunk.")
                run._check_draft(drafter, draft, end - begin)
                _stage(run, draft, begin, end)
                if overlap is not None:
                    overlap.drafted()
            yield draft.probs is not None
    finally:
        chunks.close()


def _stage(run: Any, draft: Draft, begin: int, end: int) -> None:
    """Copy a chunk's drafts (ids outside the vocabulary noted as a fault and staged as 0) and its
    laws into the step's buffers at columns ``[begin, end)``."""
    ws = run.ws
    run.plan.stage_drafts(ws.draft_tokens[:, begin:end], draft.tokens, run.vocab_size, run.active, ws.fault,
                          ws.steps_taken)
    if draft.probs is not None:
        if ws.draft_probs is None:
            shape = (run.batch, run.gamma, draft.probs.shape[-1])
            ws.draft_probs = torch.empty(shape, dtype=draft.probs.dtype, device=draft.probs.device)
        ws.draft_probs[:, begin:end].copy_(draft.probs)


class _Overlap:
    """On CUDA: the drafter's chunks on a side stream, the target's forwards and the verification on
    the current one; an event hands each chunk's staged drafts over. The side stream first waits
    for everything queued before the step (the committed tokens it reads); the current one waits for
    the side stream before the commit (which rewrites what the drafter reads)."""

    _side: dict[torch.device, Any] = {}  # one side stream per device, kept

    def __init__(self, device: torch.device) -> None:
        self.main = torch.cuda.current_stream(device)
        key = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if key not in self._side:
            self._side[key] = torch.cuda.Stream(key)
        self.side = self._side[key]
        self.side.wait_stream(self.main)
        self.event: Any = None

    def drafting(self) -> Any:
        """The context the drafter's chunk runs in: the side stream."""
        return torch.cuda.stream(self.side)

    def drafted(self) -> None:
        """Mark the end of the chunk just staged on the side stream."""
        self.event = torch.cuda.Event()
        self.event.record(self.side)

    def hand_over(self) -> None:
        """The current stream waits for the chunk last staged."""
        self.main.wait_event(self.event)

    def finish(self) -> None:
        """The current stream waits for all the drafter's work."""
        self.main.wait_stream(self.side)
