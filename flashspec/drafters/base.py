"""The small protocol every drafter implements (SPEC.md §4)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import SamplingParams, probabilities, sample


class Growth:
    """How far any row's length may have grown in each step launched so far: host arithmetic
    that sizes drafters' catch-up windows without reading the device (SPEC.md §4, "Catch-up
    windows"). A step drafting ``k`` tokens counts ``k + 1`` when launched; once a poll has read
    what it committed (summed over rows, so still a bound for every row), that sum if smaller.
    Without the second part a gap of drafting steps that each committed one token would count
    ``γ + 1`` positions apiece, and the next drafter to run would re-feed several times the
    positions it missed. Only the last :data:`KEPT` steps are kept: a reading older than that
    counts as having missed everything."""

    KEPT = 4096

    def __init__(self) -> None:
        self._grown: list[int] = []  # per kept step: its bound
        self._first = 0  # the index of the first kept step
        self._unpolled = 0  # the index of the first step no poll has read yet

    @property
    def steps(self) -> int:
        """The steps launched so far (the index of the next one): a reading for :meth:`since`."""
        return self._first + len(self._grown)

    def launched(self, num_drafts: int) -> None:
        """A step drafting ``num_drafts`` tokens (0: target-only) was launched."""
        self._grown.append(num_drafts + 1)
        if len(self._grown) > self.KEPT:
            drop = len(self._grown) - self.KEPT
            del self._grown[:drop]
            self._first += drop
            self._unpolled = max(self._unpolled, self._first)

    def polled(self, committed: int) -> None:
        """The oldest step no poll had read committed ``committed`` tokens over all rows."""
        i = self._unpolled - self._first
        if 0 <= i < len(self._grown):
            self._grown[i] = min(self._grown[i], committed)
        self._unpolled += 1

    def since(self, step: int) -> int:
        """An upper bound on how many positions any row gained in steps ``step, step + 1, …``."""
        if step < self._first:
            return 1 << 30  # forgotten: everything may be unseen (windows clamp to the capacity)
        return sum(self._grown[step - self._first :])


@dataclass
class History:
    """The committed tokens of every row: ``tokens[b, :length[b]]`` (prompt, then output).

    The last committed token of a row (``length[b] - 1``) is the *pending* token: the next
    draft continues from it.
    """

    tokens: torch.Tensor  # [B, capacity] long
    length: torch.Tensor  # [B] long
    active: torch.Tensor | None = None  # [B] bool: rows still generating (None: all of them)
    # A host-side fact, so a drafter can size its work without reading tensors back:
    max_length: int | None = None  # an upper bound on length.max() (None: tokens.shape[1])
    # {n: [B, capacity, hidden]}: the target's features after its first n layers (all of them:
    # before its final norm) at every committed position but the pending one; for the n that
    # drafters read (ReadsFeatures: the union of their ``feature_layers``).
    hidden: dict[int, torch.Tensor] | None = None
    # The engine's per-step growth bounds (None: measure growth by max_length alone).
    growth: Growth | None = None

    def length_bound(self) -> int:
        return self.max_length if self.max_length is not None else self.tokens.shape[1]

    def mark(self, after_step: int | None = None) -> int:
        """A reading to measure later growth from (SPEC.md §4): the steps launched so far, or
        without :attr:`growth` the length bound. ``after_step=k``: the reading once the step
        about to be launched, drafting ``k`` tokens, has run."""
        if self.growth is not None:
            return self.growth.steps + (after_step is not None)
        return self.length_bound() + (0 if after_step is None else after_step + 1)

    def grown_since(self, mark: int) -> int:
        """An upper bound on how many positions any row gained since ``mark`` (:meth:`mark`)."""
        if self.growth is not None:
            return self.growth.since(mark)
        return self.length_bound() - mark


@dataclass
class Draft:
    """``tokens [B, k]`` proposed ids; ``probs [B, k, V]`` the processed laws they were drawn
    from, or ``None`` when the proposal is deterministic (verified with one-hot q).

    Optional, for the verify reuse of SPEC.md §11 (a shallow drafter with ``reuse=True``):
    ``states [B, k, hidden]``, the target's own output after its first ``states_layer`` layers
    at the positions the drafter fed through them — the pending token at ``length - 1`` and
    ``d_1 … d_{k-1}`` after it — computed by one-token target forwards over the target's cache,
    whose entries of those layers at those positions the drafter wrote with them. The verify
    forward then runs those layers for ``d_k`` only and the later layers from these states."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    states: torch.Tensor | None = None
    states_layer: int | None = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens (SPEC.md §4). The engine calls ``begin`` once per ``generate``,
    then ``propose`` at each step this drafter's arm is chosen for. There is no feedback call:
    what was accepted is in the :class:`History` of the next ``propose`` (the committed tokens),
    and a drafter with a cache catches up from it — also after steps another drafter drafted.

    Optional capabilities are the protocols below, each checked with ``isinstance``:
    :class:`CatchesUp`, :class:`JoinsRows`, :class:`CapturesJoins`, :class:`ReadsFeatures` and
    :class:`TimesForwards`."""

    name: str

    def begin(self, batch_size: int) -> None:
        """Start a new batch: forget all previous state."""

    def propose(
        self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor
    ) -> Draft:
        """Exactly ``num_tokens`` drafts per row (``Draft.tokens`` is ``[B, num_tokens]``).

        ``uniforms [B, num_tokens]`` float64 are the random numbers for sampled drafts."""


@runtime_checkable
class DraftsInChunks(Protocol):
    """A drafter that hands a proposal over in chunks (SPEC.md §2, "Chunked drafting"):
    ``propose_chunks`` yields the drafts of columns ``[0, chunk)``, ``[chunk, 2·chunk)``, … (the
    last one shorter) as :class:`Draft` objects, and does a chunk's work only when the next one is
    asked for, so that the engine scores a chunk while the drafter drafts the next one and stops
    asking once every row rejected a draft. Concatenated, the chunks are what ``propose`` with the
    same arguments returns; a chunk's last draft is fed only when the next chunk is asked for."""

    def propose_chunks(self, history: History, num_tokens: int, chunk: int, params: SamplingParams,
                       uniforms: torch.Tensor) -> Iterator[Draft]: ...


@runtime_checkable
class CatchesUp(Protocol):
    """A drafter with a cache of its own: how many committed positions its next proposal must
    feed beyond a steady step's (its first proposal of a request feeds the prompt; after a gap,
    what it missed), 0 when caught up, from host arithmetic only — the never-slower guard prices
    the proposal with it (SPEC.md §4, §8)."""

    def catch_up(self, history: History) -> int: ...


@runtime_checkable
class JoinsRows(Protocol):
    """A drafter with a cache of its own that a running batch can serve (SPEC.md §12): it feeds
    the row of a joining request alone (``prefill_row``; ``width``: the target's padded prefill
    width). ``joins_rows`` says whether this instance can (e.g. not over transformers' cache)."""

    joins_rows: bool

    def prefill_row(self, history: History, row: int, width: int | None = None) -> None: ...


@runtime_checkable
class CapturesJoins(Protocol):
    """A drafter whose joins replay CUDA graphs captured at the batch's warm-up, one per row and
    prefill width (SPEC.md §12, "Joins are graphs too")."""

    def capture_joins(self, history: History, widths: Sequence[int]) -> None: ...


@runtime_checkable
class ReadsFeatures(Protocol):
    """A drafter handed the target's features after its first ``n`` layers, for each ``n`` of
    ``feature_layers`` (``1 … L``; ``L``: before the final norm), in ``History.hidden[n]``. The
    engine asks the target's prefill and verify forwards for the union over its drafters, once;
    they write them with no host synchronisation (SPEC.md §11)."""

    feature_layers: tuple[int, ...]


def features_read(drafters: Sequence[object], layers: int | None) -> tuple[int, ...]:
    """The layer counts whose features the engine asks the target for: the union of the
    ``feature_layers`` of ``drafters`` that read features (:class:`ReadsFeatures`), sorted;
    ``ValueError`` for one outside ``1 … layers`` (the target's decoder layers, where known)."""
    wanted = {n for d in drafters if isinstance(d, ReadsFeatures) for n in d.feature_layers}
    for n in wanted:
        if not (isinstance(n, int) and 1 <= n <= (layers or n)):
            raise ValueError(f"A drafter reads the target's features after {n!r} layers; the target has "
                             f"{layers} (feature_layers must hold integers from 1 to {layers}).")
    return tuple(sorted(wanted))


@runtime_checkable
class TimesForwards(Protocol):
    """A drafter that counts the host time spent in its model forwards (the statistics'
    engine-overhead figure)."""

    forward_seconds: float


class Seen:
    """What a drafter with a cache has fed of the committed rows (SPEC.md §4, "Catch-up
    windows"): the :meth:`History.mark` reading of its last proposal (None: none yet in this
    request) and how many positions before that reading it left unfed."""

    def __init__(self) -> None:
        self.mark: int | None = None
        self.behind = 0

    @property
    def first(self) -> bool:
        """Whether the next proposal is the drafter's first of the request (it feeds the prompt)."""
        return self.mark is None

    def forget(self) -> None:
        """A new request: nothing is seen."""
        self.mark, self.behind = None, 0

    def grown(self, history: History) -> int:
        """An upper bound on the positions any row gained since the reading."""
        return history.grown_since(self.mark)

    def fed(self, history: History, after_step: int | None = None) -> None:
        """A proposal feeds every unseen position (``after_step=k``: read once the step about to
        be launched, drafting ``k`` tokens, has run)."""
        self.mark, self.behind = history.mark(after_step), 0

    def joined(self, history: History, behind: int = 0) -> None:
        """A row joined a running batch and was fed alone: with no proposal yet, every row in the
        batch was fed at its join (``behind``: positions each left unfed, e.g. its pending token).
        Otherwise the other rows' unseen positions are as they were."""
        if self.mark is None:
            self.mark, self.behind = history.mark(), behind

    def catch_up(self, window: int, steady: int) -> int:
        """:meth:`CatchesUp.catch_up` of a proposal feeding ``window`` positions, where windows up
        to ``steady`` are a steady step's: the whole window at the first proposal, else what
        passes ``steady``."""
        return window if self.first or window > steady else 0


def continuation(
    source: torch.Tensor, follow: torch.Tensor, end: torch.Tensor | int, num_tokens: int, pending: torch.Tensor
) -> torch.Tensor:
    """``[B, num_tokens]`` drafts: the tokens of ``source`` from position ``follow[b]`` on —
    ``source`` is ``[B, L]`` (each row its own text) or ``[L]`` (one store for every row) —
    and, where ``follow[b] < 0`` or past ``end`` (exclusive; per row or one number), the
    pending token ``pending [B, 1]``. Always ``num_tokens`` columns: shapes known on the host,
    nothing read back; a repeated pending token is a guess verified like any other."""
    offsets = torch.arange(num_tokens, device=follow.device)
    index = follow[:, None] + offsets
    end = end[:, None] if isinstance(end, torch.Tensor) else end
    usable = (follow[:, None] >= 0) & (index < end)
    index = index.clamp(0, source.shape[-1] - 1)
    taken = source.gather(1, index) if source.dim() == 2 else source[index]
    return torch.where(usable, taken, pending)



def autoregress(
    logits: torch.Tensor, step: Callable[[torch.Tensor, int], torch.Tensor], num_tokens: int, params: SamplingParams,
    uniforms: torch.Tensor,
    draw_token: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The autoregressive draft loop: draw a token per row from ``logits [B, V]`` with
    ``uniforms[:, i]``, feed it (``step(token, i)`` returns the next logits) and draw again,
    ``num_tokens`` times. Returns the drafts ``[B, num_tokens]`` and their laws
    ``[B, num_tokens, V]`` (None when greedy). ``draw_token``: in place of :func:`draw`, with its
    signature. Tensor code only, so a whole proposal can be captured as a CUDA graph."""
    draw_token = draw_token or draw
    drafted, laws = [], []
    for i in range(num_tokens):
        token, q = draw_token(logits, params, uniforms[:, i])
        if q is not None:
            laws.append(q)
        drafted.append(token)
        if i + 1 < num_tokens:
            logits = step(token, i)
    probs = torch.stack(laws, dim=1) if laws else None
    return torch.stack(drafted, dim=1), probs


def autoregress_chunks(
    logits: torch.Tensor, step: Callable[[torch.Tensor, int], torch.Tensor], num_tokens: int, chunk: int,
    params: SamplingParams, uniforms: torch.Tensor,
    draw_token: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`autoregress` in chunks of ``chunk`` tokens: yields each chunk's drafts ``[B, c]`` and
    laws ``[B, c, V]`` (None when greedy). The same operations in the same order, so the chunks
    concatenate to :func:`autoregress`'s result; a chunk's last draft is fed (``step``) only when
    the next chunk is asked for, so a caller that stops asking stops the drafting (SPEC.md §2)."""
    draw_token = draw_token or draw
    token = None
    for begin in range(0, num_tokens, chunk):
        drafted, laws = [], []
        for i in range(begin, min(begin + chunk, num_tokens)):
            if i > 0:
                logits = step(token, i - 1)
            token, q = draw_token(logits, params, uniforms[:, i])
            if q is not None:
                laws.append(q)
            drafted.append(token)
        yield torch.stack(drafted, dim=1), torch.stack(laws, dim=1) if laws else None


def draw(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of ``logits [B, V]``: the argmax when greedy, else a draw with
    ``uniforms [B]`` from the processed law ``q [B, V]``, returned with it (None when greedy)."""
    if params.do_sample:
        q = probabilities(logits, params)
        return sample(q, uniforms), q
    return logits.float().argmax(dim=-1), None
