"""A drafter made from the target's first layers plus trained adapters (SPEC.md §11).

The target's first ``N`` layers run on the target's own cache (as ``early-exit:N``). Their output
goes through ``K`` trained adapter decoder layers of the target's class (a cache of their own),
the target's final norm, a trained residual MLP and the target's head. The adapters catch up on
committed positions with the target's own features after ``N`` layers (``History.hidden[N]``).
With ``reuse=True`` a proposal hands back the target's states after ``N`` layers at the positions
it fed, and the verify forward starts from them (SPEC.md §11, verify reuse; off by default).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..checks import check_flag, check_int, is_int
from ..models.graphs import Graphs
from ..models.static import StaticLM
from ..sampling import SamplingParams
from .base import Draft, History, Seen, autoregress
from .feature import FeatureDrafter, decoder_layer

__all__ = ["ShallowHead", "ShallowDrafter", "check_reuse"]

PREFIX = "shallow:"


class _ResidualHead(nn.Module):
    """``lm_head(x + fc2(silu(fc1(x))))``: a trained MLP in hidden space before the target's head."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, lm_head: nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2, self.lm_head = fc1, fc2, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x + self.fc2(torch.nn.functional.silu(self.fc1(x))))


class ShallowHead(nn.Module):
    """The trainable part of a shallow drafter (SPEC.md §11): ``adapters`` decoder layers of the
    target's architecture over the target's features after its first ``shared_layers`` layers,
    then the target's final norm, a residual MLP ``fc1 → SiLU → fc2`` of width ``head_width``
    (``fc2`` starts at zero) and the target's head."""

    def __init__(self, config: Any, shared_layers: int, adapters: int = 2, head_width: int | None = None) -> None:
        super().__init__()
        total = config.num_hidden_layers
        check_int("shared_layers", shared_layers, 1, total - 1, upto=f"{total - 1} (the target has {total})")
        check_int("adapters", adapters, 1)
        hidden = config.hidden_size
        width = head_width or hidden
        if not is_int(width) or width < 1:
            raise ValueError(f"head_width must be an integer >= 1; got {head_width!r}.")
        self.shared_layers = shared_layers
        self.config = copy.deepcopy(config)
        self.config.num_hidden_layers = adapters
        if getattr(self.config, "layer_types", None) is not None:
            self.config.layer_types = self.config.layer_types[:adapters]
        self.layers = nn.ModuleList(decoder_layer(self.config, i) for i in range(adapters))
        self.fc1 = nn.Linear(hidden, width, bias=False)
        self.fc2 = nn.Linear(width, hidden, bias=False)
        with torch.no_grad():
            self.fc2.weight.zero_()

    def draft_model(self, target: nn.Module) -> nn.Module:
        """A model of the target's class: these adapter layers, the target's norm, rotary embedding
        and embedding (unused: the input is the target's features), this MLP and the target's head."""
        with torch.device("meta"):
            model = type(target)(self.config)
        model.model.layers = self.layers
        model.model.embed_tokens = target.model.embed_tokens
        model.model.norm = target.model.norm
        model.model.rotary_emb = target.model.rotary_emb
        model.lm_head = _ResidualHead(self.fc1, self.fc2, target.lm_head)
        model.generation_config = target.generation_config
        return model.eval()


class ShallowDrafter:
    """Drafts with the target's first ``N`` layers (its cache shared, as ``early-exit:N``) and a
    trained :class:`ShallowHead` over their output (SPEC.md §11).

    Per drafted token: the target's first ``N`` layers on the token (writing the target's cache
    at positions the verify forward rewrites), then the adapters (a cache of their own). Before a
    proposal the adapters catch up on the committed positions they have not seen with the target's
    own features after ``N`` layers (``History.hidden[N]``, written by its forwards).

    ``reuse=True`` (off by default; ``SpeculativeEngine(reuse_shallow=True)``): each proposal also
    hands back the target's states after ``N`` layers at the positions it fed (``Draft.states``),
    so that the verify forward does not recompute those layers for them (SPEC.md §11, verify
    reuse); its forwards then also write the features ``History.hidden[n]``, ``n < N``, that the
    verify no longer writes at those positions."""

    MIN_WINDOW = 4
    joins_rows = True  # a running batch may hand it a joining row (prefill_row)

    def __init__(self, target: StaticLM, head: ShallowHead, name: str | None = None, reuse: bool = False) -> None:
        if not isinstance(target, StaticLM):
            raise ValueError("A shallow drafter needs a target that runs over FlashSpec's static cache "
                             f"(architectures {', '.join(StaticLM.ARCHITECTURES)}).")
        if head.shared_layers >= len(target.base.layers) or head.config.hidden_size != target.model.config.hidden_size:
            raise ValueError("This shallow drafter was made for another target shape.")
        check_flag("reuse", reuse)
        self.target, self.head, self.reuse = target, head, reuse
        self.feature_layer = head.shared_layers  # it resumes from the target's state after its shared layers
        self.feature_layers = (self.feature_layer,)  # ReadsFeatures
        self.name = name or f"shallow:{head.shared_layers}"
        self.lm = StaticLM(head.draft_model(target.model))
        device = next(target.model.parameters()).device
        self._graphs = Graphs(enabled=device.type == "cuda")
        self._seen = Seen()  # as FeatureDrafter's

    @property
    def forward_seconds(self) -> float:
        return self.lm.forward_seconds  # (the shared layers' time is counted in the target's)

    def begin(self, batch_size: int) -> None:
        self._seen.forget()

    def prefill_row(self, history: History, row: int, width: int | None = None) -> None:
        """Feed row ``row``'s prompt features alone: a request that joined a running batch
        (SPEC.md §12). The adapters see the target's features after ``N`` layers at positions
        ``0 … length − 2`` (``… width − 2`` with the target's padded prefill ``width``, §12
        "Prefill widths") over a view of that row of their cache
        (:meth:`StaticLM.only_row <flashspec.models.static.StaticLM.only_row>`), and no other row is read
        or written. (The shared layers' entries for the row are the target's own, written by its
        prefill.)"""
        self._check(history)
        batch, capacity = history.tokens.shape
        if self.lm.reset(batch, capacity):
            self._graphs.clear()
        width = max(int(history.length[row]), width or 0) - 1
        if width > 0:
            zeros = torch.zeros(1, dtype=torch.long, device=history.length.device)
            with self.lm.only_row(row):
                features = history.hidden[self.feature_layer][row : row + 1, :width]
                self.lm.forward_embeds(features, zeros, logits_at=zeros[:, None])
        self._seen.joined(history, behind=1)  # (its pending token unfed)

    def _check(self, history: History) -> None:
        if history.hidden is None or self.feature_layer not in history.hidden:
            raise ValueError("A shallow drafter needs the target's features (History.hidden): use it through "
                             "SpeculativeEngine, which provides them.")

    _window = FeatureDrafter._window
    widths = FeatureDrafter.widths
    catch_up = FeatureDrafter.catch_up

    def propose(self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor) -> Draft:
        self._check(history)
        if self._seen.first:
            batch, capacity = history.tokens.shape
            if self.lm.reset(batch, capacity):
                self._graphs.clear()
        active = history.active if history.active is not None else torch.ones_like(history.length, dtype=torch.bool)
        below = {n: h for n, h in history.hidden.items() if n < self.feature_layer} if self.reuse else {}
        self._graphs.reading(history.tokens, history.length, history.hidden[self.feature_layer], active, uniforms,
                             self.target.keys[0], self.lm.keys[0], *below.values())
        window = self._window(history)
        self._seen.fed(history)
        tokens, probs, states = self._graphs.run_widths(
            self.widths(history.tokens.shape[1]), window, (num_tokens, params),
            lambda w: self._draft(history, w, num_tokens, params, uniforms, below or None))
        return Draft(tokens, probs, states, self.feature_layer if self.reuse else None)

    def _draft(self, history: History, window: int, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor,
               below: dict[int, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Pure tensor code (no host reads), so it can be captured as a graph. With ``reuse``, also
        the target's states after ``N`` layers of the fed tokens ``[B, k, hidden]``; ``below``: the
        feature buffers of fewer layers, written at the fed positions (SPEC.md §11, verify reuse)."""
        tokens, length = history.tokens, history.length
        features = history.hidden[self.feature_layer]
        capacity, hidden = features.shape[1], features.shape[2]
        start = (length - window).clamp(min=0)
        index = (start[:, None] + torch.arange(window, device=length.device)).clamp(max=capacity - 1)
        known = features.gather(1, index[..., None].expand(-1, -1, hidden))
        pending = tokens.gather(1, (length - 1)[:, None])
        shared = {"layers": self.feature_layer, "hidden_out": below}
        shallow = self.target.layer_states(pending, length - 1, **shared)  # [B, 1, H]
        fed = [shallow]
        x = torch.where((index == (length - 1)[:, None])[..., None], shallow.to(known.dtype), known)
        logits = self.lm.forward_embeds(x, start, logits_at=(length - 1 - start)[:, None])[:, 0]

        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            fed.append(self.target.layer_states(token[:, None], length + i, **shared))
            return self.lm.forward_embeds(fed[-1], length + i)[:, 0]

        drafted, probs = autoregress(logits, step, num_tokens, params, uniforms)
        states = torch.cat(fed, dim=1) if self.reuse else None  # the pending token's, then d_1 … d_{k-1}'s
        return drafted, probs, states


def check_reuse(drafters: list[Any], tensor_parallel: Any) -> None:
    """``reuse_shallow=True`` needs a drafter whose states the verify can reuse, on one device
    (``tensor_parallel``: the target's group, None on one device)."""
    if not any(isinstance(d, ShallowDrafter) and d.reuse for d in drafters):
        names = ", ".join(repr(d.name) for d in drafters) or "none"
        raise ValueError("reuse_shallow=True lets the verify forward reuse the states of a shallow drafter "
                         "('shallow:DIR', SPEC.md §11), the only drafter kind that hands them back, but "
                         f"this engine has no shallow drafter (drafters: {names}).")
    if tensor_parallel is not None:
        raise ValueError("reuse_shallow=True does not work with a tensor-parallel target: each rank's drafter "
                         "fed its own drafts, which may differ from rank 0's that every rank verifies "
                         "(SPEC.md §9, §11).")
