"""Training drafters made from the target (SPEC.md §11): ``flashspec train-drafter``.

Teacher forcing on the target's own features and next-token laws. The target runs frozen; only
the drafter's own part learns: a :class:`~flashspec.drafters.feature.FeatureHead` (kind
``feature``), a :class:`~flashspec.drafters.shallow.ShallowHead` (kind ``shallow``) or an
:class:`~flashspec.drafters.eagle3.Eagle3Head` (kind ``eagle3``, :mod:`.eagle3_head`). The loss is
distillation, the cross-entropy of the drafter's law against the target's (soft labels), or
against the next token itself with ``hard_labels``; each position weighted by the loss mask (1
where the token it predicts is a target: the target's answers in distilled data, every token of
text files). Checkpoints: :mod:`flashspec.drafters.checkpoint`; training data:
:mod:`flashspec.training.data`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..checks import check_flag, check_int, check_number, is_int, is_number
from ..drafters.checkpoint import file_sha256, read_meta
from ..drafters.eagle3 import Eagle3Head
from ..drafters.feature import FeatureHead, SubsetHead, tapped_layers
from ..drafters.low_rank import LowRank, add_low_rank
from ..drafters.shallow import ShallowHead
from .data import draft_vocab
from .distributed import ALONE, Ranks, summed_over_ranks
from .eagle3_head import check_eagle3_options, counted, eagle3_groups, eagle3_passes, new_eagle3_head
from .schedule import Schedule
from .unroll import chain_mask

__all__ = ["TrainOptions", "chain_mask", "continued_record", "estimate_acceptance", "new_head", "train_feature_head",
           "train_head", "training_totals"]


CLIP = 1.0  # gradient norm clipping
KINDS = ("feature", "shallow", "eagle3")


@dataclass(frozen=True)
class TrainOptions:
    """How a drafter trains (``flashspec train-drafter``'s flags)."""

    layers: int = 1  # decoder layers of the drafter's own part (feature) / adapter layers (shallow)
    shared_layers: int | None = None  # shallow: the target's layers it shares (default: a quarter)
    head_width: int | None = None  # shallow: the residual MLP's width (default: the hidden size)
    width: int | None = None  # feature: its layers' MLP width (default: the target's)
    heads: int | None = None  # feature: its layers' query heads (default: the target's)
    draft_vocab: int | None = None  # feature: keep the head's rows of this many most frequent tokens
    rank: int | None = None  # train a low-rank delta of this rank over a base drafter (train_head's base)
    steps: int = 1000
    batch: int = 8  # sequences per step
    seq_len: int = 256  # tokens per sequence
    lr_layers: float = 5e-5  # the decoder layers' learning rate (the write-up's starting point)
    lr_head: float = 1e-4  # fc's learning rate
    hard_labels: bool = False  # cross-entropy against the next token instead of the target's law
    seed: int = 0
    estimate_every: int = 50  # steps between two acceptance estimates on the estimate text
    max_seconds: float | None = None  # stop after this long even if steps remain (logged)
    unroll: int = 3  # feature: passes per step, pass j fed pass j-1's predicted features (SPEC.md §11.6)
    # feature: weight of a smooth-L1 loss on the predicted features (EAGLE-1); None: 1 for a head on
    # the last layer, 0 with taps (a fused feature has no true value to regress to: EAGLE-3)
    feature_weight: float | None = None
    taps: tuple[int, ...] | None = None  # feature: fuse these target layers' outputs (0-based; SPEC.md §11)
    fuse_rank: int | None = None  # feature with taps: fuse as a rank-R product (None: a full-rank matrix)
    schedule_steps: int | None = None  # the learning-rate schedule's length over every run (default: steps)
    start_step: int = 0  # the schedule's steps done by earlier runs (train-drafter --resume)

    def __post_init__(self) -> None:
        optional = ("shared_layers", "head_width", "width", "heads", "draft_vocab", "rank", "schedule_steps",
                    "fuse_rank")
        for name in ("layers", "steps", "batch", "seq_len", "estimate_every", "unroll", *optional):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            check_int(name, value, 1)
        for name in ("lr_layers", "lr_head"):
            check_number(name, getattr(self, name), above=0, below=1, rule="a number in (0, 1)")
        if self.max_seconds is not None and not (is_number(self.max_seconds) and self.max_seconds > 0):
            raise ValueError(f"max_seconds must be a number > 0 (or None); got {self.max_seconds!r}.")
        if self.feature_weight is not None:
            check_number("feature_weight", self.feature_weight, 0, rule="a number >= 0")
        if self.taps is not None:
            taps = tuple(self.taps) if isinstance(self.taps, (list, tuple)) else ()
            if not taps or not all(is_int(t) and t >= 0 for t in taps) or len(set(taps)) != len(taps):
                raise ValueError(f"taps must hold one or more distinct decoder-layer indices >= 0; got {self.taps!r}.")
            object.__setattr__(self, "taps", tuple(int(t) for t in taps))
            if self.feature_weight:
                raise ValueError("feature_weight is for drafters on the target's last layer: a fused feature (taps) "
                                 "has no true value to regress to (EAGLE-3 trains on tokens only); leave it unset.")
        if self.fuse_rank is not None and self.taps is None:
            raise ValueError(f"fuse_rank sets the rank of the map that fuses the tapped layers: give taps too "
                             f"(fused features); got fuse_rank {self.fuse_rank} without taps.")
        if self.unroll >= self.seq_len:
            raise ValueError(f"unroll ({self.unroll}) must be smaller than seq_len ({self.seq_len}).")
        check_flag("hard_labels", self.hard_labels)
        check_int("start_step", self.start_step, 0)
        Schedule(self.schedule_steps or self.steps, self.steps, self.start_step)  # a complete schedule is refused


def _features_and_logits(target: Any, ids: torch.Tensor, after: tuple[int, ...] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features and logits for ``ids [b, T]``. Features: with ``after``, the outputs of
    its first ``n`` layers for each ``n`` in ``after``, side by side ``[b, T, len(after)·hidden]``;
    None: its last layer's output, before the final norm ``[b, T, hidden]``."""
    captured: dict[int, torch.Tensor] = {}

    def keeper(n: int) -> Any:
        def keep(module: Any, args: Any, output: Any = None) -> None:
            captured[n] = args[0] if output is None else (output[0] if isinstance(output, tuple) else output)
        return keep

    if after is None:
        handles = [target.model.norm.register_forward_pre_hook(keeper(0))]
    else:
        handles = [target.model.layers[n - 1].register_forward_hook(keeper(n)) for n in after]
    try:
        with torch.no_grad():
            logits = target(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return (captured[0] if after is None else torch.cat([captured[n] for n in after], dim=-1)), logits


def _cast(features: torch.Tensor, head: Any, target: Any) -> Any:
    """float32 master weights over a 16-bit target: the head computes in the target's dtype."""
    dtype, compute = next(head.parameters()).dtype, next(target.parameters()).dtype
    if compute == dtype:
        return contextlib.nullcontext()
    return torch.autocast(features.device.type, dtype=compute)


def _head_logits(draft: Any, hidden: torch.Tensor) -> torch.Tensor:
    return draft.lm_head.subset(hidden) if isinstance(draft.lm_head, SubsetHead) else draft.lm_head(hidden)


def _passes(head: Any, draft: Any, target: Any, ids: torch.Tensor, features: torch.Tensor,
            count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The feature drafter's logits and predicted features over ``count`` chained passes (SPEC.md
    §11.6): pass 1 reads the target's true features ``fc([f_{t−1}; e_t])`` (``f``: the head's
    :meth:`~FeatureHead.fused` feature of ``features``); pass ``j`` reads pass ``j − 1``'s
    predicted ones ``fc([f̂_{t−1}; e_t])``, attending as a ``j``-th draft would. An EAGLE-3 head:
    :func:`~flashspec.training.eagle3_head.eagle3_passes` (``draft`` unused)."""
    if isinstance(head, Eagle3Head):
        with _cast(features, head, target):
            return eagle3_passes(head, target, ids, features, count)
    dtype = next(head.parameters()).dtype
    length = ids.shape[1]
    captured: list[torch.Tensor] = []
    hook = draft.model.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    logits, predicted = [], []
    try:
        with _cast(features, head, target):
            embeddings = target.model.embed_tokens(ids).to(dtype)
            previous = head.fused(features.to(dtype))
            blocks: list[torch.Tensor] = []
            for j in range(1, count + 1):
                shifted = torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1)  # f_{t-1}
                blocks.append(head.inputs(shifted, embeddings))
                if j == 1:
                    out = draft.model(inputs_embeds=blocks[0])
                else:
                    mask = chain_mask(j, length, ids.device)[None, None]
                    positions = torch.arange(length, device=ids.device).repeat(j)[None]
                    out = draft.model(inputs_embeds=torch.cat(blocks, dim=1), attention_mask=mask,
                                      position_ids=positions)
                logits.append(_head_logits(draft, out.last_hidden_state[:, -length:]))
                previous = captured[-1][:, -length:]  # this pass's predicted features, before the norm
                predicted.append(previous)
    finally:
        hook.remove()
    return logits, predicted


def _draft_logits(head: Any, draft: Any, target: Any, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The drafter's logits at every position of ``ids`` (teacher-forced on the true features);
    over its draft vocabulary only when it has one (SPEC.md §11.4)."""
    if not isinstance(head, ShallowHead):
        return _passes(head, draft, target, ids, features, 1)[0][0]
    with _cast(features, head, target):
        x = features.to(next(head.parameters()).dtype)  # the target's state after its shared layers
        return _head_logits(draft, draft.model(inputs_embeds=x).last_hidden_state)


def _reads(head: Any, target: Any) -> tuple[int, ...] | None:
    """The target's layer counts whose outputs ``head`` reads (None: the last layer's, before the norm)."""
    if isinstance(head, ShallowHead):
        return (head.shared_layers,)
    return None if head.taps is None else tapped_layers(head.taps, target.config.num_hidden_layers)


def _weights(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """``[b, T]`` float: whether position ``t`` counts, i.e. whether the token it predicts,
    ``t + 1``, is a target in the loss mask ``[b, T]`` (None: all are). The last position's next
    token lies past the chunk: it takes its own token's mask (inside an answer, the answer goes on)."""
    if mask is None:
        return torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    mask = mask.to(ids.device, torch.float32)
    return torch.cat([mask[:, 1:], mask[:, -1:]], dim=1)


def _feature_weight(head: Any, options: TrainOptions) -> float:
    """The feature loss's weight for ``head`` (TrainOptions.feature_weight; None: 1, or 0 with taps)."""
    if isinstance(head, ShallowHead):
        return 0.0
    if head.taps is not None:
        if options.feature_weight:
            raise ValueError("feature_weight is for drafters on the target's last layer; this one fuses taps "
                             f"{list(head.taps)} (EAGLE-3 trains on tokens only): leave it unset.")
        return 0.0
    return 1.0 if options.feature_weight is None else options.feature_weight


def _vocab(head: Any) -> torch.Tensor | None:
    return head.lm_head.vocab if isinstance(head, Eagle3Head) else getattr(head, "vocab", None)


def _draft(head: Any, target: Any) -> Any:
    """The model ``head`` runs in (None for an EAGLE-3 head, which runs alone)."""
    return None if isinstance(head, Eagle3Head) else head.draft_model(target)


DEPTHS = 3  # draft depths the acceptance estimate reports (feature drafters)


def _acceptance(head: Any, draft: Any, target: Any, chunks: torch.Tensor, batch: int,
                mask: torch.Tensor | None = None) -> list[float]:
    """``[α₁, α₂, …]`` on ``chunks``: how often the drafter's argmax is the target's at draft depth
    1, 2, … (depth ``j``: after ``j − 1`` drafts of its own, fed the true tokens; SPEC.md §11.6),
    over the positions whose next token is a target of the loss ``mask`` (None: all).
    Shallow drafters read the target's own layers at every depth, so they report α₁ only."""
    vocab = _vocab(head)
    depths = 1 if isinstance(head, ShallowHead) else DEPTHS
    agree, total = [0] * depths, [0] * depths
    with torch.no_grad():
        for i in range(0, len(chunks), batch):
            ids = chunks[i : i + batch].to(target.device)
            counts = counted(head, _weights(None if mask is None else mask[i : i + batch], ids)).bool()
            features, logits = _features_and_logits(target, ids, _reads(head, target))
            if isinstance(head, ShallowHead):
                mine = [_draft_logits(head, draft, target, ids, features)]
            else:
                mine = _passes(head, draft, target, ids, features, depths)[0]
            truth = logits.argmax(-1)
            for j, values in enumerate(mine):
                best = values.argmax(-1)
                if vocab is not None:
                    best = vocab[best]
                agree[j] += int(((best == truth) & counts)[:, j:].sum())  # a chain needs j positions before it
                total[j] += int(counts[:, j:].sum())
    return [a / max(t, 1) for a, t in zip(agree, total)]


def estimate_acceptance(head: Any, target: Any, chunks: torch.Tensor, batch: int = 8,
                        mask: torch.Tensor | None = None) -> list[float]:
    """``[α₁, α₂, …]`` of ``head`` on ``chunks [N, T]`` where ``mask`` (the loss mask) says so
    (the progress bar's estimate, for a saved head too)."""
    return _acceptance(head, _draft(head, target), target, chunks, batch, mask)


def new_head(kind: str, target: Any, options: TrainOptions, vocab: torch.Tensor | None = None) -> Any:
    """An untrained head of ``kind`` for ``target``, on its device and dtype."""
    if kind == "feature":
        head = FeatureHead(target.config, options.layers, options.width, options.heads, vocab, options.taps,
                           options.fuse_rank)
    elif kind == "eagle3":
        return new_eagle3_head(target, options, vocab)
    elif kind == "shallow":
        if options.taps is not None or options.fuse_rank is not None:
            raise ValueError("taps and fuse_rank (fused features) are options of the feature drafter only.")
        shared = options.shared_layers or max(1, target.config.num_hidden_layers // 4)
        head = ShallowHead(target.config, shared, options.layers, options.head_width)
    else:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}.")
    parameter = next(target.parameters())
    return head.to(device=parameter.device, dtype=parameter.dtype)


def train_head(kind: str, target: Any, chunks: torch.Tensor, options: TrainOptions,
               estimate: torch.Tensor | None = None, progress: bool = True, base: Any = None,
               always: tuple[int, ...] = (), mask: torch.Tensor | None = None,
               estimate_mask: torch.Tensor | None = None, ranks: Ranks = ALONE) -> tuple[Any, dict]:
    """Train a drafter head of ``kind`` for ``target`` (frozen) on ``chunks [N, seq_len]``; return it
    with a log (losses, acceptance estimates, seconds, tokens seen).

    ``mask [N, seq_len]`` (bool): the loss mask, True on the tokens that are training targets (a
    distilled folder's answers, :func:`~flashspec.training.data.training_chunks`); the others are
    context only. None: every token. ``estimate_mask``: the same for ``estimate``.

    ``base``: a trained head to start from. With ``options.rank`` only a low-rank delta of each of
    its linear maps learns (:class:`LowRank`; a per-domain drafter over a general one, SPEC.md
    §11.5); without, all of it trains further. ``always``: token ids a new draft vocabulary keeps.
    ``ranks``: the processes training together (:mod:`.distributed`; default: this one alone)."""
    estimate, progress = (estimate, progress) if ranks.writes else (None, False)  # rank 0's part
    torch.manual_seed(options.seed)
    device = next(target.parameters()).device
    if options.rank is not None and base is None:
        raise ValueError("A low-rank delta (rank) needs a base drafter to train over.")
    if kind == "eagle3" or isinstance(base, Eagle3Head):
        check_eagle3_options(options)
    if mask is not None and tuple(mask.shape) != tuple(chunks.shape):
        raise ValueError(f"mask must have the chunks' shape {tuple(chunks.shape)}; got {tuple(mask.shape)}.")
    if base is not None and options.taps is not None and options.taps != getattr(base, "taps", None):
        raise ValueError(f"taps {list(options.taps)} differ from the base drafter's {getattr(base, 'taps', None)}: "
                         "a drafter trained further keeps its base's taps.")
    if base is not None and options.fuse_rank is not None and options.fuse_rank != getattr(base, "fuse_rank", None):
        raise ValueError(f"fuse_rank {options.fuse_rank} differs from the base drafter's "
                         f"{getattr(base, 'fuse_rank', None)}: a drafter trained further keeps its base's fuse.")
    if base is not None:
        head = base
        if options.rank is not None:
            add_low_rank(head, options.rank)
    else:
        vocab = None
        if options.draft_vocab is not None:
            if kind == "shallow":
                raise ValueError("A reduced draft vocabulary is an option of the feature drafter only.")
            vocab = draft_vocab(chunks, options.draft_vocab, always, mask)  # among the training targets
        head = new_head(kind, target, options, vocab)
    head = head.float()  # master weights in float32 (SPEC.md §11.3); returned in the target's dtype
    draft = _draft(head, target)
    reads = _reads(head, target)
    feature_weight = _feature_weight(head, options)
    training = target.training
    target.eval()
    requires = {n: p.requires_grad for n, p in target.named_parameters()}
    for p in target.parameters():
        p.requires_grad_(False)  # restored below
    groups = _parameter_groups(head, options)
    step_loss = ranks.loss_of(head)  # on several ranks: DDP over the head, the ranks' gradients summed
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    peaks = [group["lr"] for group in groups]

    schedule = Schedule(options.schedule_steps or options.steps, options.steps, options.start_step,
                        options.max_seconds)
    rate = schedule.fraction

    trainable = [p for group in groups for p in group["params"]]
    generator = torch.Generator().manual_seed(options.seed)
    log: dict[str, Any] = {"kind": kind, "options": {**asdict(options), "feature_weight": feature_weight},
                           "loss": [], "estimates": [], "tokens": 0, "target_tokens": 0, "processes": ranks.world}
    if estimate is not None:
        log["estimates"].append(_estimate(0, _acceptance(head, draft, target, estimate, options.batch, estimate_mask)))
    for group, peak in zip(optimizer.param_groups, peaks):
        group["lr"] = peak * rate(0, 0.0)
    started = time.perf_counter()
    try:
        bar = tqdm(range(options.steps), disable=not progress, desc=f"training {kind} drafter", unit="step")
        for step in bar:
            rows = ranks.shard(torch.randint(0, len(chunks), (options.batch,), generator=generator))
            ids = chunks[rows].to(device)
            weights = counted(head, _weights(None if mask is None else mask[rows], ids))
            features, logits = _features_and_logits(target, ids, reads)
            loss = step_loss(_loss, head, draft, target, ids, features, logits, options, weights, feature_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            value, tokens, scored, elapsed = ranks.agree(loss, ids.numel(), weights[:, :-1].sum(), started)
            if not math.isfinite(value):
                raise ValueError(f"The training loss is not finite at step {step}: lower the learning rates.")
            torch.nn.utils.clip_grad_norm_(trainable, CLIP)
            optimizer.step()
            fraction = rate(step + 1, elapsed)  # the next step's learning rates
            for group, peak in zip(optimizer.param_groups, peaks):
                group["lr"] = peak * fraction
            log["lr_fraction"] = fraction
            log["loss"].append(value)
            log["tokens"] += tokens
            log["target_tokens"] += scored  # positions the loss scored
            out_of_time = options.max_seconds is not None and elapsed > options.max_seconds
            if estimate is not None and ((step + 1) % options.estimate_every == 0 or step + 1 == options.steps
                                         or out_of_time):
                alphas = _acceptance(head, draft, target, estimate, options.batch, estimate_mask)
                log["estimates"].append(_estimate(step + 1, alphas))
                bar.set_postfix(loss=f"{value:.3f}", alpha="/".join(f"{a:.2f}" for a in alphas))
            else:
                bar.set_postfix(loss=f"{value:.3f}")
            if out_of_time:
                log["stopped_at_step"] = step + 1  # max_seconds reached
                break
    finally:
        for n, p in target.named_parameters():
            p.requires_grad_(requires[n])
        target.train(training)
    log["seconds"] = time.perf_counter() - started
    log["schedule"] = schedule.record(len(log["loss"]), log["seconds"])
    if device.type == "cuda":
        log["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    parameter = next(target.parameters())
    return (head.placed(parameter.device, parameter.dtype) if isinstance(head, Eagle3Head)
            else head.to(parameter.dtype)).eval(), log


def training_totals(log: dict[str, Any]) -> dict[str, Any]:
    """Steps, tokens and seconds of a training record, counting the runs it continued
    (``log["before"]``, written when ``train-drafter --base`` trains a whole drafter further)."""
    before = training_totals(log["before"]) if isinstance(log.get("before"), dict) else {"steps": 0, "tokens": 0,
                                                                                          "seconds": 0.0}
    steps = log.get("stopped_at_step") or len(log.get("loss", [])) or log.get("steps", 0)
    return {"steps": before["steps"] + steps, "tokens": before["tokens"] + log.get("tokens", 0),
            "seconds": before["seconds"] + log.get("seconds", 0.0)}


def continued_record(folder: str | Path) -> dict[str, Any]:
    """What a run that trains the drafter in ``folder`` further records of it (``log["before"]``):
    its path and checksum, its totals (:func:`training_totals`) and its acceptance estimates, with
    their steps counted from the first run's start."""
    folder = Path(folder)
    prior = read_meta(folder).get("training", {})
    totals = training_totals(prior)
    own = totals["steps"] - (prior.get("stopped_at_step") or len(prior.get("loss", [])) or prior.get("steps", 0))
    estimates = list(prior["before"].get("estimates", [])) if isinstance(prior.get("before"), dict) else []
    estimates += [{**e, "step": e["step"] + own} for e in prior.get("estimates", [])]
    weights = folder / read_meta(folder).get("weights", "drafter.safetensors")  # an EAGLE-3 head's: model.safetensors
    return {"path": str(folder), "sha256": file_sha256(weights), **totals,
            "estimates": estimates}


def _estimate(step: int, alphas: list[float]) -> dict[str, Any]:
    return {"step": step, "alpha1": alphas[0], "alpha": alphas}


def _mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The ``weights``-weighted mean of ``values`` (0 where no weight), over every rank's weights."""
    return (values * weights).sum() / summed_over_ranks(weights.sum()).clamp(min=1)


def _loss(head: Any, draft: Any, target: Any, ids: torch.Tensor, features: torch.Tensor, logits: torch.Tensor,
          options: TrainOptions, weights: torch.Tensor | None = None, feature_weight: float = 0.0) -> torch.Tensor:
    """The training loss (SPEC.md §11.3, §11.6): the cross-entropy of each pass's law against the
    target's (or the next token), pass ``j`` weighted ``0.8^(j−1)`` and counted from position
    ``j − 1`` on; plus ``feature_weight`` × smooth-L1 between predicted and true features. Each
    position counts by ``weights [b, T]`` (:func:`_weights`: the loss mask of the token it
    predicts; None: all), so masked positions are context only: no term of the loss reads their
    outputs."""
    vocab = _vocab(head)
    weights = counted(head, _weights(None, ids) if weights is None else weights)
    if isinstance(head, ShallowHead):
        passes, predicted = [_draft_logits(head, draft, target, ids, features)], []
    else:
        passes, predicted = _passes(head, draft, target, ids, features, options.unroll)
    counts = weights[:, :-1]  # the cross-entropy's positions: those whose next token is in the chunk
    if options.hard_labels:
        labels = ids[:, 1:]
        if vocab is not None:  # position in the draft vocabulary; -100 (ignored) outside it
            where = torch.searchsorted(vocab, labels).clamp(max=len(vocab) - 1)
            labels = torch.where(vocab[where] == labels, where, torch.full_like(labels, -100))
        counts = counts * (labels != -100)
    else:
        law = torch.softmax(logits[:, :-1].float(), dim=-1)
        if vocab is not None:
            law = law[..., vocab]  # the target's mass outside the draft vocabulary is lost to it
    total, norm = 0.0, 0.0
    for j, mine in enumerate(passes):
        mine = mine[:, j:-1].float()
        if options.hard_labels:
            each = torch.nn.functional.cross_entropy(mine.flatten(0, 1), labels[:, j:].flatten(), ignore_index=-100,
                                                     reduction="none").view_as(mine[..., 0])
        else:
            each = -(law[:, j:] * torch.log_softmax(mine, dim=-1)).sum(-1)
        part = _mean(each, counts[:, j:])
        if feature_weight and predicted:
            error = torch.nn.functional.smooth_l1_loss(predicted[j][:, j:].float(), features[:, j:].float(),
                                                       reduction="none").mean(-1)
            part = part + feature_weight * _mean(error, weights[:, j:])
        total, norm = total + 0.8**j * part, norm + 0.8**j
    return total / norm


def _parameter_groups(head: Any, options: TrainOptions) -> list[dict[str, Any]]:
    """The optimizer's groups: the head's input / output maps at ``lr_head``, its decoder layers at
    ``lr_layers``; with a low-rank delta, only the delta's factors (same split)."""
    if isinstance(head, Eagle3Head):
        return eagle3_groups(head, options)
    if isinstance(head, ShallowHead):
        maps = [head.fc1, head.fc2]
    else:  # fc, and a fused head's fuse
        maps = [head.fc] + ([] if head.fuse is None else [head.fuse])
    outer = [p for m in maps for p in m.parameters()]
    inner = list(head.layers.parameters())
    if options.rank is not None:
        factors = {id(p) for m in head.modules() if isinstance(m, LowRank) for p in m.parameters()}
        for p in head.parameters():
            p.requires_grad_(id(p) in factors)
        outer = [p for m in maps for p in m.parameters() if id(p) in factors]
        inner = [p for p in head.layers.parameters() if id(p) in factors]
    return [{"params": outer, "lr": options.lr_head}, {"params": inner, "lr": options.lr_layers}]


def train_feature_head(target: Any, chunks: torch.Tensor, options: TrainOptions,
                       estimate: torch.Tensor | None = None, progress: bool = True) -> tuple[FeatureHead, dict]:
    """:func:`train_head` of kind ``"feature"``."""
    return train_head("feature", target, chunks, options, estimate, progress)
