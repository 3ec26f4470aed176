"""The speculative decoding loop: select → propose → score → verify → commit → update."""

from __future__ import annotations

import json
from pathlib import Path
import numbers
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .cache import StaticLM, make_lm
from .graphs import Graphs
from .drafters import DatastoreDrafter, Drafter, History, ModelDrafter, NgramDrafter
from .models import context_window, load_model, load_tokenizer, check_no_sliding_window
from .parallel import tensor_parallel_of
from .sampling import SamplingParams, sample
from .select import Observation, Selector, make_selector, selector_from_state_dict
from .verify import verify

__all__ = ["SpeculativeEngine", "GenerationOutput", "GenerationStats", "Selection", "StepRecord"]


@dataclass
class DrafterStats:
    steps: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass
class StepRecord:
    """One decode step as the lagged poll saw it (what per-step latency and arm plots need)."""

    arm: str | None  # "drafter@γ"; None for a target-only step
    accepted: int  # drafts accepted, summed over rows
    rows: int  # rows still generating
    committed: int  # tokens committed, summed over rows
    seconds: float  # host clock on the CPU, CUDA events on a GPU


@dataclass
class GenerationStats:
    """What one ``generate`` call did. Times are wall-clock seconds on the host."""

    new_tokens: int = 0
    steps: int = 0
    row_steps: int = 0  # sum over steps of the rows still generating
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    forward_seconds: float = 0.0  # time inside model forwards (target and drafters), decode steps
    decode_seconds: float = 0.0  # time of the decode steps, prefill excluded
    decode_tokens: int = 0  # tokens committed by decode steps (the prefill's first token excluded)
    per_drafter: dict[str, DrafterStats] = field(default_factory=dict)
    per_arm: dict[str, DrafterStats] = field(default_factory=dict)  # "drafter@γ"
    selector_seconds: float = 0.0  # host time in select() and update()
    step_log: list[StepRecord] = field(default_factory=list)  # one per decode step, in order

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens a row gains per decode step (accepted drafts + the target's token)."""
        return self.decode_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def overhead_fraction(self) -> float:
        """Share of decode-step time spent outside model forwards (engine overhead). Measured
        with host clocks: meaningful on the CPU; on CUDA forwards return at launch."""
        return 1.0 - self.forward_seconds / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_tokens_per_step": self.mean_tokens_per_step,
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "overhead_fraction": self.overhead_fraction,
            "per_drafter": {k: vars(v) for k, v in self.per_drafter.items()},
            "per_arm": {k: vars(v) for k, v in self.per_arm.items()},
            "selector_seconds": self.selector_seconds,
        }


@dataclass
class Selection:
    """An engine's learning state, by reference: the shared selector, the state that a new
    context (or request) starts from, and the selectors of the contexts seen so far. Taken
    with :attr:`SpeculativeEngine.selection` and put back with ``use_selection`` — e.g. to keep
    several independent learners on one engine (``flashspec bench select``)."""

    selector: Any
    initial_state: dict[str, Any] | None
    contexts: dict[Hashable, Any]


@dataclass
class GenerationOutput:
    sequences: list[list[int]]  # new tokens per row, ending with EOS when it was produced
    stats: GenerationStats
    text: list[str] | None = None


class SpeculativeEngine:
    """Exact speculative decoding of ``target`` with one or more drafters (SPEC.md).

    Args:
        target: a loaded transformers causal LM, or a local folder, hub id or ``.gguf`` file.
        drafters: a drafter or a list of them; each is a loaded model, a path / hub id /
            ``.gguf`` file, ``"ngram"`` or a :class:`~flashspec.drafters.Drafter`. Empty means
            plain target-only decoding through the same loop.
        selector: how an arm — a (drafter, γ) pair — is chosen each step: ``"fixed"`` (the
            first arm), ``"ucb1"``, ``"thompson"``, ``"discounted-ucb"``,
            ``"sliding-window-ucb"``, ``"epsilon-greedy"``, or a selector object
            (:mod:`flashspec.select`). ``selector_options`` go to the named selector's class
            (e.g. ``{"reward": "acceptance", "seed": 0}``).
        gammas: draft lengths to choose among; the arms are every (drafter, γ) pair, drafter
            first. ``None``: one arm per drafter, with ``generate``'s ``num_draft_tokens``.
        share_selector: ``True`` (default) — the selector learns across requests (one state
            per ``generate(context=...)`` value); ``False`` — each request starts afresh.
        tokenizer: a tokenizer or a path; needed for string prompts. Loaded from ``target``
            when ``target`` is a path and this is None.
        device, dtype: where and in which precision to load models given as paths
            (default: CUDA if available else CPU; bfloat16 on CUDA, float32 on CPU).
        compile: run decode-step forwards of Llama-family models through ``torch.compile``
            (fuses small kernels; pays off on a GPU after a one-off compilation per shape), and
            on a GPU the step's bookkeeping after verification too (:func:`commit_step`).
    """

    def __init__(
        self,
        target: PreTrainedModel | str,
        drafters: Any = (),
        *,
        selector: str | Selector = "fixed",
        selector_options: dict[str, Any] | None = None,
        gammas: Sequence[int] | None = None,
        share_selector: bool = True,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        compile: bool = False,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if isinstance(target, (str, bytes)) or hasattr(target, "__fspath__"):
            if tokenizer is None:
                tokenizer = load_tokenizer(str(target))
            target = load_model(str(target), self.device, dtype)
        if not isinstance(target, PreTrainedModel):
            raise ValueError("target must be a transformers causal LM or a path / hub id / .gguf file.")
        self.target = target.eval()
        # Tensor parallelism (flashspec.parallel, SPEC.md §9): every rank runs this same loop;
        # the few places that must agree across ranks check self._tp.
        self._tp = tensor_parallel_of(self.target)
        self.vocab_size: int = target.config.vocab_size
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        if isinstance(drafters, (str, PreTrainedModel)) or isinstance(drafters, Drafter):
            drafters = [drafters]
        self.compile = bool(compile)
        self.drafters: list[Drafter] = [self._as_drafter(d, dtype) for d in drafters]
        names: set[str] = set()
        for i, d in enumerate(self.drafters):  # statistics are kept by name: make names unique
            if d.name in names:
                d.name = f"{d.name}#{i}"
            names.add(d.name)
        if gammas is not None:
            gammas = list(gammas)
            if not gammas or any(isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 1 for g in gammas):
                raise ValueError(f"gammas must be a non-empty list of integers >= 1; got {gammas!r}.")
            gammas = [int(g) for g in gammas]
        # Arms: (drafter index, γ or None for generate's num_draft_tokens).
        self.arms: list[tuple[int, int | None]] = [
            (d, g) for d in range(len(self.drafters)) for g in (gammas if gammas is not None else [None])
        ]
        self.share_selector = bool(share_selector)
        self.set_selector(selector, **(selector_options or {}))
        self._target_lm = make_lm(self.target, compile=self.compile)
        static_on_gpu = isinstance(self._target_lm, StaticLM) and self.target.device.type == "cuda"
        self._graphs = Graphs(enabled=static_on_gpu)
        # A step's bookkeeping after verification (commit, stop flags, log) is about 25 tiny
        # kernels; compiled, inductor fuses them into a few. Only where the step is replayed as a
        # CUDA graph: elsewhere the compiled function's guards would cost more host time per step.
        self._commit_step = commit_step
        if self.compile and static_on_gpu:
            self._commit_step = torch.compile(commit_step, dynamic=False)
        self._buffers: _Workspace | None = None
        # Queue the next step before a poll waits for its read-back, so that the device does not
        # idle while the host reads the log and launches the next graphs (SPEC.md §7). On a CPU
        # nothing runs ahead, and a step queued after the last row finished would be wasted work.
        self.queue_ahead = self.device.type == "cuda"

    # ------------------------------------------------------------------ selection
    def arm_label(self, arm: int, num_draft_tokens: int | None = None) -> str:
        """``"drafter@γ"`` for arm ``arm``."""
        d, g = self.arms[arm]
        return f"{self.drafters[d].name}@{g if g is not None else num_draft_tokens}"

    def set_selector(self, selector: str | Selector, **options: Any) -> None:
        """Choose arms with ``selector`` from now on (a name with its class's options, or an
        object); forgets what the previous selector learned."""
        if self._tp is not None and isinstance(selector, str) and options.get("seed") is None:
            options["seed"] = self._tp.shared_seed()  # every rank must choose the same arms
        if self.arms:
            self.selector: Selector | None = make_selector(selector, len(self.arms), **options)
        else:  # target-only: nothing to choose (the name and options are still checked)
            make_selector(selector, 1, **options)
            self.selector = None
        self._initial_selector_state = self._selector_state(self.selector)
        self._selectors: dict[Hashable, Selector] = {}

    @property
    def selection(self) -> Selection:
        """The current learning state (live references: later requests keep updating it)."""
        return Selection(self.selector, self._initial_selector_state, self._selectors)

    def use_selection(self, selection: Selection) -> None:
        """Make ``selection`` (from :attr:`selection`) the learning state of later requests."""
        if not isinstance(selection, Selection):
            raise ValueError(f"use_selection needs a Selection (engine.selection); got {type(selection).__name__}.")
        if (selection.selector is None) != (self.selector is None):
            raise ValueError("That selection belongs to an engine with a different set of arms.")
        self.selector, self._initial_selector_state, self._selectors = (
            selection.selector, selection.initial_state, selection.contexts)

    @staticmethod
    def _selector_state(selector: Any) -> dict[str, Any] | None:
        state_dict = getattr(selector, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def _selector_for(self, context: Hashable) -> Selector | None:
        """The selector of this request: shared per context, or a fresh one per request."""
        if self.selector is None:
            return None
        if not self.share_selector:
            if self._initial_selector_state is None:
                raise ValueError("share_selector=False needs a selector with state_dict() to copy from.")
            return selector_from_state_dict(self._initial_selector_state)
        if context is None:
            return self.selector
        if context not in self._selectors:
            if self._initial_selector_state is None:
                raise ValueError("A context needs a selector with state_dict() to copy from.")
            self._selectors[context] = selector_from_state_dict(self._initial_selector_state)
        return self._selectors[context]

    def selector_state(self) -> dict[str, Any]:
        """Everything the selectors learned, as JSON-serialisable values."""
        contexts = {json.dumps(k): self._selector_state(v) for k, v in self._selectors.items()}
        return {"default": self._selector_state(self.selector), "contexts": contexts}

    def load_selector_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`selector_state` (e.g. after a restart)."""
        if not isinstance(state, dict) or "default" not in state:
            raise ValueError("Not a selector state: expected the dict that selector_state() returns.")
        if self.selector is not None and state["default"] is not None:
            self.selector.load_state_dict(state["default"])
        self._selectors = {_hashable(json.loads(k)): selector_from_state_dict(v) for k, v in state.get("contexts", {}).items()}

    def save_selector(self, path: str) -> None:
        """Write :meth:`selector_state` as JSON."""
        with open(path, "w") as f:
            json.dump(self.selector_state(), f)

    def load_selector(self, path: str) -> None:
        """Read a file written by :meth:`save_selector`."""
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"Could not read a selector state from {path!r}: {error}") from None
        self.load_selector_state(state)

    def _workspace(self, batch: int, capacity: int, gamma: int, num_eos: int) -> _Workspace:
        """The decode buffers for this shape: reused when it matches the last request (so are
        the captured graphs), replaced together with every graph when it does not."""
        shape = (batch, capacity, gamma, num_eos)
        reallocated = self._target_lm.reset(batch, capacity)
        if reallocated or self._buffers is None or self._buffers.shape != shape:
            self._graphs.clear()
            self._buffers = _Workspace(batch, capacity, gamma, num_eos, self.target.device)
        return self._buffers

    def _as_drafter(self, spec: Any, dtype: torch.dtype) -> Drafter:
        if isinstance(spec, str) and spec == "ngram":
            return NgramDrafter()
        name = None
        if isinstance(spec, str):
            name = Path(spec).stem if spec.endswith(".gguf") else spec.rstrip("/").split("/")[-1]
            spec = load_model(spec, self.device, dtype)
        if isinstance(spec, PreTrainedModel):
            return ModelDrafter(spec, self.vocab_size, name=name, compile=self.compile)
        if isinstance(spec, DatastoreDrafter) and spec.max_token >= self.vocab_size:
            raise ValueError(f"Drafter {spec.name!r} stores token id {spec.max_token}, but the target's vocabulary "
                             f"has {self.vocab_size} tokens: build the store with the target's tokenizer.")
        if isinstance(spec, Drafter):
            return spec
        raise ValueError(f"Cannot use {spec!r} as a drafter: give a model, a path, 'ngram' or a Drafter.")

    # ------------------------------------------------------------------ inputs
    def _rows(self, input_ids: Any, attention_mask: Any) -> list[list[int]]:
        """The prompt of each row as a list of ids (padding removed)."""
        if isinstance(input_ids, str) or (
            isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(s, str) for s in input_ids)
        ):
            if self.tokenizer is None:
                raise ValueError("String prompts need a tokenizer: pass tokenizer= to SpeculativeEngine.")
            texts = [input_ids] if isinstance(input_ids, str) else list(input_ids)
            rows = [self.tokenizer(t)["input_ids"] for t in texts]
        elif isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be a [batch, length] tensor; got shape {tuple(input_ids.shape)}.")
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            attention_mask = torch.as_tensor(attention_mask)
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                    f"{tuple(input_ids.shape)}; they must match."
                )
            rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids.cpu(), attention_mask.cpu())]
        elif isinstance(input_ids, (list, tuple)):
            rows = [list(r) for r in input_ids]
        else:
            raise ValueError("input_ids must be a tensor, a list of token-id lists, or strings.")
        if not rows:
            raise ValueError("The batch is empty: give at least one prompt.")
        for i, row in enumerate(rows):
            if len(row) == 0:
                raise ValueError(f"Prompt {i} is empty; every row needs at least one token.")
            for t in row:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(
                        f"Prompt {i} contains token id {t!r}, outside the vocabulary [0, {self.vocab_size})."
                    )
        return rows

    def _eos_ids(self, eos_token_id: int | Sequence[int] | None) -> list[int]:
        if eos_token_id is None:
            eos_token_id = getattr(self.target.generation_config, "eos_token_id", None)
        if eos_token_id is None:
            return []
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        for t in ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"eos_token_id {t!r} is outside the vocabulary [0, {self.vocab_size}).")
        return ids

    # ------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(
        self,
        input_ids: Any,
        *,
        attention_mask: Any = None,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        num_draft_tokens: int = 4,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        progress: bool = False,
        sync_every: int | None = None,
        context: Hashable = None,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` per row; the output law is exactly the target's.

        ``sync_every``: check for finished rows (a device-to-host read) every this many steps;
        default 1 on the CPU, 8 on CUDA. Steps after every row finished do no harm but cost time.
        ``context``: a hashable label of the request (a domain, a route); with a learning
        selector, each label gets its own selector state.
        """
        params = SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0; got {max_new_tokens!r}.")
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, numbers.Integral) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1; got {num_draft_tokens!r}.")
        if sync_every is None:
            sync_every = 8 if self.device.type == "cuda" else 1
        if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1:
            raise ValueError(f"sync_every must be an integer >= 1; got {sync_every!r}.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer or None; got {seed!r}.")
        max_new_tokens, num_draft_tokens = int(max_new_tokens), int(num_draft_tokens)
        rows = self._rows(input_ids, attention_mask)
        eos = self._eos_ids(eos_token_id)
        longest = max(len(r) for r in rows)
        limit = context_window(self.target.config)
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(
                f"The prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context window of {limit} tokens."
            )
        try:
            hash(context)
        except TypeError:
            raise ValueError(f"context must be hashable (a string, a number, a tuple); got {context!r}.") from None
        gamma_max = max([g or num_draft_tokens for _, g in self.arms], default=num_draft_tokens)
        for model in [self.target] + [d.model for d in self.drafters if isinstance(d, ModelDrafter)]:
            check_no_sliding_window(model.config, longest + max_new_tokens * (gamma_max + 1))
        sync_every = int(sync_every)

        stats = GenerationStats(
            per_drafter={d.name: DrafterStats() for d in self.drafters},
            per_arm={self.arm_label(a, num_draft_tokens): DrafterStats() for a in range(len(self.arms))},
        )
        if max_new_tokens == 0:
            return self._output([[] for _ in rows], stats)
        selector = self._selector_for(context)
        run = _Run(self, rows, params, eos, max_new_tokens, num_draft_tokens, seed, stats, selector, context)
        start = time.perf_counter()
        run.prefill()
        if self.device.type == "cuda":  # the first poll waits here anyway; the time is then the prefill's
            torch.cuda.synchronize(self.device)
        stats.prefill_seconds = time.perf_counter() - start
        forward_before = run.forward_seconds()
        with tqdm(total=run.budget, disable=not progress, desc="generating", unit="tok") as bar:
            # Every step commits at least one token per active row, so max_new_tokens - 1 steps
            # finish every row; the loop reads the device only every sync_every steps.
            for step in range(max_new_tokens - 1):
                if step % sync_every == 0:
                    snapshot = run.snapshot()
                    if self.queue_ahead:
                        run.step()  # harmless if every row has finished: it commits nothing
                    running = run.poll(snapshot)
                    bar.update(run.generated_total - bar.n)
                    if not running:
                        break
                    if self.queue_ahead:
                        continue
                run.step()
            run.poll()
            bar.update(run.generated_total - bar.n)
        stats.seconds = time.perf_counter() - start
        stats.decode_seconds = stats.seconds - stats.prefill_seconds
        stats.forward_seconds = run.forward_seconds() - forward_before
        return self._output(run.sequences(), stats)

    def _output(self, sequences: list[list[int]], stats: GenerationStats) -> GenerationOutput:
        stats.new_tokens = sum(len(s) for s in sequences)
        text = None
        if self.tokenizer is not None:
            text = [self.tokenizer.decode(s, skip_special_tokens=True) for s in sequences]
        return GenerationOutput(sequences, stats, text)


class _Workspace:
    """The device buffers of a decode loop, kept across ``generate`` calls of the same shape.

    Captured CUDA graphs read and write these exact tensors, so they are filled in place for
    each request and replaced (with every graph) only when the batch, capacity or γ changes.
    """

    def __init__(self, batch: int, capacity: int, gamma: int, num_eos: int, device: torch.device) -> None:
        self.shape = (batch, capacity, gamma, num_eos)
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, capacity, **long)
        self.prompt_length = torch.zeros(batch, **long)
        self.length = torch.zeros(batch, **long)
        self.generated = torch.zeros(batch, **long)
        self.max_new_tokens = torch.zeros(batch, **long)
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)
        self.eos = torch.full((num_eos,), -1, **long)  # -1 pads: never equal to a token
        # Random numbers of a step: drafting [B, gamma], then verification [B, gamma + 1].
        self.random = torch.zeros(batch, 2 * gamma + 1, dtype=torch.float64, device=device)
        self.draft_tokens = torch.zeros(batch, gamma, **long)
        self.draft_probs: torch.Tensor | None = None  # [B, gamma, V], allocated on first use
        # Per-step log, read lagged: accepted drafts, rows still active, tokens committed.
        self.log = torch.zeros(capacity + 1, 3, **long)
        self.steps_taken = torch.zeros((), **long)


class _Run:
    """The state of one ``generate`` call: committed tokens, caches, counters.

    The tensors live in the engine's :class:`_Workspace` and are updated in place, so the
    score-verify-commit work of a step can be replayed as a CUDA graph. Nothing inside a step
    reads a tensor back to the host; :meth:`poll` does, every ``sync_every`` steps, to stop and
    to hand statistics to the selector (lagged by up to ``sync_every`` steps).
    """

    def __init__(
        self,
        engine: SpeculativeEngine,
        rows: list[list[int]],
        params: SamplingParams,
        eos: list[int],
        max_new_tokens: int,
        gamma: int,
        seed: int | None,
        stats: GenerationStats,
        selector: Selector | None = None,
        context: Hashable = None,
    ) -> None:
        device = engine.target.device
        self.engine, self.params, self.stats = engine, params, stats
        self.selector, self.context = selector, context
        # Each arm's draft length; the buffers are sized for the longest.
        self.arm_gammas = [g or gamma for _, g in engine.arms]
        self.labels = [engine.arm_label(a, gamma) for a in range(len(engine.arms))]
        gamma = max(self.arm_gammas, default=gamma)
        self.gamma = gamma
        self.batch = len(rows)
        self.budget = self.batch * max_new_tokens
        longest = max(len(r) for r in rows)
        # Room for the longest row plus one step of drafts past its budget (never committed),
        # rounded up so that requests of similar sizes share buffers and graphs.
        capacity = -(-(longest + max_new_tokens + gamma + 2) // 256) * 256
        ws = engine._workspace(self.batch, capacity, gamma, max(len(eos), 1))
        self.ws = ws
        ws.tokens.zero_()
        for b, r in enumerate(rows):
            ws.tokens[b, : len(r)] = torch.tensor(r, device=device)
        ws.prompt_length.copy_(torch.tensor([len(r) for r in rows]))
        ws.length.copy_(ws.prompt_length)
        ws.generated.zero_()
        ws.max_new_tokens.fill_(max_new_tokens)
        ws.active.fill_(True)
        ws.eos.fill_(-1)
        ws.eos[: len(eos)] = torch.tensor(eos, dtype=torch.long)
        ws.log.zero_()
        ws.steps_taken.zero_()
        self.tokens, self.length, self.active, self.generated = ws.tokens, ws.length, ws.active, ws.generated
        self.max_length = longest  # host-side upper bound on length.max()
        self.length_limit = longest + max_new_tokens
        self.rng = torch.Generator(device=device)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
            if engine._tp is not None:
                seed = engine._tp.shared_seed(seed)  # identical random numbers on every rank
        self.rng.manual_seed(seed)
        self.draft_uniforms = ws.random[:, :gamma]
        self.verify_uniforms = ws.random[:, gamma:]
        self.chosen: list[int | None] = []  # host: the arm chosen at each step
        self.proposed: list[int] = []  # host: drafts per active row at each step
        self.clock = _StepClock(device)
        self.polled = 0  # steps already handed to the stats and the selector
        self.generated_total = 0  # tokens generated so far, as of the last poll
        self.target = engine._target_lm
        self.graphs = engine._graphs
        for drafter in engine.drafters:
            drafter.begin(self.batch)

    def prefill(self) -> None:
        """Feed every prompt once and draw the first new token from the target alone."""
        zeros = torch.zeros_like(self.length)
        width = self.max_length
        real = (torch.arange(width, device=self.tokens.device) < self.length[:, None]).long()
        logits = self.target.forward(self.tokens[:, :width], zeros, real, logits_at=(self.length - 1)[:, None])
        no_drafts = self.ws.draft_tokens[:, :0]
        self.ws.random.uniform_(generator=self.rng)
        result = verify(logits, no_drafts, None, self.params, self.verify_uniforms[:, :1])
        self.commit(result.tokens, zeros)
        self.max_length += 1
        # Drafters with a cache fill it now, so that no step pays for a pass over the prompt.
        history = History(self.tokens, self.length, self.active, self.max_length)
        for drafter in self.engine.drafters:
            prefill = getattr(drafter, "prefill", None)
            if prefill is not None:
                prefill(history)

    def step(self) -> None:
        """One speculative step: select → propose → score → verify → commit; the update
        happens lagged, in :meth:`poll`."""
        self.clock.mark()
        arm, k = self._select()
        has_probs = self._propose(arm, k)
        self.graphs.run((k, has_probs, self.params), lambda: self._score_verify_commit(k, has_probs))
        self.chosen.append(arm)
        self.proposed.append(k)
        self.max_length = min(self.max_length + k + 1, self.length_limit)

    def _select(self) -> tuple[int | None, int]:
        """The arm of this step and its draft length (no arm, 0 drafts: target-only)."""
        if self.selector is None:
            return None, 0
        started = time.perf_counter()
        arm = self.selector.select(self.context)
        self.stats.selector_seconds += time.perf_counter() - started
        return arm, self.arm_gammas[arm]

    def _propose(self, arm: int | None, k: int) -> bool:
        """Draw this step's random numbers and let the arm's drafter fill the draft buffers;
        returns whether the drafts come with their laws ``q``."""
        ws = self.ws
        ws.random.uniform_(generator=self.rng)
        if arm is None:
            return False
        history = History(self.tokens, self.length, self.active, self.max_length)
        drafter = self.engine.drafters[self.engine.arms[arm][0]]
        draft = drafter.propose(history, k, self.params, self.draft_uniforms[:, :k])
        ws.draft_tokens[:, :k].copy_(draft.tokens)
        has_probs = draft.probs is not None
        if has_probs:
            if ws.draft_probs is None:
                shape = (self.batch, self.gamma, draft.probs.shape[-1])
                ws.draft_probs = torch.empty(shape, dtype=draft.probs.dtype, device=draft.probs.device)
            ws.draft_probs[:, :k].copy_(draft.probs)
        if self.engine._tp is not None:
            # Rank 0's drafts for every rank: replicas of a drafter may differ in the last bit
            # (e.g. kernels autotuned per process), and the ranks must verify the same drafts.
            self.engine._tp.broadcast_(ws.draft_tokens)
            if has_probs:
                self.engine._tp.broadcast_(ws.draft_probs)
        return has_probs

    def _score_verify_commit(self, k: int, has_probs: bool) -> None:
        """Score the drafts with the target, verify them, commit the result (tensor code only)."""
        ws = self.ws
        drafts = ws.draft_tokens[:, :k]
        pending = self.tokens.gather(1, (self.length - 1)[:, None])
        fed = torch.cat([pending, drafts], dim=1)
        logits = self.target.forward(fed, self.length - 1, self.active[:, None].expand_as(fed))
        probs = ws.draft_probs[:, :k] if has_probs else None
        result = verify(logits, drafts, probs, self.params, self.verify_uniforms[:, : k + 1])
        self.engine._commit_step(ws.tokens, ws.length, ws.active, ws.generated, ws.max_new_tokens, ws.eos,
                                 result.tokens, result.num_accepted, ws.log, ws.steps_taken)

    def snapshot(self) -> _Snapshot:
        """Start reading the per-step log, the stop flag and the token count back to the host:
        non-blocking copies on a GPU, finished by :meth:`poll`. Marks the end of the last step."""
        steps = len(self.chosen)
        self.clock.mark()
        marks = self.clock.take(steps - self.polled)
        ws = self.ws
        flags = torch.stack([self.active.any().long(), self.generated.sum()])
        packed = torch.cat([ws.log[self.polled : steps].flatten(), flags])
        if packed.is_cuda:
            packed = packed.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            ready = None
        return _Snapshot(steps, marks, packed, ready)

    def poll(self, snapshot: _Snapshot | None = None) -> bool:
        """Finish reading ``snapshot`` (taken now when not given; this waits for the device):
        update statistics and the selector; return whether any row is still generating."""
        snapshot = snapshot or self.snapshot()
        if snapshot.ready is not None:
            snapshot.ready.synchronize()  # the synchronisation
        values = snapshot.packed.tolist()
        *log, running, self.generated_total = values
        if snapshot.steps > self.polled:
            seconds = self.clock.seconds(snapshot.marks)
            if self.engine._tp is not None and self.selector is not None:
                seconds = self.engine._tp.shared_floats(seconds)  # rank 0's clock: same rewards everywhere
            entries = [log[i : i + 3] for i in range(0, len(log), 3)]
            for arm, k, (accepted, active_rows, committed), dt in zip(
                self.chosen[self.polled : snapshot.steps], self.proposed[self.polled : snapshot.steps], entries, seconds
            ):
                self._record(arm, k, accepted, active_rows, committed, dt)
            self.polled = snapshot.steps
        return bool(running)

    def _record(
        self, arm: int | None, k: int, accepted: int, active_rows: int, committed: int, seconds: float
    ) -> None:
        stats = self.stats
        label = None if arm is None else self.labels[arm]
        stats.step_log.append(StepRecord(label, accepted, active_rows, committed, seconds))
        stats.steps += 1
        stats.row_steps += active_rows
        stats.decode_tokens += committed
        if arm is None or active_rows == 0:
            return
        observation = Observation(accepted, k * active_rows, committed, max(seconds, 1e-9))
        started = time.perf_counter()
        self.selector.update(arm, observation)
        stats.selector_seconds += time.perf_counter() - started
        drafter = self.engine.drafters[self.engine.arms[arm][0]]
        for per in (stats.per_drafter[drafter.name], stats.per_arm[self.labels[arm]]):
            per.steps += 1
            per.proposed += k * active_rows
            per.accepted += accepted
        stats.proposed += k * active_rows
        stats.accepted += accepted

    def forward_seconds(self) -> float:
        """Host time inside model forwards so far (target and model drafters)."""
        total = self.target.forward_seconds
        for d in self.engine.drafters:
            lm = getattr(d, "_lm", None)
            total += lm.forward_seconds if lm is not None else 0.0
        return total

    def commit(self, new_tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
        """Append each active row's ``num_accepted + 1`` new tokens (:func:`commit_tokens`)."""
        ws = self.ws
        return commit_tokens(ws.tokens, ws.length, ws.active, ws.generated, ws.max_new_tokens, ws.eos,
                             new_tokens, num_accepted)

    def sequences(self) -> list[list[int]]:
        out = []
        for b in range(self.batch):
            start, end = int(self.ws.prompt_length[b]), int(self.length[b])
            out.append(self.tokens[b, start:end].tolist())
        return out


def commit_tokens(
    tokens: torch.Tensor, length: torch.Tensor, active: torch.Tensor, generated: torch.Tensor,
    max_new_tokens: torch.Tensor, eos: torch.Tensor, new_tokens: torch.Tensor, num_accepted: torch.Tensor,
) -> torch.Tensor:
    """Append each active row's ``num_accepted + 1`` tokens of ``new_tokens [B, k+1]`` to
    ``tokens [B, capacity]`` at ``length``, cut at the first EOS and at ``max_new_tokens``; update
    ``length``, ``generated`` and ``active`` in place; return how many tokens were committed (a
    device scalar). Tensor code only: no value goes back to the host."""
    columns = torch.arange(new_tokens.shape[1], device=new_tokens.device)
    take = torch.minimum(num_accepted + 1, max_new_tokens - generated)
    is_eos = torch.isin(new_tokens, eos) & (columns < take[:, None])
    first_eos = torch.where(is_eos, columns, new_tokens.shape[1]).amin(dim=1)
    take = torch.minimum(take, first_eos + 1)
    take = torch.where(active, take, 0)
    index = length[:, None] + columns
    write = columns < take[:, None]
    current = tokens.gather(1, index)
    tokens.scatter_(1, index, torch.where(write, new_tokens, current))
    length += take
    generated += take
    finished = (first_eos < take) | (generated >= max_new_tokens)
    active &= ~finished
    return take.sum()


def commit_step(
    tokens: torch.Tensor, length: torch.Tensor, active: torch.Tensor, generated: torch.Tensor,
    max_new_tokens: torch.Tensor, eos: torch.Tensor, new_tokens: torch.Tensor, num_accepted: torch.Tensor,
    log: torch.Tensor, steps_taken: torch.Tensor,
) -> None:
    """A step's bookkeeping after verification: :func:`commit_tokens` for the active rows, then
    the step's log entry (drafts accepted, rows active, tokens committed) at ``log[steps_taken]``
    (the last row once the log is full), and ``steps_taken += 1``."""
    accepted = torch.where(active, num_accepted, 0)
    active_rows = active.sum()
    committed = commit_tokens(tokens, length, active, generated, max_new_tokens, eos, new_tokens, accepted)
    entry = torch.stack([accepted.sum(), active_rows, committed])
    log.index_copy_(0, steps_taken.clamp(max=log.shape[0] - 1)[None], entry[None])
    steps_taken += 1


def _hashable(value: Any) -> Hashable:
    """A context label back from JSON: lists (tuples once) become tuples again."""
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


class _StepClock:
    """Step durations without synchronising: host clocks on the CPU, CUDA events (read only
    after the poll's synchronisation) on a GPU. ``mark()`` at each step start and at each poll."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def take(self, steps: int) -> list[Any]:
        """The marks bounding the last ``steps`` steps (one per step start, then the poll's);
        the clock keeps the poll's mark only (the next step marks again)."""
        marks = self.marks[-(steps + 1):] if steps else []
        self.marks = self.marks[-1:]
        return marks

    def seconds(self, marks: list[Any]) -> list[float]:
        """Seconds between consecutive ``marks`` (CUDA events must have completed)."""
        if self.cuda:
            return [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


@dataclass
class _Snapshot:
    """A read-back in flight: the log of steps up to ``steps`` plus the stop flag and the
    number of generated tokens (``packed``, valid once ``ready`` has completed)."""

    steps: int
    marks: list[Any]
    packed: torch.Tensor
    ready: Any  # torch.cuda.Event, or None on the CPU
