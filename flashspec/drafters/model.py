"""A drafter that is a (smaller) causal LM sharing the target's vocabulary."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from ..models.cached import make_lm
from ..models.graphs import Graphs, window_widths
from ..models.static import StaticLM
from ..sampling import SamplingParams
from .base import Draft, History, Seen, autoregress, autoregress_chunks


class ModelDrafter:
    """Drafts autoregressively with its own KV cache (SPEC.md §4).

    Each ``propose`` first re-feeds the last ``W`` committed tokens of every row (``W`` covers
    every token the cache has not seen, bounded on the host: the whole prompt at its first
    proposal of a request, 2 when this drafter also drafted the previous step, otherwise at least
    :attr:`SWITCH_WINDOW` and a power of two; :meth:`catch_up` says which), then drafts one token
    per forward.
    With a :class:`~flashspec.models.static.StaticLM` on CUDA the whole proposal is one CUDA graph.
    """

    SWITCH_WINDOW = 16  # the re-fed width after another drafter's steps (a compiled width of StaticLM)
    # The widths capture_joins captured a row's join at (none until it has): prefill_row pads to them.
    _join_widths: tuple[int, ...] = ()

    def __init__(
        self, model: PreTrainedModel, target_vocab_size: int, name: str | None = None, compile: bool = False
    ) -> None:
        vocab = model.config.vocab_size
        if vocab != target_vocab_size:
            raise ValueError(
                f"The drafter's vocabulary has {vocab} tokens but the target's has "
                f"{target_vocab_size}; a drafter must share the target's tokenizer and vocabulary."
            )
        self.model = model  # in eval mode during the engine's calls only (models.eval_mode)
        self.name = name or getattr(model.config, "_name_or_path", "") or model.config.model_type
        self._lm = make_lm(self.model, compile=compile)
        static_on_gpu = isinstance(self._lm, StaticLM) and self.model.device.type == "cuda"
        self._graphs = Graphs(enabled=static_on_gpu)
        self._zero = torch.zeros(1, dtype=torch.long, device=self.model.device)  # a join's start (graphs read it)
        self._seen = Seen()  # read once the last proposal's step ends (after_step)

    @property
    def forward_seconds(self) -> float:
        """Host time spent in this drafter's model forwards so far."""
        return self._lm.forward_seconds

    @property
    def joins_rows(self) -> bool:
        """Whether a running batch can hand this drafter a joining row: over FlashSpec's static
        cache only (SPEC.md §12)."""
        return isinstance(self._lm, StaticLM)

    def begin(self, batch_size: int) -> None:
        self._seen.forget()

    def prefill_row(self, history: History, row: int, width: int | None = None) -> None:
        """Feed row ``row``'s committed tokens alone: a request that joined a running batch
        (SPEC.md §12). The other rows' cache entries are neither read nor written. ``width``: feed
        that many positions (the target's padded prefill width, §12 "Prefill widths"); the entries
        past the row's tokens are overwritten before any query reads them."""
        if not isinstance(self._lm, StaticLM):
            raise ValueError(f"Drafter {self.name!r} cannot join a running batch: continuous batching needs "
                             f"a drafter over FlashSpec's static cache (architectures {', '.join(StaticLM.ARCHITECTURES)}).")
        self._start(history)
        # The row's committed tokens are its prompt and first token, one position more than the
        # target's join fed: padded to the narrowest width capture_joins captured that holds them,
        # so that a prompt exactly as long as a captured width replays a graph too (SPEC.md §12).
        need = max(int(history.length[row]), width or 0)
        width = next((w for w in self._join_widths if w >= need), need)
        key = ("join", row, width)  # replayed when capture_joins captured it (SPEC.md §12, "Joins are graphs too")
        self._graphs.run(key if key in self._graphs else None, lambda: self._feed_row(history, row, width))
        # With a proposal before, the other rows' tokens gained since it (steps another arm
        # drafted) are still unseen, and the next window must re-feed them.
        self._seen.joined(history)

    def capture_joins(self, history: History, widths: list[int] | tuple[int, ...]) -> None:
        """Capture :meth:`prefill_row` of every row at each of ``widths`` as CUDA graphs, so that
        no join runs eagerly or captures inside a request (SPEC.md §12, "Joins are graphs too").
        Called by ``Batch.warmup`` with every slot free: it writes only their cache rows, and
        leaves what this drafter has seen unchanged."""
        if not self._graphs.enabled:
            return
        self._start(history)
        for row in range(history.tokens.shape[0]):
            for width in widths:
                self._graphs.run(("join", row, width), lambda r=row, w=width: self._feed_row(history, r, w), warm=True)
        self._join_widths = tuple(sorted(widths))

    def _feed_row(self, history: History, row: int, width: int) -> None:
        """Feed ``tokens[row, :width]`` from position 0 through a view of that row of the cache
        (graph-safe: buffers only; no logits, a join only fills the cache)."""
        with self._lm.only_row(row):
            self._lm.layer_states(history.tokens[row : row + 1, :width], self._zero, eager=True)

    def _start(self, history: History) -> None:
        """A new request: size the cache (dropping graphs that captured replaced buffers)."""
        if self._lm.reset(history.tokens.shape[0], history.tokens.shape[1]):
            self._graphs.clear()
            self._join_widths = ()

    def catch_up(self, history: History) -> int:
        """The positions the next proposal feeds beyond a steady step's (SPEC.md §4): the whole
        prefix the first time in a request, the re-fed window after a gap wider than
        :attr:`SWITCH_WINDOW`, else 0 (host arithmetic only)."""
        return self._seen.catch_up(self._window(history), self.SWITCH_WINDOW)

    def _window(self, history: History) -> int:
        """How many trailing committed tokens to re-feed so the cache misses none: with CUDA
        graphs always one of :meth:`widths` (SPEC.md §4)."""
        bound = history.length_bound()
        if self._seen.first:  # the first proposal of a request: the whole prompt
            unseen = max(bound, self.SWITCH_WINDOW)
        else:
            # After drafting in a step, at most 2 committed tokens are unseen (the last draft,
            # never fed, and the target's token); each later step adds at most its length
            # growth. After a gap (another drafter drafted), the width is at least
            # SWITCH_WINDOW: re-feeding a few seen tokens rewrites their cache entries and costs
            # little in a latency-bound forward, while every distinct width is one more
            # compilation and CUDA graph.
            unseen = max(2, 2 + self._seen.grown(history))
            if unseen > 2:
                unseen = max(unseen, self.SWITCH_WINDOW)
        width = min(history.tokens.shape[1], 1 << (unseen - 1).bit_length())  # the bound grows past the end
        # With graphs, a window may pass the rows' ends (positions rewritten before they are
        # read); without them (any cache, the CPU) it stops at the bound, a prefill's width.
        return width if self._graphs.enabled else min(width, bound)

    def widths(self, capacity: int) -> list[int]:
        """Every window a proposal over a cache of ``capacity`` positions may feed: 2 (a steady
        step), then the powers of two from SWITCH_WINDOW up to the capacity (one CUDA graph
        each, all captured at once: SPEC.md §4)."""
        return sorted({min(2, capacity), *window_widths(capacity, self.SWITCH_WINDOW)})

    def _prepare(self, history: History, num_tokens: int) -> tuple[bool, torch.Tensor, int]:
        """What a proposal does first: whether it is the request's first (it feeds the prompt),
        the rows' active flags and the window to re-feed, noted as fed."""
        if history.tokens.device != self.model.device:
            raise ValueError("A model drafter must live on the same device as the target.")
        first = self._seen.first  # the first proposal of a request feeds the prompt
        if first:
            self._start(history)
        active = history.active if history.active is not None else torch.ones_like(history.length, dtype=torch.bool)
        window = self._window(history)
        self._seen.fed(history, after_step=num_tokens)
        return first, active, window

    def propose(
        self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor
    ) -> Draft:
        first, active, window = self._prepare(history, num_tokens)
        self._graphs.reading(history.tokens, history.length, active, uniforms)  # graphs read fixed buffers
        # Every window replays a graph, the prompt's feed included; without graphs (the CPU) the
        # first proposal's feed runs eagerly, so that no prompt length compiles (SPEC.md §3, §4).
        eager = first and not self._graphs.enabled
        tokens, probs = self._graphs.run_widths(
            self.widths(history.tokens.shape[1]), window, (num_tokens, params),
            lambda w: self._draft(history.tokens, history.length, active, uniforms, w, num_tokens, params,
                                  eager=eager))
        return Draft(tokens, probs)

    def _draft(
        self,
        history: torch.Tensor,
        length: torch.Tensor,
        active: torch.Tensor,
        uniforms: torch.Tensor,
        window: int,
        num_tokens: int,
        params: SamplingParams,
        eager: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pure tensor code (no host reads), so it can be captured as a graph. ``eager``: the
        re-feed (a first proposal's pass over the prompt, without graphs) is never compiled."""
        logits, step = self._begin(history, length, active, window, eager)
        return autoregress(logits, step, num_tokens, params, uniforms)

    def propose_chunks(self, history: History, num_tokens: int, chunk: int, params: SamplingParams,
                       uniforms: torch.Tensor) -> Iterator[Draft]:
        """:meth:`propose` in chunks of ``chunk`` drafts, each drafted when the engine asks for it
        (:class:`~flashspec.drafters.base.DraftsInChunks`, SPEC.md §2 "Chunked drafting"). Eager:
        no CUDA graph, so a chunk's forwards can run beside the target's."""
        first, active, window = self._prepare(history, num_tokens)
        logits, step = self._begin(history.tokens, history.length, active, window, eager=first)
        for tokens, probs in autoregress_chunks(logits, step, num_tokens, chunk, params, uniforms):
            yield Draft(tokens, probs)

    def _begin(self, history: torch.Tensor, length: torch.Tensor, active: torch.Tensor, window: int,
               eager: bool = False) -> tuple[torch.Tensor, Callable[[torch.Tensor, int], torch.Tensor]]:
        """Re-feed each row's last ``window`` committed tokens: the logits after its pending token,
        and the draft loop's one-token step (tensor code only)."""
        capacity = history.shape[1]
        start = (length - window).clamp(min=0)
        index = start[:, None] + torch.arange(window, device=length.device)
        real = index < length[:, None]
        fed = history.gather(1, index.clamp(max=capacity - 1))
        logits = self._lm.forward(fed, start, real, logits_at=(length - 1 - start)[:, None], eager=eager)[:, 0]
        live = active[:, None]  # finished rows draft as holes (their positions may pass the window)
        return logits, lambda token, i: self._lm.forward(token[:, None], length + i, live)[:, 0]
