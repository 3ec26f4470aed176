"""A drafter that reads the target's own features (EAGLE family, SPEC.md §11).

At position ``t`` its input is ``fc([f_{t-1}; e_t])``: the target's feature at the previous
position, and the embedding of the token at ``t``. The feature is the target's last decoder
layer's output (before the final norm), or with ``taps`` (EAGLE-3, SPEC.md §11 "Fused features")
``fuse([h_a; h_b; …])``, the outputs of the tapped decoder layers projected to the hidden size.
One trained decoder layer of the target's own architecture follows, then the target's final norm
and output head (shared, not copied). The layer's output is the predicted feature at ``t``; the
head turns it into the law of the token at ``t + 1``, and the next draft feeds that predicted
feature back in, in place of the target's.

The engine hands the target's features of committed positions over in ``History.hidden``,
written by the target's own forwards (prefill and verification) with no host synchronisation.
The drafter keeps a cache for its one layer. Before each proposal it feeds again every position
whose true feature it has not yet seen (the drafts it fed last time used predicted ones).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..checks import check_int
from ..models.graphs import Graphs, window_widths
from ..models.static import StaticLM
from ..models.tree import tree_layers
from ..sampling import SamplingParams
from .base import Draft, History, Seen, autoregress, autoregress_chunks, draw
from .expansion import ExpandedDraft, Step, expand_tree
from .fusion import check_fuse_rank, check_taps, default_taps, fuse_map, tapped_layers

__all__ = ["FeatureDrafter", "FeatureHead", "SubsetHead", "check_taps", "decoder_layer", "default_taps",
           "draw_in_subset", "tapped_layers", "window_widths"]

PREFIX = "feature:"


class FeatureHead(nn.Module):
    """The trainable part: ``fc`` (2·hidden → hidden) and ``layers`` decoder layers of the target's
    architecture. :meth:`draft_model` wraps it with the target's embedding, final norm, rotary
    embedding and head, shared by reference, as a transformers model of the target's class.

    Compact designs (SPEC.md §11.4): ``width`` sets the layers' MLP width and ``heads`` their
    number of query heads (default: the target's); ``vocab`` (target token ids) restricts the
    draft head to those rows of the target's head (a reduced draft vocabulary).

    Fused features (SPEC.md §11, EAGLE-3): ``taps`` (decoder-layer indices of the target, 0-based,
    e.g. :func:`default_taps`) makes the feature the drafter starts from ``fuse([h_a; h_b; …])``,
    a ``len(taps)·hidden → hidden`` map (no bias, so a zero feature stays zero) of those layers'
    outputs; ``fc`` is unchanged. ``fuse_rank`` ``R`` makes ``fuse`` the product of two thin maps,
    ``len(taps)·hidden → R → hidden`` (:class:`~flashspec.drafters.fusion.FactoredLinear`; default:
    one full-rank matrix). Without taps there is no ``fuse`` and the feature is the last layer's, as
    in checkpoints made before taps existed."""

    def __init__(self, config: Any, layers: int = 1, width: int | None = None, heads: int | None = None,
                 vocab: torch.Tensor | None = None, taps: tuple[int, ...] | None = None,
                 fuse_rank: int | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.taps = None if taps is None else check_taps(taps, config.num_hidden_layers)
        self.fuse_rank = check_fuse_rank(fuse_rank, self.taps, hidden)
        self.config = copy.deepcopy(config)
        self.config.num_hidden_layers = layers
        if hasattr(self.config, "layer_types") and self.config.layer_types is not None:
            self.config.layer_types = self.config.layer_types[:layers]
        if width is not None:
            check_int("width", width, 1)
            self.config.intermediate_size = width
        if heads is not None:
            check_int("heads", heads, 1)
            kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            if heads % kv and kv % heads:
                raise ValueError(f"heads must divide or be a multiple of the target's {kv} key-value heads; got {heads}.")
            self.config.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
            self.config.num_attention_heads = heads
            self.config.num_key_value_heads = min(kv, heads)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList(decoder_layer(self.config, i) for i in range(layers))
        self.fuse = None if self.taps is None else fuse_map(len(self.taps), hidden, self.fuse_rank)
        if vocab is not None:
            vocab = torch.as_tensor(vocab, dtype=torch.long).flatten()
            size = config.vocab_size
            if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= size or vocab.unique().numel() != vocab.numel():
                raise ValueError(f"vocab must hold distinct token ids in [0, {size}); got {vocab.numel()} ids.")
            self.register_buffer("vocab", vocab.sort().values)
        else:
            self.vocab = None

    @property
    def design(self) -> dict[str, int | None]:
        """The sizes that rebuild this head (stored in a checkpoint's drafter.json)."""
        return {"layers": len(self.layers), "width": self.config.intermediate_size,
                "heads": self.config.num_attention_heads,
                "vocab": None if self.vocab is None else int(self.vocab.numel()),
                "taps": None if self.taps is None else list(self.taps), "fuse_rank": self.fuse_rank}

    def draft_model(self, target: nn.Module) -> nn.Module:
        """A model of the target's class whose decoder layers are this head's and whose embedding,
        final norm, rotary embedding and output head are the target's own modules."""
        with torch.device("meta"):
            model = type(target)(self.config)
        model.model.layers = self.layers
        model.model.embed_tokens = target.model.embed_tokens
        model.model.norm = target.model.norm
        model.model.rotary_emb = target.model.rotary_emb
        model.lm_head = target.lm_head if self.vocab is None else SubsetHead(target.lm_head, self.vocab)
        model.generation_config = target.generation_config
        return model.eval()

    def inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """``fc([f_{t-1}; e_t])`` for ``features, embeddings [B, q, hidden]``."""
        return self.fc(torch.cat([features, embeddings], dim=-1))

    def fused(self, target_features: torch.Tensor) -> torch.Tensor:
        """The feature this head starts from, ``[..., hidden]``, given the target's: the tapped
        layers' outputs side by side ``[..., len(taps)·hidden]`` through ``fuse``; without taps the
        last layer's output, as it is."""
        return target_features if self.fuse is None else self.fuse(target_features)


class SubsetHead(nn.Module):
    """The target's output head restricted to the rows ``vocab`` (SPEC.md §11.4).

    ``forward`` returns logits over the whole vocabulary with ``-inf`` outside ``vocab``, so the
    draft law ``q`` the engine verifies with is exactly the law the draft token was drawn from.
    With ``compact = True`` it returns the ``len(vocab)`` logits only: :class:`FeatureDrafter`
    draws in the draft vocabulary and maps the token and its law back (:func:`draw_in_subset`),
    which skips writing and reading a full-vocabulary row per draft. The rows are gathered once
    (a derived tensor of ``len(vocab) × hidden``, not a parameter)."""

    compact = False

    def __init__(self, lm_head: nn.Module, vocab: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = lm_head.weight.shape[0]
        self.register_buffer("vocab", vocab.to(lm_head.weight.device), persistent=False)
        self.register_buffer("weight", lm_head.weight.detach()[self.vocab], persistent=False)
        bias = getattr(lm_head, "bias", None)
        self.register_buffer("bias", None if bias is None else bias.detach()[self.vocab], persistent=False)

    def subset(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over ``vocab`` only: ``[..., len(vocab)]``."""
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.subset(x)
        if self.compact:
            return small
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(-1, self.vocab, small)


def draw_in_subset(logits: torch.Tensor, vocab: torch.Tensor, vocab_size: int, params: SamplingParams,
                   uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`draw` from ``logits [B, len(vocab)]`` over the draft vocabulary ``vocab`` (target
    ids): the token as a target id, and its law over the whole vocabulary ``[B, vocab_size]``
    (zero outside ``vocab``; None when greedy). The same law as drawing from full-vocabulary logits
    that are ``-inf`` outside ``vocab`` (SPEC.md §11.4): top-k and top-p keep the same tokens,
    since the excluded ones have probability 0 there; only the order the inverse CDF walks (and so
    which token a given uniform picks, and greedy's tie-break) differs."""
    token, q = draw(logits, params, uniforms)
    token = vocab[token]
    if q is not None:
        q = q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(-1, vocab, q)
    return token, q


def decoder_layer(config: Any, index: int) -> nn.Module:
    """A decoder layer of ``config``'s architecture (the class transformers' model uses)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(config)
    cls = type(probe.model.layers[0])
    return cls(config, index)


class FeatureDrafter:
    """Drafts with a :class:`FeatureHead` over the target's features (SPEC.md §11).

    Args:
        target: the target behind FlashSpec's static cache (its embedding, norm and head are used).
        head: the trained part, on the target's device and dtype.
        name: the drafter's name in statistics (default ``"feature"``).
        compile: run a proposal's window feed and its one-token forwards (gathers, input
            projection, layer, head) through ``torch.compile``, so that inductor fuses their
            small kernels before the step is captured as a CUDA graph (SPEC.md §11, "compiled
            proposals"). One compilation per width, none per sampling parameters: the draws
            between them stay eager.
    """

    joins_rows = True  # a running batch may hand it a joining row (prefill_row)
    MIN_WINDOW = 4  # the narrowest re-fed width (a handful of widths means a handful of graphs)
    # The widths _window returns that run compiled (powers of two from MIN_WINDOW, up to
    # StaticLM.COMPILED_WIDTHS), all compiled at the first compiled proposal of a shape.
    COMPILED_WINDOWS = (4, 8, 16)

    def __init__(self, target: StaticLM, head: FeatureHead, name: str | None = None, compile: bool = False) -> None:
        if not isinstance(target, StaticLM):
            raise ValueError("A feature drafter needs a target that runs over FlashSpec's static cache "
                             f"(architectures {', '.join(StaticLM.ARCHITECTURES)}).")
        if head.config.hidden_size != target.model.config.hidden_size:
            raise ValueError(f"This feature drafter was made for hidden size {head.config.hidden_size}; the "
                             f"target's is {target.model.config.hidden_size}.")
        self.target, self.head = target, head
        layers = len(target.base.layers)
        if head.taps is not None and max(head.taps) >= layers:
            raise ValueError(f"This feature drafter reads the target's decoder layers {list(head.taps)} (0-based); "
                             f"the target has {layers}.")
        # The target's features it reads (History.hidden keys): its taps', or its last layer's (before the norm).
        self.feature_layers = tapped_layers(head.taps, layers)
        self.name = name or "feature"
        self.lm = StaticLM(head.draft_model(target.model))  # prefills run it eagerly
        self.compiled = compile
        self._feed_step = torch.compile(self._feed, dynamic=False) if compile else self._feed
        self._next_step = torch.compile(self._next, dynamic=False) if compile else self._next
        self._warm_shape: tuple[int, ...] | None = None  # the history shape every window width was compiled for
        subset = self.lm.model.lm_head
        if isinstance(subset, SubsetHead):
            subset.compact = True  # this drafter draws in the draft vocabulary (draw_in_subset)
        self._subset = subset if isinstance(subset, SubsetHead) else None
        device = next(target.model.parameters()).device
        self._graphs = Graphs(enabled=device.type == "cuda")
        self._features: torch.Tensor | None = None  # [B, capacity, hidden]: the drafter's own outputs
        self._seen = Seen()  # read when the last proposal began (1 behind after a join: the pending token)

    @property
    def forward_seconds(self) -> float:
        return self.lm.forward_seconds

    def begin(self, batch_size: int) -> None:
        self._seen.forget()

    @property
    def _own(self) -> dict[int, torch.Tensor]:
        """Where the drafter's own layers write their outputs (its predicted features)."""
        return {len(self.head.layers): self._features}

    def _start(self, history: History) -> None:
        batch, capacity = history.tokens.shape
        if self.lm.reset(batch, capacity) or self._features is None or self._features.shape[:2] != (batch, capacity):
            self._graphs.clear()
            hidden = self.head.config.hidden_size
            self._features = torch.zeros(batch, capacity, hidden, dtype=self.head.fc.weight.dtype,
                                         device=history.tokens.device)

    def prefill_row(self, history: History, row: int, width: int | None = None) -> None:
        """Feed row ``row``'s prompt alone: a request that joined a running batch (SPEC.md §12).

        The pairs of positions ``0 … length − 2`` (``… width − 2`` with the target's padded
        prefill ``width``, §12 "Prefill widths": entries past the prompt are rewritten before they
        are read) over a view of that row of the drafter's cache and of its predicted features
        (:meth:`StaticLM.only_row <flashspec.models.static.StaticLM.only_row>`); the other rows' are
        neither read nor written.
        The catch-up window of the other rows is left as it was: their unseen positions have
        not changed (the batch's length bound does not grow when a row joins)."""
        self._check(history)
        self._start(history)
        width = max(int(history.length[row]), width or 0) - 1
        if width > 0:
            one = slice(row, row + 1)
            zeros = torch.zeros(1, dtype=torch.long, device=history.length.device)
            with self.lm.only_row(row):
                self._feed(history.tokens[one], tuple(h[one] for h in self._hidden(history)), self._features[one],
                           zeros, width, zeros[:, None])
        self._seen.joined(history, behind=1)  # (its pending token unfed)

    def _check(self, history: History) -> None:
        if history.hidden is None or any(n not in history.hidden for n in self.feature_layers):
            raise ValueError("A feature drafter needs the target's features (History.hidden): use it through "
                             "SpeculativeEngine, which provides them.")

    def _hidden(self, history: History) -> tuple[torch.Tensor, ...]:
        """The target's features this drafter reads, ``[B, capacity, hidden]`` each, in tap order."""
        return tuple(history.hidden[n] for n in self.feature_layers)

    def catch_up(self, history: History) -> int:
        """The positions the next proposal feeds beyond a steady step's (SPEC.md §4): the whole
        prefix the first time in a request, a window wider than the compiled widths after a gap,
        else 0 (host arithmetic only)."""
        return self._seen.catch_up(self._window(history), StaticLM.COMPILED_WIDTHS)

    def _window(self, history: History) -> int:
        """How many trailing committed positions to feed: every one whose true feature this
        drafter has not yet seen (the whole bound at a request's first proposal, SPEC.md §11),
        at least MIN_WINDOW, rounded up to a power of two, at most the capacity: always one of
        :func:`window_widths`."""
        bound = history.length_bound()
        unseen = bound if self._seen.first else max(1, self._seen.grown(history) + 1 + self._seen.behind)
        return min(history.tokens.shape[1], max(self.MIN_WINDOW, 1 << (unseen - 1).bit_length()))

    def widths(self, capacity: int) -> list[int]:
        """Every window a proposal over a cache of ``capacity`` positions may feed (one CUDA
        graph each, all captured at once: SPEC.md §11)."""
        return window_widths(capacity, self.MIN_WINDOW)

    def _prepare(self, history: History) -> int:
        """What a proposal does first: checks, a new request's buffers, the window to feed (noted)."""
        self._check(history)
        if self._seen.first:
            self._start(history)
        window = self._window(history)
        self._seen.fed(history)
        return window

    @torch.inference_mode()  # also when called outside generate: a compiled proposal must not trace autograd
    def propose(self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor) -> Draft:
        window = self._prepare(history)
        active = history.active if history.active is not None else torch.ones_like(history.length, dtype=torch.bool)
        self._graphs.reading(history.tokens, history.length, *self._hidden(history), active, uniforms,
                             self._features)
        tokens, probs = self._graphs.run_widths(self.widths(history.tokens.shape[1]), window, (num_tokens, params),
                                                lambda w: self._draft(history, w, num_tokens, params, uniforms))
        return Draft(tokens, probs)

    def network(self, tokens: torch.Tensor, features: torch.Tensor, start: torch.Tensor,
                logits_at: torch.Tensor | None = None, hidden_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The drafter's network on pairs: ``fc([f; e(tokens)])`` for ``tokens [B, q]`` and the
        features ``f [B, q, H]`` before them, then its layer(s), the final norm and the head, at
        positions ``start[b] + j``; ``hidden_out`` as for :meth:`StaticLM.forward`."""
        x = self.head.inputs(features, self.lm.base.embed_tokens(tokens))
        if torch.compiler.is_compiling():  # inside a compiled feed or step: the forward's own code, inlined
            return self.lm._forward(*self.lm._inputs(None, start, x), logits_at, None, hidden_out)
        return self.lm.forward_embeds(x, start, logits_at=logits_at, hidden_out=hidden_out)

    def _feed(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, ...], own: torch.Tensor, start: torch.Tensor,
              width: int, logits_at: torch.Tensor | None) -> torch.Tensor:
        """Feed the pairs ``(f_{t-1}, e_t)`` of positions ``start[b] … start[b] + width − 1`` of
        ``tokens [B, capacity]``, where ``f`` is the head's feature (:meth:`FeatureHead.fused`) of the
        target's features ``hidden`` (``[B, capacity, H]`` each, one per tap); the drafter's outputs
        (its predicted features) go to ``own [B, capacity, H]``."""
        capacity = tokens.shape[1]
        index = (start[:, None] + torch.arange(width, device=start.device)).clamp(max=capacity - 1)
        token = tokens.gather(1, index)
        at = (index - 1).clamp(min=0)[..., None]
        previous = torch.cat([h.gather(1, at.expand(-1, -1, h.shape[-1])) for h in hidden], dim=-1)
        previous = self.head.fused(previous.to(own.dtype))
        previous = torch.where((index > 0)[..., None], previous, torch.zeros_like(previous))  # f_{-1} = 0
        return self.network(token, previous, start, logits_at, {len(self.head.layers): own})

    def _next(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The logits after draft ``token [B]`` at ``position [B]``: fed with the drafter's own
        predicted feature at the position before it."""
        at = (position - 1).clamp(max=self._features.shape[1] - 1)
        feature = self._features.gather(1, at[:, None, None].expand(-1, 1, self._features.shape[-1]))
        return self.network(token[:, None], feature, position, hidden_out=self._own)[:, 0]

    @torch.inference_mode()
    def propose_chunks(self, history: History, num_tokens: int, chunk: int, params: SamplingParams,
                       uniforms: torch.Tensor) -> Iterator[Draft]:
        """:meth:`propose` in chunks of ``chunk`` drafts, each drafted when the engine asks for it
        (:class:`~flashspec.drafters.base.DraftsInChunks`, SPEC.md §2 "Chunked drafting"). Eager: no
        CUDA graph. It reads the target's features of committed positions only, never those the
        target's forwards of the step's chunks write."""
        logits, step, draw_token = self._begin(history, self._prepare(history))
        for tokens, probs in autoregress_chunks(logits, step, num_tokens, chunk, params, uniforms, draw_token):
            yield Draft(tokens, probs)

    def _draft(self, history: History, window: int, num_tokens: int, params: SamplingParams,
               uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pure tensor code (no host reads), so it can be captured as a graph."""
        logits, step, draw_token = self._begin(history, window)
        return autoregress(logits, step, num_tokens, params, uniforms, draw_token)

    def _begin(self, history: History, window: int) -> tuple[torch.Tensor, Callable[..., torch.Tensor], Any]:
        """Feed the last ``window`` committed positions: the logits after each row's pending token, the
        draft loop's one-token step and its draw (tensor code only)."""
        length, step = history.length, self._next_step
        logits = self._root_logits(history, window)
        subset = self._subset
        draw_token = None if subset is None else (
            lambda logits, params, u: draw_in_subset(logits, subset.vocab, subset.vocab_size, params, u))
        return logits, lambda token, i: step(token, length + i), draw_token

    def _root_logits(self, history: History, window: int) -> torch.Tensor:
        """Feed the last ``window`` committed positions of every row; the logits after the pending
        token, ``[B, V]`` (the draft vocabulary's with a compact head). With ``compile``, the feed
        of a window of up to COMPILED_WIDTHS positions runs compiled; a wider window's feed (the
        prompt's, a long gap's) runs eagerly."""
        feed = self._feed_step
        if window > StaticLM.COMPILED_WIDTHS:
            feed = self._feed
        length, tokens, hidden = history.length, history.tokens, self._hidden(history)
        if self.compiled and self._warm_shape != tuple(tokens.shape):
            # Compile every window width a later proposal may take now, at the first compiled
            # proposal of this shape (a warm-up's), not inside a later request (SPEC.md §11,
            # compiled proposals). Re-feeding committed positions writes what a feed of them wrote
            # (up to a width's rounding: acceptance only); entries past them are rewritten before
            # they are read, and the feed below rewrites the last `window` positions anyway.
            self._warm_shape = tuple(tokens.shape)
            for width in self.COMPILED_WINDOWS:
                if width != window:
                    begin = (length - width).clamp(min=0)
                    self._feed_step(tokens, hidden, self._features, begin, width, (length - 1 - begin)[:, None])
        start = (length - window).clamp(min=0)
        return feed(tokens, hidden, self._features, start, window, (length - 1 - start)[:, None])[:, 0]

    # ------------------------------------------------------------------ top-k expansion (SPEC.md §7)
    @property
    def draft_vocab_size(self) -> int:
        """The tokens the head drafts from (its draft vocabulary, or the target's)."""
        return int(self.lm.model.lm_head.weight.shape[0])

    @torch.inference_mode()
    def expand(self, history: History, depth: int, topk: int, nodes: int, params: SamplingParams) -> ExpandedDraft:
        """EAGLE-2's dynamic draft tree of ``depth`` levels, ``topk`` children per fed node, the
        ``nodes`` most probable paths kept (SPEC.md §7, "Top-k expansion"): the catch-up window as
        for :meth:`propose`, then one forward per level over the ``topk`` frontier nodes under a
        tree mask, their keys, values and features in a scratch (nothing written past the pending
        token). Eager, no host reads."""
        self._check(history)
        if self._seen.first:
            self._start(history)
        window = self._window(history)
        self._seen.fed(history)
        root = self._root_logits(history, window)
        vocab = None if self._subset is None else self._subset.vocab
        return expand_tree(root, self._tree_step(history), depth, topk, nodes, params, vocab)

    def _tree_step(self, history: History) -> Step:
        """Feeds one level's frontier: each node with its parent's predicted feature (the one at the
        pending token for the root's children), at position ``length − 1 + depth``."""
        features, fed, scratch = self._features, [], {}
        capacity, hidden = features.shape[1], features.shape[2]
        pending = (history.length - 1).clamp(0, capacity - 1)
        root = features.gather(1, pending[:, None, None].expand(-1, 1, hidden))  # [B, 1, H]

        def step(tokens: torch.Tensor, parents: torch.Tensor, sees: torch.Tensor, depth: int) -> torch.Tensor:
            parent = root.expand(-1, tokens.shape[1], -1)
            if fed:
                earlier = torch.cat(fed, dim=1).gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, hidden))
                parent = torch.where((parents >= 0)[..., None], earlier, parent)
            positions = (pending + depth).clamp(max=capacity - 1)[:, None].expand_as(tokens)
            logits, out = self._tree_network(tokens, parent, positions, pending, sees, scratch)
            fed.append(out)
            return logits

        return step

    def _tree_network(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                      pending: torch.Tensor, sees: torch.Tensor, scratch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The network on tree nodes ``tokens [B, W]`` with the features before them ``[B, W, H]``:
        each sees the cache up to ``pending [B]``, the nodes fed before that ``sees [B, W, M]`` marks
        (their keys and values in ``scratch``, which this extends) and itself. Returns the logits and
        the predicted features (the layers' output)."""
        started, lm = time.perf_counter(), self.lm
        batch, width = tokens.shape
        x = self.head.inputs(features, lm.base.embed_tokens(tokens))
        cache = (torch.arange(lm.capacity, device=tokens.device) <= pending[:, None])[:, None]
        itself = torch.eye(width, dtype=torch.bool, device=tokens.device).expand(batch, width, width)
        visible = torch.cat([cache.expand(batch, width, lm.capacity), sees, itself], dim=-1)
        before = scratch.get("kv")
        out, keys, values, _ = tree_layers(lm, x, positions, visible, before=before)
        if before is not None:
            keys = [torch.cat([a, b], dim=2) for a, b in zip(before[0], keys)]
            values = [torch.cat([a, b], dim=2) for a, b in zip(before[1], values)]
        scratch["kv"] = (keys, values)
        logits = lm.model.lm_head(lm.base.norm(out))
        lm.forward_seconds += time.perf_counter() - started
        return logits, out
