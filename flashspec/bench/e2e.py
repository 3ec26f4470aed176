"""``flashspec bench e2e``: FlashSpec side by side with what users would pick instead, in one run.

One process, one target, the same held-out prompts (``--style chat``: chat-formatted requests).
For every regime (prompt and output length) and batch size, each group of prompts is decoded
by every system in turn before the next group starts, so all systems see the same machine state;
the tables report medians and paired ratios.

Systems come from :data:`FAMILIES`, a list of small entries: Hugging Face ``generate()`` (plain,
static cache, assisted by each model drafter, prompt lookup) and FlashSpec (target-only, every
fixed (drafter, γ) arm, Thompson-sampling bandit over all arms with one state per domain).
A new drafter or verification mode is one more entry there.

Prompts: ``heldout_prompts`` (:mod:`flashspec.data.corpus`) cuts them from the last 5 % of each corpus
file's decompressed bytes (from the first line start after the 95 % mark), starting at a random
line among the first 90 % of the held-out lines (seeded per domain). Each prompt is then cut to
a length drawn uniformly from the regime's range; the short regime's prompts are the first
tokens of the long regime's. EOS never stops a row: every system produces exactly the regime's
new tokens (FlashSpec ``eos_token_id=[]``, transformers ``GenerationConfig(eos_token_id=[])``).
"""

from __future__ import annotations

import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..data.corpus import (
    DOMAINS,
    HELDOUT_FRACTION,
    chat_requests,
    heldout_prompts,
    store_drafters,
)
from ..drafters import History, ModelDrafter, NgramDrafter
from ..engine import SpeculativeEngine
from ..models.cached import make_lm
from ..sampling import SamplingParams
from ..select import SELECTORS
from ..select.fixed import ScriptedSelector
from ..select.guard import DEFAULT_SLACK, check_slack
from ..tuning.timing import best_seconds, cached_forward_seconds, measured
from .results import pyplot, save_figure, write_results

__all__ = [
    "FAMILIES",
    "REGIMES",
    "STYLES",
    "Regime",
    "check_options",
    "make_prompts",
    "predicted_speedup",
    "run",
    "summarize",
    "write",
]

STYLES = ("text", "chat")  # prompt styles: corpus continuations, chat-formatted requests
HF_LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens: the value transformers' docs use
BANDIT_SELECTOR = "thompson"


@dataclass(frozen=True)
class Regime:
    """Prompt lengths drawn uniformly from ``[min_prompt, max_prompt]`` tokens; ``new_tokens``
    generated per row."""

    min_prompt: int
    max_prompt: int
    new_tokens: int

    def describe(self) -> str:
        lo, hi = self.min_prompt, self.max_prompt
        prompt = f"{lo}" if lo == hi else f"{lo}–{hi}"
        return f"{prompt} prompt tokens, {self.new_tokens} new tokens"


REGIMES = {"long": Regime(256, 512, 256), "short": Regime(32, 32, 20)}


# ----------------------------------------------------------------------------- one measured call
@dataclass
class Call:
    """What one timed generate call returns; every system fills the same fields."""

    sequences: list[list[int]]  # new tokens per row
    seconds: float  # wall clock of the whole call (device synchronised on both ends)
    first_token_seconds: float  # from the call's start until the first new token exists
    step_seconds: list[float]  # each decode step after the first token
    step_tokens: list[float]  # tokens committed per row, per decode step
    step_accepted: list[float]  # drafts accepted per row, per decode step
    accepted: int | None = None  # drafts accepted, all rows (None: the system does not say)
    proposed: int | None = None
    arms: list[str | None] | None = None  # the arm of each step (FlashSpec)
    peak_memory_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated during the call
    peak_growth_bytes: int | None = None  # ... minus what was allocated when it started
    selector_seconds: float | None = None  # host time choosing arms and learning (FlashSpec bandit)


class _StreamClock:
    """A transformers streamer that only timestamps each ``put``: the prompt first, then every
    decode step's new tokens (``[B]`` plain, ``[1, n]`` assisted)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []  # new tokens per row in each put

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(value.shape[-1] if value.dim() == 2 else 1)

    def end(self) -> None:
        pass


def _weight_bytes(*models: Any) -> int:
    seen, total = set(), 0
    for model in models:
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


# ----------------------------------------------------------------------------- systems
def _is_model(drafter: Any) -> bool:
    """A loaded transformers model (drafted through ModelDrafter; transformers can use it as an assistant)."""
    return isinstance(drafter, torch.nn.Module)


SELF_DRAFTER_PREFIXES = ("early-exit:", "feature:", "shallow:")  # drafters the engine makes from the target


def _is_self_drafter(drafter: Any) -> bool:
    """``early-exit:N``, ``feature:DIR`` or ``shallow:DIR``: a spec the engine turns into a
    drafter sharing the target's weights and cache (passed to it as the string)."""
    return isinstance(drafter, str) and drafter.startswith(SELF_DRAFTER_PREFIXES)


def _plain_drafter(drafter: Any) -> Any:
    """``"ngram"`` → a fresh NgramDrafter; a self-drafter spec stays a string (the engine builds
    it on its own target); a (stateless) drafter object is shared as it is."""
    return NgramDrafter() if drafter == "ngram" else drafter


@dataclass
class Setup:
    """What the system builders draw on."""

    target: Any
    drafters: dict[str, Any]  # name -> model, "ngram", or a stateless Drafter object (e.g. a datastore)
    gammas: list[int]
    seed: int
    compile: bool
    # The guard's δ of each flashspec-auto system (None: the engine's default), one system each.
    auto_slacks: tuple[float | None, ...] = (None,)
    # The selector behind the guard of each flashspec-auto system (None: the default, auto's);
    # one system per (selector, δ).
    auto_selectors: tuple[str | None, ...] = (None,)

    @property
    def model_drafters(self) -> dict[str, Any]:
        return {n: d for n, d in self.drafters.items() if _is_model(d)}

    def engine(self, names: list[str], gammas: list[int] | None = None, **options: Any) -> SpeculativeEngine:
        """A FlashSpec engine over ``names`` (fresh drafter objects; models are shared)."""
        vocab = self.target.config.vocab_size
        drafters = [
            ModelDrafter(self.drafters[n], vocab, name=n, compile=self.compile) if _is_model(self.drafters[n])
            else _plain_drafter(self.drafters[n])
            for n in names
        ]
        options.setdefault("selector", "fixed")  # a system names its selector; fixed arms run every step
        engine = SpeculativeEngine(self.target, drafters, gammas=gammas, compile=self.compile, **options)
        for n, d in zip(names, engine.drafters):  # the engine names self-drafters "early-exit:N": use ours
            d.name = n
        return engine


@dataclass(eq=False)
class System:
    """One way to decode: ``generate`` gives a :class:`Call`; ``warm`` runs untimed before a
    regime × batch cell (allocation, compilation, CUDA graphs)."""

    name: str
    family: str
    models: list[Any]
    drafter: str | None = None  # the fixed drafter and γ, for the analytic prediction
    gamma: int | None = None
    batch1_only: bool = False
    settings: dict[str, Any] = field(default_factory=dict)

    def warm(self, prompts: list[list[int]], new_tokens: int, temperature: float, seed: int) -> None:
        self.generate(prompts, new_tokens, temperature, seed, context=None)

    def generate(self, prompts: list[list[int]], new_tokens: int, temperature: float, seed: int,
                 context: str | None) -> Call:
        raise NotImplementedError


@dataclass(eq=False)
class HFSystem(System):
    """``model.generate()`` of transformers with extra generation options (and an assistant)."""

    options: dict[str, Any] = field(default_factory=dict)
    assistant: Any = None

    def generate(self, prompts, new_tokens, temperature, seed, context):
        from transformers import GenerationConfig

        model = self.models[0]
        pad = model.generation_config.pad_token_id
        pad = pad if isinstance(pad, int) else 0
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        # Every option that changes the law explicit: transformers would otherwise fill unset ones
        # from the checkpoint's generation_config (top_p, repetition_penalty, ...).
        sampling = dict(temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
        config = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=pad,
                                  do_sample=temperature > 0, repetition_penalty=1.0, **sampling, **self.options)
        clock = _StreamClock()
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        if temperature > 0:
            torch.manual_seed(seed)
        with torch.inference_mode(), measured(model.device) as m:
            out = model.generate(ids, attention_mask=mask, generation_config=config, streamer=clock, **extra)
        sequences = out[:, width:].tolist()
        steps = clock.tokens[1:]  # the first put is the prompt
        times = clock.times[1:]
        return Call(
            sequences=sequences,
            seconds=m["seconds"],
            first_token_seconds=times[0] - m["start"] if times else m["seconds"],
            step_seconds=[b - a for a, b in zip(times, times[1:])],
            step_tokens=[float(n) for n in steps[1:]],
            step_accepted=[float(n - 1) for n in steps[1:]],
            peak_memory_bytes=m["peak"],
            peak_growth_bytes=m["growth"],
        )


@dataclass(eq=False)
class FlashSpecSystem(System):
    """A :class:`SpeculativeEngine`; ``per_context`` passes the domain as ``context=``. With a
    learning ``selector`` (name and options), warming plays every arm and then starts the
    selector afresh, so each regime × batch cell learns from scratch."""

    engine: Any = None
    per_context: bool = False
    selector: str | None = None
    selector_options: dict[str, Any] = field(default_factory=dict)

    # Steps of another arm between two proposals of a drafter with a cache, in a warm-up: the
    # catch-up widths a switch back meets (16, 32, 64, 128, SPEC §4). The script starts with
    # one step of the other arm, so that the guard measures the first proposal (the prompt's
    # feed) as a catch-up too.
    GAPS = (1, 20, 40, 90)

    def warm(self, prompts, new_tokens, temperature, seed):
        """Every arm alone, then each arm of a drafter with a cache after gaps of another arm's
        steps (the catch-up widths a switch back meets, SPEC §4), twice: compilations and graph
        captures happen here, not inside a timed call, and the guard (its slack lifted so that
        every choice runs) measures each arm's step and each catch-up's cost, for the timed
        calls to start from (``engine.arm_costs``, ``engine.catch_up_costs``, SPEC §8)."""
        if self.selector is None:
            return super().warm(prompts, new_tokens, temperature, seed)
        engine = self.engine
        slack, engine.slack = engine.slack, (None if engine.slack is None else 1e9)
        try:
            for arm in range(len(engine.arms)):
                engine.selection = engine.new_selection("fixed", arm=arm)
                super().warm(prompts, new_tokens, temperature, seed)
            for arm, (d, _) in enumerate(engine.arms):
                gap = engine.target_only_arm
                if gap is None:
                    gap = next((b for b, (e, _) in enumerate(engine.arms) if e != d), None)
                if d is None or gap is None or not hasattr(engine.drafters[d], "catch_up"):
                    continue
                script = [gap, arm] + [a for steps in self.GAPS for a in [gap] * steps + [arm]]
                for _ in range(2):  # the second time: the graphs are captured, what is measured is what recurs
                    engine.selection = engine.new_selection(ScriptedSelector(len(engine.arms), script))
                    super().warm(prompts, new_tokens, temperature, seed)
        finally:
            engine.slack = slack
        engine.selection = engine.new_selection(self.selector, **self.selector_options)

    def generate(self, prompts, new_tokens, temperature, seed, context):
        engine = self.engine
        with measured(engine.target.device) as m:
            out = engine.generate(
                prompts, max_new_tokens=new_tokens, eos_token_id=[], do_sample=temperature > 0,
                temperature=temperature or 1.0, seed=seed, context=context if self.per_context else None,
            )
        s = out.stats
        log = s.step_log
        return Call(
            sequences=out.sequences,
            seconds=m["seconds"],
            # the engine's clock starts at the prefill; what came before it counts too
            first_token_seconds=m["seconds"] - s.seconds + s.prefill_seconds,
            step_seconds=[r.seconds for r in log if r.rows],
            step_tokens=[r.committed / r.rows for r in log if r.rows],
            step_accepted=[r.accepted / r.rows for r in log if r.rows],
            accepted=s.accepted if engine.arms else None,
            proposed=s.proposed if engine.arms else None,
            arms=[r.arm for r in log if r.rows] if len(engine.arms) > 1 else None,
            selector_seconds=s.selector_seconds if len(engine.arms) > 1 else None,
            peak_memory_bytes=m["peak"],
            peak_growth_bytes=m["growth"],
        )


def _assisted_settings(assistant: Any) -> dict[str, Any]:
    """The assisted-generation settings transformers will use (the checkpoint's or its defaults)."""
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig, "_get_default_generation_params", lambda: {})()
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {k: v if (v := getattr(assistant.generation_config, k, None)) is not None else defaults.get(k) for k in keys}


def _hf(s: Setup) -> list[System]:
    return [HFSystem("hf", "hf", [s.target])]


def _hf_static(s: Setup) -> list[System]:
    return [HFSystem("hf-static", "hf-static", [s.target], options={"cache_implementation": "static"})]


def _hf_assisted(s: Setup) -> list[System]:
    return [HFSystem(f"hf-assisted {n}", "hf-assisted", [s.target, m], drafter=n, batch1_only=True, assistant=m,
                     settings=_assisted_settings(m)) for n, m in s.model_drafters.items()]


def _hf_lookup(s: Setup) -> list[System]:
    options = {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS}
    return [HFSystem("hf-lookup", "hf-lookup", [s.target], batch1_only=True, options=options, settings=options)]


def _flashspec(s: Setup) -> list[System]:
    return [FlashSpecSystem("flashspec", "flashspec", [s.target], engine=s.engine([]))]


def _flashspec_fixed(s: Setup) -> list[System]:
    return [
        FlashSpecSystem(f"flashspec {n}@{g}", "flashspec-fixed", [s.target] + ([d] if _is_model(d) else []),
                        drafter=n, gamma=g, engine=s.engine([n], gammas=[g]))
        for n, d in s.drafters.items() for g in s.gammas
    ]


def _flashspec_exact(s: Setup) -> list[System]:
    return [FlashSpecSystem("flashspec exact", "flashspec-exact", [s.target], engine=s.engine([], bit_exact=True))]


def _flashspec_fixed_exact(s: Setup) -> list[System]:
    return [
        FlashSpecSystem(f"flashspec exact {n}@{g}", "flashspec-fixed-exact",
                        [s.target] + ([d] if _is_model(d) else []), drafter=n, gamma=g,
                        engine=s.engine([n], gammas=[g], bit_exact=True))
        for n, d in s.drafters.items() for g in s.gammas
    ]


def _flashspec_bandit(s: Setup) -> list[System]:
    options = {"seed": s.seed}
    engine = s.engine(list(s.drafters), gammas=s.gammas, selector=BANDIT_SELECTOR, selector_options=options)
    arms = [engine.arm_label(a) for a in range(len(engine.arms))]
    return [FlashSpecSystem("flashspec bandit", "flashspec-bandit", [s.target, *s.model_drafters.values()],
                            engine=engine, per_context=True, selector=BANDIT_SELECTOR, selector_options=options,
                            settings={"selector": BANDIT_SELECTOR, "arms": arms, "context": "domain"})]


def _flashspec_auto(s: Setup) -> list[System]:
    """One system per (selector, δ) of ``s.auto_selectors`` × ``s.auto_slacks``: "flashspec auto"
    at the engine's defaults, "flashspec auto δ=X" at another δ, "flashspec auto [NAME]" with
    another selector behind the target-only arm and the guard (side by side, to choose by
    measurement: SPEC.md §8)."""
    systems = []
    for selector in s.auto_selectors:
        for slack in s.auto_slacks:
            options = {"seed": s.seed}
            engine = s.engine(list(s.drafters), gammas=s.gammas, selector=selector or "auto", selector_options=options,
                              slack="auto" if slack is None else slack, target_only=True)
            arms = [engine.arm_label(a) for a in range(len(engine.arms))]
            name = "flashspec auto" + (f" [{selector}]" if selector else "")
            name += "" if slack is None else f" δ={slack:g}"
            systems.append(FlashSpecSystem(name, "flashspec-auto", [s.target, *s.model_drafters.values()],
                                           engine=engine, per_context=True, selector=selector or "auto",
                                           selector_options=options,
                                           settings={"selector": selector or "auto", "arms": arms, "context": "domain",
                                                     "slack": engine.slack}))
    return systems


@dataclass(frozen=True)
class Family:
    """A kind of system: ``build`` turns the setup into its systems (one per drafter, arm, ...)."""

    name: str
    description: str
    build: Callable[[Setup], list[System]]
    needs_drafter: bool = False
    default: bool = True  # run when no systems are named (bit-exact mode needs a GPU: named only)



FAMILIES = [
    Family("hf", "transformers `generate()`, target only, dynamic cache", _hf),
    Family("hf-static", "transformers `generate()`, target only, `cache_implementation=\"static\"` "
           "(transformers compiles the decode forward on CUDA; eager on the CPU)", _hf_static),
    Family("hf-assisted", "transformers assisted generation, `assistant_model=` each model drafter, its default "
           "settings; batch 1 only", _hf_assisted, needs_drafter=True),
    Family("hf-lookup", f"transformers prompt lookup, `prompt_lookup_num_tokens={HF_LOOKUP_TOKENS}`; batch 1 only",
           _hf_lookup),
    Family("flashspec", "FlashSpec, target only (the same loop, no drafts)", _flashspec),
    Family("flashspec-fixed", "FlashSpec with one fixed (drafter, γ) arm, for every drafter × γ", _flashspec_fixed,
           needs_drafter=True),
    Family("flashspec-bandit", f"FlashSpec, {BANDIT_SELECTOR} sampling over all drafters × γ, one state per "
           "domain, fresh for each regime × batch cell", _flashspec_bandit, needs_drafter=True),
    Family("flashspec-auto", "FlashSpec's default configuration: selector 'auto' (Thompson over all drafters × γ "
           "and the target-only arm, behind the never-slower guard, SPEC §8), one state per domain, fresh for "
           "each regime × batch cell", _flashspec_auto, needs_drafter=True),
    Family("flashspec-exact", "FlashSpec, target only, bit-exact mode (SPEC §14); named only", _flashspec_exact,
           default=False),
    Family("flashspec-fixed-exact", "FlashSpec with one fixed (drafter, γ) arm, bit-exact mode (SPEC §14), for every "
           "drafter × γ; greedy outputs checked against `flashspec exact`; named only", _flashspec_fixed_exact,
           needs_drafter=True, default=False),
]
FAMILY_NAMES = [f.name for f in FAMILIES]
DEFAULT_FAMILIES = [f.name for f in FAMILIES if f.default]


# ----------------------------------------------------------------------------- options and prompts
def check_options(
    *, systems: list[str], batch_sizes: list[int], gammas: list[int], prompts_per_domain: int,
    temperature: float, regimes: dict[str, Regime], drafters: list[str] | None = None,
    hf_prompts_per_domain: int | None = None, auto_slacks: list[float | None] | None = None,
    auto_selectors: list[str | None] | None = None,
) -> None:
    """Raise a ValueError for anything that would fail later (before minutes of model loading)."""
    if auto_selectors is not None:
        if not auto_selectors:
            raise ValueError("auto selectors must be a non-empty list of selector names (None: the default).")
        if len(set(auto_selectors)) != len(auto_selectors):
            raise ValueError(f"auto selectors must differ from one another; got {auto_selectors!r}.")
        for name in auto_selectors:
            if name is not None and (name not in SELECTORS or SELECTORS[name].kind in ("fixed", "oracle")):
                learning = ", ".join(n for n in SELECTORS if n not in ("fixed", "oracle"))
                raise ValueError(f"An auto selector is a learning selector ({learning}) or 'default'; got {name!r}.")
    if auto_slacks is not None:
        if not auto_slacks:
            raise ValueError("auto slacks must be a non-empty list of δ values (numbers >= 0; None: the default).")
        values = [None if v is None else check_slack(v) for v in auto_slacks]
        if len(set(values)) != len(values):
            raise ValueError(f"auto slacks must differ from one another; got {auto_slacks!r}.")
        if None in values and DEFAULT_SLACK in values:
            raise ValueError(f"auto slacks name the default δ ({DEFAULT_SLACK}) twice: as None and as a number.")
    if not systems:
        raise ValueError("No systems chosen; pick from: " + ", ".join(FAMILY_NAMES) + ".")
    for name in systems:
        if name not in FAMILY_NAMES:
            raise ValueError(f"Unknown system {name!r}; choose from: {', '.join(FAMILY_NAMES)}.")
    if not batch_sizes:
        raise ValueError("batch sizes must be a non-empty list of integers >= 1.")
    for b in batch_sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"batch sizes must be integers >= 1; got {b!r}.")
    if not gammas or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in gammas):
        raise ValueError(f"gammas must be a non-empty list of integers >= 1; got {gammas!r}.")
    if isinstance(prompts_per_domain, bool) or not isinstance(prompts_per_domain, int) or prompts_per_domain < 1:
        raise ValueError(f"prompts per domain must be an integer >= 1; got {prompts_per_domain!r}.")
    if prompts_per_domain < max(batch_sizes):
        raise ValueError(f"prompts per domain ({prompts_per_domain}) must be at least the largest batch size "
                         f"({max(batch_sizes)}): batches are made of one domain's prompts.")
    if hf_prompts_per_domain is not None and (isinstance(hf_prompts_per_domain, bool)
                                              or not isinstance(hf_prompts_per_domain, int)
                                              or hf_prompts_per_domain < 1):
        raise ValueError(f"hf prompts per domain must be an integer >= 1 (or unset for all prompts); "
                         f"got {hf_prompts_per_domain!r}.")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy); got {temperature!r}.")
    if not regimes:
        raise ValueError("No regimes chosen; pick from: " + ", ".join(REGIMES) + ".")
    for name, r in regimes.items():
        if not (1 <= r.min_prompt <= r.max_prompt and r.new_tokens >= 1):
            raise ValueError(f"Regime {name!r} needs 1 <= min_prompt <= max_prompt and new_tokens >= 1; got {r}.")
    if drafters is not None:
        for name in systems:
            family = next(f for f in FAMILIES if f.name == name)
            if family.needs_drafter and not drafters:
                raise ValueError(f"System {name!r} needs at least one drafter (--draft).")
        if len(set(drafters)) != len(drafters):
            raise ValueError(f"Drafter names must be distinct; got {drafters!r}.")


def parse_regimes(text: str) -> dict[str, Regime]:
    """``"long,short"`` → the named :data:`REGIMES`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in REGIMES:
            raise ValueError(f"Unknown regime {n!r}; choose from: {', '.join(REGIMES)}.")
    return {n: REGIMES[n] for n in names}


def parse_ints(text: str, what: str) -> list[int]:
    """Comma-separated integers, as a clear ValueError when they are not."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers; got {text!r}.") from None


def parse_slacks(text: str) -> list[float | None]:
    """``--auto-slacks``: comma-separated δ values, ``default`` for the engine's (None), as a
    clear ValueError when a value is neither."""
    values: list[float | None] = []
    for v in (v.strip() for v in text.split(",")):
        if not v:
            continue
        if v == "default":
            values.append(None)
            continue
        try:
            values.append(float(v))
        except ValueError:
            raise ValueError(f"--auto-slacks must be comma-separated numbers (δ, e.g. 0.01) or 'default'; "
                             f"got {v!r}.") from None
    return values


def parse_selectors(text: str) -> list[str | None]:
    """``--auto-selectors``: comma-separated selector names, ``default`` for auto's own (None)."""
    return [None if v == "default" else v for v in (v.strip() for v in text.split(",")) if v]


def make_prompts(
    regimes: dict[str, Regime], count: int, *, tokenizer: Any = None, corpus: Path | None = None,
    vocab_size: int | None = None, seed: int = 0, style: str = "text", snippet_tokens: int = 192,
) -> dict[str, dict[str, list[list[int]]]]:
    """Prompts per regime and domain: held-out corpus text (``tokenizer`` and ``corpus``), or
    random token ids in one domain ``"random"`` (``vocab_size``; for random-weight models).

    ``style="chat"``: chat-formatted requests (:func:`~flashspec.data.corpus.chat_requests`),
    the same for every regime and kept whole: the regimes' prompt lengths are ignored (cutting
    a request would drop its chat template's generation prompt); only their new tokens apply.
    ``snippet_tokens``: the corpus snippet's length inside each chat request."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}; got {style!r}.")
    longest = max(r.max_prompt for r in regimes.values())
    if style == "chat":
        if tokenizer is None or corpus is None:
            raise ValueError("Chat prompts need a tokenizer with a chat template and the corpus folder (--corpus).")
        requests = {d: chat_requests(Path(corpus), d, count, tokenizer, seed, snippet_tokens=snippet_tokens)
                    for d in DOMAINS}
        return {name: {d: [list(p) for p in ps] for d, ps in requests.items()} for name in regimes}
    if tokenizer is not None:
        if corpus is None:
            raise ValueError("Corpus prompts need the corpus folder (--corpus).")
        full = {d: heldout_prompts(Path(corpus), d, count, longest, tokenizer, seed) for d in DOMAINS}
    else:
        if vocab_size is None:
            raise ValueError("Random prompts need the vocabulary size.")
        gen = torch.Generator().manual_seed(seed)
        full = {"random": [torch.randint(0, vocab_size, (longest,), generator=gen).tolist() for _ in range(count)]}
    prompts: dict[str, dict[str, list[list[int]]]] = {}
    for name, r in regimes.items():
        rng = random.Random(f"{name}-{seed}")
        prompts[name] = {d: [p[: rng.randint(r.min_prompt, r.max_prompt)] for p in ps] for d, ps in full.items()}
    return prompts


# ----------------------------------------------------------------------------- the analytic model
def predicted_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup of speculative decoding over target-only (Leviathan et al. 2023): each
    step yields (1 − α^(γ+1)) / (1 − α) tokens and costs γc + 1 target forwards, where α is the
    per-draft acceptance rate and c the drafter's cost per token relative to a target forward."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must lie in [0, 1]; got {alpha!r}.")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1; got {gamma!r}.")
    if not c >= 0:
        raise ValueError(f"c must be >= 0; got {c!r}.")
    tokens = gamma + 1 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


@torch.inference_mode()
def forward_costs(target: Any, drafters: dict[str, Any], gammas: list[int], context: int, capacity: int,
                  repeats: int = 5, batch: int = 1) -> dict[str, Any]:
    """Seconds (best of ``repeats``) of one cached target forward of ``batch`` rows over 1 and
    γ + 1 tokens after ``context`` tokens, and of each drafter per drafted token (a 1-token model
    forward; an n-gram proposal of γ tokens over a ``capacity``-wide token buffer, the engine's,
    divided by γ); ``c`` = drafter per token / target 1-token forward.

    On CUDA a StaticLM forward is timed as the engine runs it, a CUDA-graph replay (median of
    CUDA-event timings): timed eagerly, a batch-1 forward measures Python's kernel launches
    (17–34 ms for a 2 ms forward of the 1.5B on the H200), not the model."""
    device = target.device
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    widths = sorted({1} | {g + 1 for g in gammas})

    def lm_cost(model: Any, width: int) -> float:
        return cached_forward_seconds(make_lm(model), batch, width, context, repeats,
                                      capacity=context + max(widths) + 1, generator=gen)

    result: dict[str, Any] = {"context": context, "capacity": capacity, "repeats": repeats, "batch": batch,
                              "timing": "CUDA-graph replay" if device.type == "cuda" else "host clock"}
    result["target_seconds"] = {str(w): lm_cost(target, w) for w in widths}
    one = result["target_seconds"]["1"]
    result["drafters"] = {}
    for name, d in drafters.items():
        if _is_self_drafter(d):
            result.setdefault("not_timed", {})[name] = ("made from the target (its layers on its cache): "
                                                        "not timed here, no analytic prediction")
            continue
        if not _is_model(d):
            tokens = torch.randint(0, vocab, (batch, max(capacity, context + 1)), generator=gen).to(device)
            history = History(tokens, torch.full((batch,), context, device=device), None, context)
            params = SamplingParams()
            uniforms = torch.zeros(batch, max(gammas), dtype=torch.float64, device=device)
            drafter = _plain_drafter(d)
            per_token = min(
                best_seconds(lambda: drafter.propose(history, g, params, uniforms[:, :g]), device, repeats) / g
                for g in gammas
            )
        else:
            per_token = lm_cost(d, 1)
        result["drafters"][name] = {"seconds_per_token": per_token, "c": per_token / one}
    return result


# ----------------------------------------------------------------------------- the run
def _machine(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(device), "dtype": str(dtype)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _groups(prompts: dict[str, list[list[int]]], batch: int) -> list[tuple[str, list[int]]]:
    """Full batches of one domain's consecutive prompts, domains interleaved (code, prose, chat,
    code, ...): the order a mixed workload arrives in, and the bandit learns in."""
    per_domain = {d: [list(range(i, i + batch)) for i in range(0, len(ps) - batch + 1, batch)]
                  for d, ps in prompts.items()}
    rounds = max(len(g) for g in per_domain.values())
    return [(d, per_domain[d][i]) for i in range(rounds) for d in per_domain if i < len(per_domain[d])]


def run(
    target: Any,
    drafters: dict[str, Any],
    prompts: dict[str, dict[str, list[list[int]]]],
    regimes: dict[str, Regime],
    *,
    systems: list[str] | None = None,
    batch_sizes: tuple[int, ...] | list[int] = (1,),
    gammas: tuple[int, ...] | list[int] = (2, 4),
    temperature: float = 0.0,
    seed: int = 0,
    compile: bool = False,
    hf_prompts_per_domain: int | None = None,
    auto_slacks: list[float | None] | None = None,
    auto_selectors: list[str | None] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Decode ``prompts`` (from :func:`make_prompts`) with every chosen system family; return
    raw calls, per-cell summaries, greedy checks and forward costs (see :func:`write`).

    ``drafters`` maps a name to a loaded model sharing the target's vocabulary, or to
    ``"ngram"``. Prompt-lookup and assisted transformers systems only run at batch 1.
    ``hf_prompts_per_domain`` runs transformers' systems on the first that many batches of each
    domain only (on a GPU they are 10–40× slower than FlashSpec); paired ratios then use the
    batches both systems ran. ``auto_slacks``: the guard's δ of each flashspec-auto system, one
    system each (None: the engine's default; default: that one system); ``auto_selectors``: the
    selector behind the guard, one system per (selector, δ) (None: auto's own)."""
    systems = list(DEFAULT_FAMILIES if systems is None else systems)
    batch_sizes, gammas = list(batch_sizes), list(gammas)
    counts = {len(ps) for by_domain in prompts.values() for ps in by_domain.values()}
    check_options(systems=systems, batch_sizes=batch_sizes, gammas=gammas, prompts_per_domain=min(counts),
                  temperature=temperature, regimes=regimes, drafters=list(drafters),
                  hf_prompts_per_domain=hf_prompts_per_domain, auto_slacks=auto_slacks,
                  auto_selectors=auto_selectors)
    if set(prompts) != set(regimes):
        raise ValueError(f"prompts has regimes {sorted(prompts)} but regimes has {sorted(regimes)}.")
    device = target.device
    slacks = tuple(None if v is None else float(v) for v in (auto_slacks or [None]))
    setup = Setup(target, drafters, gammas, seed, compile, slacks, tuple(auto_selectors or [None]))
    built = {f.name: f.build(setup) for f in FAMILIES if f.name in systems}
    chosen = [s for family in built.values() for s in family]
    if not chosen:
        raise ValueError(f"The chosen systems ({', '.join(systems)}) have nothing to run with these drafters "
                         "(hf-assisted needs a model drafter).")
    names = [s.name for s in chosen]
    results: dict[str, Any] = {
        "machine": _machine(device, next(target.parameters()).dtype),
        "settings": {
            "regimes": {n: vars(r) for n, r in regimes.items()},
            "batch_sizes": batch_sizes, "gammas": gammas, "temperature": temperature, "seed": seed,
            "compile": compile, "prompts_per_domain": min(counts), "drafters": list(drafters),
            "hf_prompts_per_domain": hf_prompts_per_domain,
            "heldout": f"last {HELDOUT_FRACTION:.0%} of each corpus file's decompressed bytes",
            "eos": "disabled: every row generates exactly the regime's new tokens",
            "peak_memory": "CUDA only: torch.cuda.max_memory_allocated during the call (every loaded model and "
                           "every engine's buffers count); not measured on the CPU, see weight_bytes",
        },
        "systems": [{"name": s.name, "family": s.family, "drafter": s.drafter, "gamma": s.gamma,
                     "batch1_only": s.batch1_only, "weight_bytes": _weight_bytes(*s.models), **s.settings}
                    for s in chosen],
        "families": {f.name: f.description for f in FAMILIES if f.name in systems},
        "families_without_systems": [name for name, family in built.items() if not family],
        "cells": [],
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for regime_name, regime in regimes.items():
        by_domain = prompts[regime_name]
        lengths = [len(p) for ps in by_domain.values() for p in ps]
        context = int(statistics.mean(lengths) + regime.new_tokens / 2)
        capacity = -(-(max(lengths) + regime.new_tokens + max(gammas) + 2) // 256) * 256  # as the engine sizes it
        for batch in batch_sizes:
            costs = None
            if any(s.drafter for s in chosen):
                costs = forward_costs(target, drafters, gammas, context, capacity, batch=batch)
            cell = _run_cell(chosen, by_domain, regime, batch, temperature, seed, progress,
                             f"{regime_name} b{batch}", hf_prompts_per_domain)
            cell.update(regime=regime_name, batch_size=batch, forward_costs=costs)
            cell["summary"] = _summarize_cell(cell, chosen, names, costs)
            cell["never_slower"] = _never_slower(cell["calls"], chosen)
            if temperature == 0:
                cell["greedy"] = _greedy_check(cell["calls"])
            results["cells"].append(cell)
    if temperature > 0:
        _add_perplexities(target, prompts, results["cells"], progress)
        for cell in results["cells"]:
            for row in cell["summary"]:
                calls = [c for c in cell["calls"] if c["system"] == row["system"]
                         and (row["domain"] == "all" or c["domain"] == row["domain"])]
                values = [v for c in calls for v in c.get("perplexity", [])]
                row["perplexity_median"] = statistics.median(values) if values else None
    return results


def _run_cell(chosen: list[System], by_domain: dict[str, list[list[int]]], regime: Regime, batch: int,
              temperature: float, seed: int, progress: bool, label: str,
              hf_batches_per_domain: int | None = None) -> dict[str, Any]:
    groups = _groups(by_domain, batch)
    ordinal = [sum(d == domain for d, _ in groups[:i]) for i, (domain, _) in enumerate(groups)]

    def runs(system: System, index: int) -> bool:
        limited = hf_batches_per_domain is not None and system.family.startswith("hf")
        return not limited or ordinal[index] < hf_batches_per_domain

    active = [s for s in chosen if not (s.batch1_only and batch > 1)]
    skipped = [{"system": s.name, "reason": "transformers runs assisted generation and prompt lookup at batch 1 only"}
               for s in chosen if s not in active]
    # Untimed warm-up on the cell's longest batch with the full budget: allocation, caches sized
    # for every later batch, compilation and CUDA graphs happen here.
    warm_domain, warm_group = max(groups, key=lambda g: max(len(by_domain[g[0]][i]) for i in g[1]))
    warm = [by_domain[warm_domain][i] for i in warm_group]
    for system in tqdm(active, desc=f"{label} warm-up", unit="system", disable=not progress, leave=False):
        system.warm(warm, regime.new_tokens, temperature, seed)
    calls = []
    total = sum(runs(s, i) for i in range(len(groups)) for s in active)
    bar = tqdm(total=total, desc=label, unit="call", disable=not progress)
    for index, (domain, group) in enumerate(groups):
        batch_prompts = [by_domain[domain][i] for i in group]
        for system in active:
            if not runs(system, index):
                continue
            bar.set_postfix_str(f"{domain} {system.name}", refresh=False)
            call = system.generate(batch_prompts, regime.new_tokens, temperature, seed + index, context=domain)
            tokens = sum(len(s) for s in call.sequences)
            calls.append({
                "domain": domain, "group": index, "prompts": group, "prompt_tokens": [len(p) for p in batch_prompts],
                "system": system.name, "new_tokens": tokens, "seconds": call.seconds,
                "tokens_per_second": tokens / call.seconds, "first_token_seconds": call.first_token_seconds,
                "accepted": call.accepted, "proposed": call.proposed,
                "peak_memory_bytes": call.peak_memory_bytes, "peak_growth_bytes": call.peak_growth_bytes,
                "step_seconds": [round(t, 7) for t in call.step_seconds],
                "step_tokens": [round(t, 4) for t in call.step_tokens],
                "step_accepted": [round(t, 4) for t in call.step_accepted],
                **({"arms": call.arms} if call.arms is not None else {}),
                **({"selector_seconds": call.selector_seconds} if call.selector_seconds is not None else {}),
                "sequences": call.sequences,
            })
            bar.update()
    bar.close()
    return {"calls": calls, "not_applicable": skipped}


def _spread(values: list[float]) -> dict[str, float]:
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return {"median": float(median), "min": min(values), "max": max(values), "q1": float(q1), "q3": float(q3)}


def _paired_speedup(calls: list[dict[str, Any]], system: str, baseline: str) -> float | None:
    """Median over batches of (system tokens/s) / (baseline tokens/s) on the same batch."""
    rates = {(c["domain"], c["group"]): c["tokens_per_second"] for c in calls if c["system"] == baseline}
    ratios = [c["tokens_per_second"] / rates[(c["domain"], c["group"])] for c in calls
              if c["system"] == system and (c["domain"], c["group"]) in rates]
    return statistics.median(ratios) if ratios else None


def _summarize_cell(cell: dict[str, Any], chosen: list[System], names: list[str],
                    costs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per system per domain, and per system over all domains ("all")."""
    calls = cell["calls"]
    by_name = {s.name: s for s in chosen}
    domains = list(dict.fromkeys(c["domain"] for c in calls))
    rows = []
    for domain in domains + ["all"]:
        in_domain = [c for c in calls if domain == "all" or c["domain"] == domain]
        for name in names:
            own = [c for c in in_domain if c["system"] == name]
            if not own:
                continue
            system = by_name[name]
            steps = [t for c in own for t in c["step_seconds"]]
            accepted = [a for c in own for a in c["step_accepted"]]
            tokens = [t for c in own for t in c["step_tokens"]]
            proposed = sum(c["proposed"] or 0 for c in own)
            peaks = [c["peak_memory_bytes"] for c in own if c["peak_memory_bytes"] is not None]
            row: dict[str, Any] = {
                "domain": domain, "system": name, "calls": len(own),
                "tokens_per_second": _spread([c["tokens_per_second"] for c in own]),
                "tokens_per_step": statistics.mean(tokens) if tokens else None,
                "accepted_per_step": statistics.mean(accepted) if accepted else None,
                "acceptance_rate": sum(c["accepted"] for c in own) / proposed if proposed else None,
                "step_ms_p50": float(np.percentile(steps, 50)) * 1e3 if steps else None,
                "step_ms_p99": float(np.percentile(steps, 99)) * 1e3 if steps else None,
                "first_token_ms_median": statistics.median(c["first_token_seconds"] for c in own) * 1e3,
                "peak_memory_bytes": max(peaks) if peaks else None,
                "speedup_vs_hf": _paired_speedup(in_domain, name, "hf"),
                "speedup_vs_flashspec": _paired_speedup(in_domain, name, "flashspec"),
            }
            arms = [a for c in own for a in c.get("arms", [])]
            if arms:
                row["arm_steps"] = {a: arms.count(a) for a in dict.fromkeys(arms)}
            selection = [c["selector_seconds"] for c in own if "selector_seconds" in c]
            if selection and steps:
                row["selection_us_per_step"] = sum(selection) / len(steps) * 1e6
                row["selection_share_of_step"] = sum(selection) / sum(steps)
            if (system.gamma is not None and costs is not None and row["acceptance_rate"] is not None
                    and system.drafter in costs["drafters"]):
                c_ratio = costs["drafters"][system.drafter]["c"]
                predicted = predicted_speedup(row["acceptance_rate"], system.gamma, c_ratio)
                measured_speedup = row["speedup_vs_flashspec"]
                # The formula prices verifying γ + 1 tokens as one 1-token forward; v is what it
                # measured, and the second figure prices it so (a diagnostic for the gap).
                v = costs["target_seconds"][str(system.gamma + 1)] / costs["target_seconds"]["1"]
                row["predicted"] = {"alpha": row["acceptance_rate"], "gamma": system.gamma, "c": c_ratio,
                                    "speedup": predicted,
                                    "measured_over_predicted": (measured_speedup / predicted
                                                                if measured_speedup is not None else None),
                                    "verify_cost": v,
                                    "speedup_with_verify_cost": predicted * (system.gamma * c_ratio + 1)
                                    / (system.gamma * c_ratio + v)}
            rows.append(row)
    _add_step_cost_predictions(rows)
    return rows


def _never_slower(calls: list[dict[str, Any]], chosen: list[System], floor: float = 0.97,
                  margin: float = 0.05) -> dict[str, Any] | None:
    """The never-slower check of every learning FlashSpec system (bandit, auto): each call's tokens/s
    over FlashSpec target-only's on the same batch (the lowest, and how many fall below
    ``floor``), and per domain the median of those ratios over the best fixed arm's median
    (chosen in hindsight on this very workload), against ``1 - margin`` where that arm pays."""
    base = {(c["domain"], c["group"]): c["tokens_per_second"] for c in calls if c["system"] == "flashspec"}
    if not base:
        return None
    fixed = [s.name for s in chosen if s.family == "flashspec-fixed"]
    report: dict[str, Any] = {"floor": floor, "margin": margin, "systems": {}}
    for system in [s for s in chosen if s.family in ("flashspec-auto", "flashspec-bandit")]:
        own = [c for c in calls if c["system"] == system.name and (c["domain"], c["group"]) in base]
        if not own:
            continue
        ratios = [{"domain": c["domain"], "group": c["group"],
                   "ratio": c["tokens_per_second"] / base[(c["domain"], c["group"])]} for c in own]
        domains = {}
        for domain in dict.fromkeys(r["domain"] for r in ratios):
            mine = statistics.median(r["ratio"] for r in ratios if r["domain"] == domain)
            best_name, best = None, None
            for name in fixed:
                theirs = [c["tokens_per_second"] / base[(c["domain"], c["group"])] for c in calls
                          if c["system"] == name and c["domain"] == domain and (c["domain"], c["group"]) in base]
                if theirs and (best is None or statistics.median(theirs) > best):
                    best_name, best = name, statistics.median(theirs)
            domains[domain] = {"median_ratio": mine, "best_fixed": best_name, "best_fixed_ratio": best,
                               "of_best_fixed": mine / best if best else None,
                               "speculation_pays": best is not None and best > 1.0}
        lowest = min(ratios, key=lambda r: r["ratio"])
        report["systems"][system.name] = {
            "calls": len(ratios), "lowest": lowest, "below_floor": [r for r in ratios if r["ratio"] < floor],
            "domains": domains,
        }
    return report


def _add_step_cost_predictions(rows: list[dict[str, Any]]) -> None:
    """The prediction again, with c read off this run's own steps: a fixed arm's median step
    over FlashSpec target-only's is γc + v by the formula's cost model, which takes the verify
    forward v as 1, so c = (ratio − 1) / γ. Its measured/predicted then isolates the other
    assumption, independent acceptances (a cross-check of the forward-timed c)."""
    baseline = {r["domain"]: r["step_ms_p50"] for r in rows if r["system"] == "flashspec"}
    for row in rows:
        p, base = row.get("predicted"), baseline.get(row["domain"])
        if p is None or not base or row["step_ms_p50"] is None:
            continue
        c = max(0.0, (row["step_ms_p50"] / base - 1) / p["gamma"])
        predicted = predicted_speedup(p["alpha"], p["gamma"], c)
        measured_speedup = row["speedup_vs_flashspec"]
        p.update(c_from_steps=c, speedup_c_from_steps=predicted,
                 measured_over_predicted_c_from_steps=(measured_speedup / predicted
                                                       if measured_speedup is not None else None))


def _greedy_check(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Every system's greedy outputs against the reference system's (FlashSpec target-only,
    else transformers', else the first system that ran), prompt by prompt; bit-exact systems
    against FlashSpec target-only in bit-exact mode, when it ran (SPEC.md §14: equal by design)."""
    names = list(dict.fromkeys(c["system"] for c in calls))
    reference = next((n for n in ("flashspec", "hf") if n in names), names[0])
    exact = "flashspec exact" if "flashspec exact" in names else None
    outputs = {(c["system"], c["domain"], c["group"]): c["sequences"] for c in calls}
    report: dict[str, Any] = {"reference": reference, "exact_reference": exact, "systems": {}}
    for name in names:
        against = exact if exact and name.startswith("flashspec exact ") else reference
        if name == reference:
            continue
        compared, differing = 0, []
        for c in calls:
            key = (against, c["domain"], c["group"])
            if c["system"] != name or key not in outputs:
                continue
            for row, (ours, theirs) in enumerate(zip(c["sequences"], outputs[key])):
                compared += 1
                if ours != theirs:
                    common = min(len(ours), len(theirs))
                    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), common)
                    differing.append({"domain": c["domain"], "prompt": c["prompts"][row], "first_difference": first})
        if compared:
            report["systems"][name] = {"reference": against, "compared": compared,
                                       "identical": compared - len(differing), "differing": differing}
    return report


@torch.inference_mode()
def _add_perplexities(target: Any, prompts: dict[str, dict[str, list[list[int]]]], cells: list[dict[str, Any]],
                      progress: bool) -> None:
    """The target's perplexity (temperature 1) of each generated row given its prompt: a quality
    guard for sampling runs (every system samples the same law, so these should agree)."""
    device = target.device
    todo = [(cell, c) for cell in cells for c in cell["calls"]]
    for cell, c in tqdm(todo, desc="perplexity", unit="call", disable=not progress):
        values = []
        for index, output in zip(c["prompts"], c["sequences"]):
            prompt = prompts[cell["regime"]][c["domain"]][index]
            ids = torch.tensor([prompt + output], device=device)
            logits = target(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            nll = torch.nn.functional.cross_entropy(logits, ids[0, len(prompt):])
            values.append(math.exp(float(nll)))
        c["perplexity"] = values


# ----------------------------------------------------------------------------- reporting
def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "—"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def summarize(results: dict[str, Any]) -> str:
    """Markdown: per regime × batch size, tokens/s by domain with speedups, then latency,
    acceptance, memory, the analytic prediction and the greedy check per system."""
    lines = ["# FlashSpec end to end", ""]
    m, s = results["machine"], results["settings"]
    lines += [
        f"Machine: {m['processor']}, {m['threads']} threads, {m.get('gpu', m['device'])}; torch {m['torch']}, "
        f"transformers {m['transformers']}; {m['dtype']}. Created {results['created']}.",
        f"Temperature {s['temperature'] or 'greedy (0)'}; γ ∈ {s['gammas']}; {s['prompts_per_domain']} prompts per "
        f"domain from the {s['heldout']}; EOS {s['eos']}.",
    ]
    if s.get("target"):
        lines.append(f"Target: {s['target']}; drafters: {', '.join(s['drafters'])}.")
    if s.get("style") == "chat":
        lines.append("Prompts: chat-formatted requests (a corpus snippet inside a user instruction, through the "
                     "tokenizer's chat template), kept whole: the regimes' prompt lengths do not apply.")
    if s.get("note"):
        lines.append(f"_{s['note']}_")
    if s.get("hf_prompts_per_domain"):
        lines.append(f"transformers' systems (`hf*`) ran on the first {s['hf_prompts_per_domain']} batches of each "
                     "domain only; their medians cover those, and every paired ratio uses the batches both "
                     "systems ran.")
    lines += ["", "Systems:", ""]
    lines += [f"* `{name}`: {text}" + (" — **none here** (no model drafter)"
                                        if name in results["families_without_systems"] else "")
              for name, text in results["families"].items()]
    lines.append("")
    for cell in results["cells"]:
        lines += _cell_lines(results, cell)
    lines.append("Peak memory: " + s["peak_memory"] + ". Raw per-call data (outputs, step times, arms): `e2e.json`.")
    return "\n".join(lines)


def _cell_lines(results: dict[str, Any], cell: dict[str, Any]) -> list[str]:
    """Markdown of one regime × batch-size cell of :func:`summarize`."""
    s = results["settings"]
    lines: list[str] = []
    regime = Regime(**s["regimes"][cell["regime"]])
    rows = cell["summary"]
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    get = {(r["system"], r["domain"]): r for r in rows}
    lines += [f"## {cell['regime']} ({regime.describe()}), batch {cell['batch_size']}", ""]
    lines += ["Tokens/s per call (new tokens of the batch over the call's wall time, prefill included): "
              "median [min–max]. Speedups: median over batches of the paired ratio.", ""]
    lines.append("| system | " + " | ".join(domains) + " | × hf | × flashspec |")
    lines.append("|---|" + "---|" * (len(domains) + 2))
    for name in systems:
        cells = []
        for d in domains:
            r = get.get((name, d))
            t = r["tokens_per_second"] if r else None
            cells.append(f"{t['median']:.2f} [{t['min']:.2f}–{t['max']:.2f}]" if t else "—")
        overall = get[(name, "all")]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_fmt(overall['speedup_vs_hf'], '.2f', '×')} | "
                     f"{_fmt(overall['speedup_vs_flashspec'], '.2f', '×')} |")
    for skip in cell["not_applicable"]:
        lines.append(f"| {skip['system']} | " + " | ".join("n/a" for _ in domains) + " | n/a | n/a |")
    lines.append("")
    perplexity = any(r.get("perplexity_median") is not None for r in rows)
    lines.append("All domains pooled: acceptance α (accepted / proposed drafts), drafts accepted and tokens "
                 "per step (per row), decode-step latency (a step: one target forward with its drafts; "
                 "transformers' steps timed by a streamer), time to first token (median), the system's model "
                 "weights, peak memory"
                 + (", the target's perplexity of the samples (median)" if perplexity else "") + ".")
    lines.append("")
    header = ("| system | α | accepted/step | tokens/step | step p50 ms | step p99 ms | TTFT ms | weights | "
              "peak memory |")
    lines += [header + (" perplexity |" if perplexity else ""),
              "|---|---|---|---|---|---|---|---|---|" + ("---|" if perplexity else "")]
    weights = {w["name"]: w["weight_bytes"] for w in results["systems"]}
    for name in systems:
        r = get[(name, "all")]
        line = (f"| {name} | {_fmt(r['acceptance_rate'])} | {_fmt(r['accepted_per_step'])} | "
                f"{_fmt(r['tokens_per_step'])} | {_fmt(r['step_ms_p50'], '.1f')} | "
                f"{_fmt(r['step_ms_p99'], '.1f')} | {_fmt(r['first_token_ms_median'], '.0f')} | "
                f"{_bytes(weights[name])} | {_bytes(r['peak_memory_bytes'])} |")
        lines.append(line + (f" {_fmt(r.get('perplexity_median'))} |" if perplexity else ""))
    lines.append("")
    predicted = [r for r in rows if "predicted" in r]
    if predicted:
        costs = cell["forward_costs"]
        target_ms = ", ".join(f"{w} token{'s' if w != '1' else ''} {t * 1e3:.1f} ms"
                              for w, t in costs["target_seconds"].items())
        drafter_c = ", ".join(f"{n} c = {d['c']:.3g}" for n, d in costs["drafters"].items())
        if "timing" not in costs and results["machine"].get("gpu"):
            drafter_c += (" (timed eagerly, by a version before CUDA-graph timing: on a GPU these are Python "
                          "launch times, not the models'; read the step-based table below)")
        lines += ["Analytic prediction (1 − α^(γ+1)) / ((1 − α)(γc + 1)) against the measured speedup "
                  f"over FlashSpec target-only. Forward costs at {costs['context']} tokens of context: target "
                  f"{target_ms}; {drafter_c}.", ""]
        lines += _prediction_table(get, systems, domains, "speedup", "measured_over_predicted", None)
        if any("c_from_steps" in r["predicted"] for r in predicted):
            lines += ["The same with c read off this run's steps (a fixed arm's median step over target-only's "
                      "= γc + 1 in the formula's cost model): measured / predicted then tests only the "
                      "formula's independent-acceptance assumption.", ""]
            lines += _prediction_table(get, systems, domains, "speedup_c_from_steps",
                                       "measured_over_predicted_c_from_steps", "c_from_steps")
    arms = [r for r in rows if "arm_steps" in r and r["domain"] != "all"]
    for r in arms:
        total = sum(r["arm_steps"].values())
        shares = ", ".join(f"{a} {n / total:.0%}" for a, n in sorted(r["arm_steps"].items(), key=lambda x: -x[1]))
        lines.append(f"* {r['system']}, {r['domain']}: steps by arm: {shares}.")
    for r in rows:
        if r["domain"] == "all" and "selection_us_per_step" in r:
            lines.append(f"* {r['system']}: choosing arms and learning took {r['selection_us_per_step']:.0f} µs "
                         f"of host time per step ({r['selection_share_of_step']:.2%} of the step time).")
    if arms:
        lines.append("")
    never = cell.get("never_slower")
    if never and never["systems"]:
        lines += [f"Never slower: each call's tokens/s over FlashSpec target-only's on the same batch; "
                  f"goal: no call below {never['floor']:.2f}×, and where the best fixed arm (chosen in hindsight) "
                  f"pays, within {never['margin']:.0%} of it.", "",
                  "| system | calls | lowest call | calls below | " + " | ".join(
                      f"{d}: median / best fixed" for d in domains if d != "all") + " |",
                  "|---|---|---|---|" + "---|" * len([d for d in domains if d != "all"])]
        for name, n in never["systems"].items():
            low = n["lowest"]
            parts = []
            for d in domains:
                if d == "all":
                    continue
                x = n["domains"].get(d)
                if x is None:
                    parts.append("—")
                    continue
                best = (f"{x['best_fixed']} {x['best_fixed_ratio']:.2f}×" if x["best_fixed"] else "no fixed arm")
                of = f" = {x['of_best_fixed']:.2f}" if x["of_best_fixed"] is not None else ""
                parts.append(f"{x['median_ratio']:.2f}× / {best}{of}" + ("" if x["speculation_pays"] else " (none pays)"))
            lines.append(f"| {name} | {n['calls']} | {low['ratio']:.2f}× ({low['domain']} #{low['group']}) | "
                         f"{len(n['below_floor'])} | " + " | ".join(parts) + " |")
        lines.append("")
    greedy = cell.get("greedy")
    if greedy:
        parts = []
        for name, g in greedy["systems"].items():
            against = g.get("reference", greedy["reference"])
            text = f"{name} {g['identical']}/{g['compared']}" + (f" (against `{against}`)"
                                                                 if against != greedy["reference"] else "")
            if g["differing"]:
                text += " (differ: " + ", ".join(f"{d['domain']} #{d['prompt']} from token {d['first_difference']}"
                                                 for d in g["differing"][:5])
                text += ", …)" if len(g["differing"]) > 5 else ")"
            parts.append(text)
        lines.append(f"Greedy outputs identical to `{greedy['reference']}`: " + "; ".join(parts) + ".")
        lines.append("")
    return lines


def _prediction_table(get: dict[tuple[str, str], dict[str, Any]], systems: list[str], domains: list[str],
                      speedup: str, ratio: str, c_key: str | None) -> list[str]:
    """Markdown rows ``α: measured / predicted = ratio`` per system and domain."""
    lines = ["| system | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
    for name in systems:
        parts = []
        for d in domains:
            r = get.get((name, d))
            p = r.get("predicted") if r else None
            if p is None or speedup not in p:
                parts.append("—")
                continue
            c = f", c {p[c_key]:.2f}" if c_key else ""
            parts.append(f"α {p['alpha']:.2f}{c}: {_fmt(r['speedup_vs_flashspec'], '.2f', '×')} / "
                         f"{p[speedup]:.2f}× = {_fmt(p[ratio])}")
        if any(part != "—" for part in parts):
            lines.append(f"| {name} | " + " | ".join(parts) + " |")
    return lines + [""]


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNGs: tokens/s per system and domain; accepted drafts per step; the bandit's arms over
    time. Returns the files written."""
    plt = pyplot()
    cells = results["cells"]
    written = []
    every = [system["name"] for system in results["systems"]]  # one colour per system in every panel
    colour = {name: plt.get_cmap("tab10" if len(every) <= 10 else "tab20")(i % 20) for i, name in enumerate(every)}
    label = lambda cell: f"{cell['regime']}, batch {cell['batch_size']}"  # noqa: E731

    fig, axes = plt.subplots(len(cells), 1, figsize=(14, 4.5 * len(cells)), squeeze=False)
    for ax, cell in zip(axes[:, 0], cells):
        rows = cell["summary"]
        domains = list(dict.fromkeys(r["domain"] for r in rows))
        systems = list(dict.fromkeys(r["system"] for r in rows))
        width = 0.8 / len(systems)
        for i, name in enumerate(systems):
            got = {r["domain"]: r["tokens_per_second"] for r in rows if r["system"] == name}
            xs = [j + i * width for j, d in enumerate(domains) if d in got]
            med = [got[d]["median"] for d in domains if d in got]
            err = [[got[d]["median"] - got[d]["min"] for d in domains if d in got],
                   [got[d]["max"] - got[d]["median"] for d in domains if d in got]]
            ax.bar(xs, med, width, yerr=err, capsize=2, label=name, color=colour[name])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(domains))], domains)
        ax.set_ylabel("tokens/s (median, min–max)")
        ax.set_title(label(cell))
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    written.append(save_figure(fig, out_dir / "tokens_per_second.png", dpi=110, bbox_inches="tight"))

    speculative = list(dict.fromkeys(c["system"] for cell in cells for c in cell["calls"]
                                     if any(a > 0 for a in c["step_accepted"]) or c["proposed"]))
    if speculative:
        fig, axes = plt.subplots(len(cells), len(speculative), figsize=(3.2 * len(speculative), 2.8 * len(cells)),
                                 squeeze=False)
        for row, cell in zip(axes, cells):
            for ax, name in zip(row, speculative):
                values = [a for c in cell["calls"] if c["system"] == name for a in c["step_accepted"]]
                ax.set_title(f"{name}\n{label(cell)}", fontsize=8)
                if not values:
                    ax.text(0.5, 0.5, "n/a", ha="center", va="center", transform=ax.transAxes)
                    ax.set_axis_off()
                    continue
                top = int(math.ceil(max(values)))
                ax.hist(values, bins=np.arange(-0.5, top + 1.5, 1 if cell["batch_size"] == 1 else 0.25),
                        weights=np.full(len(values), 1 / len(values)))
                ax.set_xlabel("drafts accepted per step (per row)", fontsize=7)
                ax.set_ylabel("share of steps", fontsize=7)
        fig.tight_layout()
        written.append(save_figure(fig, out_dir / "accepted_lengths.png", dpi=110, bbox_inches="tight"))

    bandit = [(cell, c) for cell in cells for c in cell["calls"] if "arms" in c]
    if bandit:
        domains = list(dict.fromkeys(c["domain"] for _, c in bandit))
        fig, axes = plt.subplots(len(cells), len(domains), figsize=(5 * len(domains), 3.2 * len(cells)), squeeze=False)
        for row, cell in zip(axes, cells):
            for ax, domain in zip(row, domains):
                arms = [a for c in cell["calls"] if "arms" in c and c["domain"] == domain for a in c["arms"]]
                labels = sorted({a for a in arms if a is not None})
                if not arms:
                    continue
                window = max(1, len(arms) // 40)
                starts = list(range(0, len(arms), window))
                shares = [[sum(a == lab for a in arms[s : s + window]) / len(arms[s : s + window]) for s in starts]
                          for lab in labels]
                ax.stackplot(starts, shares, labels=labels, step="post")
                ax.set_ylim(0, 1)
                ax.set_title(f"{domain}, {label(cell)}", fontsize=9)
                ax.set_xlabel(f"decode step (in order; windows of {window})", fontsize=8)
                ax.set_ylabel("share of steps", fontsize=8)
                ax.legend(fontsize=6, loc="lower right")
        fig.tight_layout()
        written.append(save_figure(fig, out_dir / "bandit_arms.png", dpi=110, bbox_inches="tight"))
    return written


def write(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``e2e.json`` (everything, per call), ``e2e.md`` (the tables) and the PNGs in ``out_dir``."""
    out_dir = Path(out_dir)
    return [*write_results(out_dir / "e2e.json", results, summarize(results)), *plot(results, out_dir)]


def rewrite_report(out_dir: Path) -> list[Path]:
    """Recompute the summaries of a previous run's ``out_dir/e2e.json`` from its raw calls with
    this version's code and rewrite ``e2e.json``, ``e2e.md`` and the PNGs; nothing is decoded.
    (Reports gain the newer analyses; the measurements themselves stay as they were.)"""
    path = Path(out_dir) / "e2e.json"
    if not path.is_file():
        raise ValueError(f"No e2e.json in {out_dir}; give the folder of a previous `flashspec bench e2e` run.")
    try:
        results = json.loads(path.read_text())
        chosen = [System(name=s["name"], family=s["family"], models=[], drafter=s.get("drafter"),
                         gamma=s.get("gamma")) for s in results["systems"]]
        names = [s.name for s in chosen]
        for cell in results["cells"]:
            cell["summary"] = _summarize_cell(cell, chosen, names, cell.get("forward_costs"))
            if results["settings"]["temperature"] == 0:
                cell["greedy"] = _greedy_check(cell["calls"])
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is not an e2e.json written by `flashspec bench e2e` "
                         f"({type(error).__name__}: {error}).") from None
    results["rewritten"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return write(results, Path(out_dir))


# ----------------------------------------------------------------------------- from the command line
def drafter_name(spec: str) -> str:
    """A short name for a drafter spec: ``"ngram"``, ``store-DOMAIN`` for ``store:DOMAIN``,
    ``early-exit-N`` for ``early-exit:N``, ``feature-NAME`` / ``shallow-NAME`` for
    ``feature:DIR`` / ``shallow:DIR`` (NAME: the folder's name), a ``.gguf`` file's stem, a folder's name."""
    if spec == "ngram":
        return spec
    if spec.startswith("store:"):
        return "store-" + spec.split(":", 1)[1]
    if spec.startswith("early-exit:"):
        return "early-exit-" + spec.split(":", 1)[1]
    if spec.startswith(("feature:", "shallow:")):
        kind, folder = spec.split(":", 1)
        return f"{kind}-{Path(folder).name or 'drafter'}"
    return Path(spec).stem if spec.lower().endswith(".gguf") else spec.rstrip("/").split("/")[-1]


def load_and_run(
    out_dir: Path,
    *,
    target: str | None,
    drafts: list[str],
    tokenizer: str | None,
    corpus: Path,
    shaped: bool,
    device: str | None,
    dtype: str,
    regimes: dict[str, Regime],
    prompts_per_domain: int,
    seed: int = 0,
    style: str = "text",
    snippet_tokens: int = 192,
    **options: Any,
) -> dict[str, Any]:
    """Load the models (or build random-weight Llama-3-8B / 3.2-1B shapes with ``shaped``), make
    the prompts (``style``: see :func:`make_prompts`), :func:`run` and :func:`write`. Model paths
    are loaded; ``ngram`` and the self-drafter specs (``early-exit:N``, ``feature:DIR``,
    ``shallow:DIR``) go to the engines as strings. ``options`` go to :func:`run`."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}; got {style!r}.")
    if shaped and style != "text":
        raise ValueError("--shaped decodes random token ids; --style chat needs corpus prompts and a tokenizer.")
    from ..models.loading import load_model, load_tokenizer

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = getattr(torch, dtype)
    if shaped:
        from .gpu import shaped_model

        model = shaped_model("llama3-8b", str(device), torch_dtype)
        drafters: dict[str, Any] = {"llama3-1b": shaped_model("llama3-1b", str(device), torch_dtype, seed=1),
                                    "ngram": "ngram"}
        prompts = make_prompts(regimes, prompts_per_domain, vocab_size=model.config.vocab_size, seed=seed)
        note = "random weights and random prompts: acceptance is meaningless; forward and step costs are real"
    else:
        if target is None:
            raise ValueError("Give --target (or --shaped).")
        tok = load_tokenizer(tokenizer or target)
        prompts = make_prompts(regimes, prompts_per_domain, tokenizer=tok, corpus=corpus, seed=seed, style=style,
                               snippet_tokens=snippet_tokens)
        model = load_model(target, device, torch_dtype)
        drafters = {}
        for spec, built in zip(drafts, store_drafters(drafts, corpus, tok)):  # "store:DOMAIN": a datastore
            is_path = isinstance(built, str) and built != "ngram" and not _is_self_drafter(built)
            drafters[drafter_name(spec)] = load_model(built, device, torch_dtype) if is_path else built
        note = None
    results = run(model, drafters, prompts, regimes, seed=seed, **options)
    results["settings"]["target"] = "llama3-8b (shaped)" if shaped else target
    results["settings"]["style"] = style
    if style == "chat":
        results["settings"]["snippet_tokens"] = snippet_tokens
    if note:
        results["settings"]["note"] = note
    write(results, out_dir)
    return results
