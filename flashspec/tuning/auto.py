"""Calibrated defaults: the dtype and the draft lengths that pay on this machine (SPEC.md §13,
"Choosing the dtype and γ").

:func:`calibrated_engine` builds the engine a user gets from ``flashspec generate`` and
``flashspec demo`` (``flashspec.calibrated_engine``): it times what it needs on the
user's own hardware (once: every measurement is cached on disk, :mod:`flashspec.tuning.calibrate`),
chooses the dtype of a target given as a path, measures one decode step of every drafter at each
γ = 1 … γ_max against a target-only step, keeps the draft lengths that can pay and drops drafters
that cannot, and returns an engine with ``selector="auto"`` (the target-only arm and the
never-slower guard, SPEC.md §8) together with a :class:`Choice` that says what was chosen and why.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checks import check_int
from .calibrate import (
    JUDGED,
    CostCurve,
    _cache_path,
    _read_json,
    _versions,
    _write_json,
    device_name,
    measure,
    model_identity,
)

__all__ = ["ALPHA_HIGH", "ALPHA_LOW", "Choice", "calibrate_engine", "calibrated_engine", "choose_dtype", "erratic_steps",
           "measure_steps",
           "seed_guard_priors", "speedup_from_steps"]

ALPHA_LOW = 0.6  # an acceptance rate most drafters reach on most text
ALPHA_HIGH = 0.9  # one only a good drafter on easy text reaches: drafting that loses even here cannot pay
DEFAULT_MAX_GAMMA = 6
STEPS = 6  # decode steps timed per arm (the first of them is dropped: it may pay one-off costs)
CONTEXT = 128  # prompt tokens before the timed steps


@dataclass
class Choice:
    """What :func:`calibrated_engine` chose and the measurements behind it."""

    dtype: torch.dtype
    dtype_reason: str
    target_curves: dict[str, CostCurve] = field(default_factory=dict)  # per dtype timed (e.g. "bfloat16")
    target_step: float = 0.0  # seconds of one target-only decode step
    step_seconds: dict[str, list[float]] = field(default_factory=dict)  # per drafter: a step at γ = 1 … γ_max
    gammas: dict[str, list[int]] = field(default_factory=dict)  # per drafter kept: its draft lengths
    dropped: list[str] = field(default_factory=list)  # drafters that cannot pay here
    # per drafter: what its first proposal of a request (over the CONTEXT-token prompt) added to a
    # step: its catch-up on the prompt, which the never-slower guard prices (SPEC.md §8)
    catch_up_seconds: dict[str, float] = field(default_factory=dict)

    def speedup(self, drafter: str, gamma: int, alpha: float) -> float:
        """Predicted speedup of ``drafter`` at ``gamma`` over the target alone at acceptance ``alpha``."""
        return speedup_from_steps(self.target_step, self.step_seconds[drafter][gamma - 1], alpha, gamma)

    def explain(self) -> str:
        """The tables and sentences the CLI prints."""
        lines = [f"dtype: {str(self.dtype).removeprefix('torch.')} ({self.dtype_reason})"]
        for name, curve in self.target_curves.items():
            widths = "  ".join(f"{w}: {1e3 * s:.1f}" for w, s in enumerate(curve.seconds, start=1))
            lines.append(f"  target forward ms by tokens, {name}: {widths}")
        lines.append(f"one decode step: target alone {1e3 * self.target_step:.1f} ms")
        lines.append(f"  {'drafter':<24} {'γ':>2} {'step ms':>8} {'× target':>8} {'α=' + str(ALPHA_LOW):>7} "
                     f"{'α=' + str(ALPHA_HIGH):>7}")
        for name, seconds in self.step_seconds.items():
            for g, s in enumerate(seconds, start=1):
                mark = " <" if g in self.gammas.get(name, []) else ""
                lines.append(f"  {name:<24} {g:>2} {1e3 * s:>8.1f} {s / self.target_step:>8.2f} "
                             f"{self.speedup(name, g, ALPHA_LOW):>6.2f}× {self.speedup(name, g, ALPHA_HIGH):>6.2f}×"
                             f"{mark}")
        if self.catch_up_seconds:
            costs = ", ".join(f"{n} {1e3 * c:.1f} ms" for n, c in self.catch_up_seconds.items())
            lines.append(f"  a drafter's first proposal of a request also feeds the prompt ({CONTEXT} tokens): {costs}")
        if self.gammas:
            kept = ", ".join(f"{n} at γ = {', '.join(map(str, g))}" for n, g in self.gammas.items())
            lines.append(f"drafting with {kept} (marked <: the best γ at α = {ALPHA_LOW} and at α = {ALPHA_HIGH}), "
                         "beside the target alone; the never-slower guard keeps each request near its speed")
        for name in self.dropped:
            best = max(range(1, len(self.step_seconds[name]) + 1), key=lambda g: self.speedup(name, g, ALPHA_HIGH))
            lines.append(f"{name} cannot pay on this machine: even if {ALPHA_HIGH:.0%} of its drafts were accepted, "
                         f"its best step (γ = {best}) would give {self.speedup(name, best, ALPHA_HIGH):.2f}× the "
                         "target's tokens per second")
        if not self.gammas:
            lines.append("speculation cannot pay here with these drafters: decoding with the target alone")
        return "\n".join(lines)


def speedup_from_steps(target_step: float, step: float, alpha: float, gamma: int) -> float:
    """E(α, γ) · s₀ / s(γ): tokens per step of drafting γ at acceptance α over the step's cost in
    target-only steps (SPEC.md §13)."""
    tokens = gamma + 1.0 if alpha == 1 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
    return tokens * target_step / step


# ----------------------------------------------------------------------------- the dtype
def choose_dtype(curves: dict[str, CostCurve]) -> tuple[str, str]:
    """The dtype whose target-only forward is fastest (the guard never lets a request run much
    slower than that), unless another is within 5 % of it at width 1 and cheaper at the widest
    width; and the sentence that says why."""
    first = min(curves, key=lambda d: curves[d].at(1))
    best = first
    for name, curve in curves.items():
        if name != first and curve.at(1) <= 1.05 * curves[first].at(1) \
                and curve.seconds[-1] < curves[best].seconds[-1]:
            best = name
    w = curves[best].max_width
    parts = [f"{d}: 1 token {1e3 * c.at(1):.1f} ms, {w} tokens {c.at(w) / c.at(1):.2f}× that" for d, c in curves.items()]
    return best, "; ".join(parts)


# ----------------------------------------------------------------------------- decode steps
def _drafter_identity(drafter: Any) -> str:
    """What a drafter's step cost depends on: its kind, name and the shapes of its weights."""
    parts = [type(drafter).__name__, str(getattr(drafter, "name", ""))]
    model = getattr(drafter, "model", None)
    if model is not None and hasattr(model, "config"):
        parts.append(model_identity(model))
    head = getattr(drafter, "head", None)
    if isinstance(head, torch.nn.Module):
        parts.append(hashlib.sha256(json.dumps([list(p.shape) for p in head.parameters()]).encode()).hexdigest()[:16])
    return ":".join(parts)


def measure_steps(engine: Any, *, context: int = CONTEXT, steps: int = STEPS, use_cache: bool = True,
                  progress: bool = True) -> tuple[float, dict[str, list[float]], dict[str, float]]:
    """The median seconds of one decode step (batch 1, after ``context`` prompt tokens) of every
    arm of ``engine``: the target-only step, and per drafter the steps of each of its γ arms in
    order; and per drafter with a cache the median of what its arms' first steps cost beyond their
    others (the catch-up on the prompt, SPEC.md §4). ``engine`` must have been built with ``selector="fixed"`` and ``target_only=True``
    (:func:`calibrated_engine` makes one); its selection is replaced while timing. Cached on disk
    per target, drafters, device, dtype and library versions, like the forward curves."""
    from tqdm.auto import tqdm

    param = next(engine.target.parameters())
    key = {"kind": "decode steps and first steps", "model": model_identity(engine.target), "device": device_name(param.device),
           "dtype": str(param.dtype).removeprefix("torch."), **_versions(),
           "drafters": [_drafter_identity(d) for d in engine.drafters],
           "arms": [engine.arm_label(a) for a in range(len(engine.arms))], "context": context, "steps": steps}
    if engine.bit_exact:  # other kernels, other costs (SPEC.md §14); keys of the default mode unchanged
        key["bit_exact"] = True
    path = _cache_path(key, prefix="steps-")
    record = _read_json(path, key) if use_cache else None
    if record is None:
        ids = torch.randint(0, engine.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
        seconds, first, spreads = [], [], {}
        for arm in tqdm(range(len(engine.arms)), desc="timing decode steps", unit="arm", disable=not progress):
            engine.selection = engine.new_selection("fixed", arm=arm)
            out = engine.generate([ids], max_new_tokens=steps + 1, eos_token_id=[])  # `steps` decode steps
            times = [r.seconds for r in out.stats.step_log if r.rows]
            seconds.append(statistics.median(times[1:] or times))  # (a drafter accepted whole: fewer steps)
            spreads[engine.arm_label(arm)] = times[1:]
            first.append(times[0])
        record = {"seconds": seconds, "first": first}
        erratic = erratic_steps(spreads)
        if erratic is None:
            _write_json(path, key, record)
        else:  # used for this run, not kept (as the forward curves, SPEC.md §13)
            warnings.warn(f"The decode-step timings are erratic ({erratic}): another program may be using this "
                          "machine. They are used now but not cached; run again when it is quiet.",
                          RuntimeWarning, stacklevel=2)
    seconds, first = record["seconds"], record["first"]
    by_arm = {engine.arm_label(a): s for a, s in enumerate(seconds)}
    base = by_arm["target@0"]
    per_drafter = {d.name: [by_arm[engine.arm_label(a)] for a, (i, _) in enumerate(engine.arms) if i == n]
                   for n, d in enumerate(engine.drafters)}
    catch_ups = {d.name: statistics.median(max(0.0, first[a] - seconds[a]) for a, (i, _) in enumerate(engine.arms)
                                           if i == n) for n, d in enumerate(engine.drafters) if hasattr(d, "catch_up")}
    return base, per_drafter, catch_ups


# ----------------------------------------------------------------------------- the engine
def calibrated_engine(target: Any, drafters: Any = (), **options: Any) -> Any:
    """A :class:`~flashspec.SpeculativeEngine` configured from measurements on this machine
    (SPEC.md §13); what was chosen and why is in its ``choice`` (:class:`Choice`). Options: those
    of :func:`calibrate_engine`."""
    engine, choice = calibrate_engine(target, drafters, **options)
    engine.choice = choice
    return engine


def calibrate_engine(target: Any, drafters: Any = (), *, device: str | torch.device | None = None,
                      dtype: torch.dtype | None = None, max_gamma: int = DEFAULT_MAX_GAMMA,
                      gammas: list[int] | None = None, tokenizer: Any = None,
                      compile: bool = False, use_cache: bool = True, progress: bool = True,
                      **options: Any) -> tuple[Any, Choice]:
    """The engine of :func:`calibrated_engine` and the :class:`Choice` behind it (SPEC.md §13):

    * dtype (a ``target`` given as a path, no ``dtype``): on CUDA bfloat16; on a CPU the faster of
      float32 and bfloat16 by the target's forward curve (:func:`choose_dtype`);
    * draft lengths: every drafter's decode step is timed at γ = 1 … ``max_gamma`` against a
      target-only step; a drafter keeps the γ that predicts the best speedup at α = 0.6 and at
      α = 0.9, and is dropped when even α = 0.9 predicts no speedup (``gammas`` given: those,
      for every drafter, and no step is timed);
    * ``selector="auto"``: the kept arms and the target-only arm, behind the never-slower guard.

    ``options`` go to the engine (``selector_options``, ``share_selector``, ...)."""
    from ..decode.request import MAX_DRAFT_TOKENS, parse_device
    from ..drafters import ModelDrafter
    from ..engine import SpeculativeEngine
    from ..models.loading import DTYPES, load_model, load_tokenizer

    check_int("max_gamma", max_gamma, 1, MAX_DRAFT_TOKENS)
    device = parse_device(device)  # checked before anything loads
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or a torch dtype); got {dtype!r}.")
        dtype = DTYPES[dtype]
    elif dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or a torch dtype); got {dtype!r}.")
    curves: dict[str, CostCurve] = {}
    if isinstance(target, str) or hasattr(target, "__fspath__"):
        spec = str(target)
        if tokenizer is None:
            try:
                tokenizer = load_tokenizer(spec)
            except ValueError:
                tokenizer = None  # token-id prompts still work; the engine says why strings do not
        if dtype is not None:
            reason = "as asked"
            model = load_model(spec, device, dtype)
        elif device.type == "cuda":
            dtype, reason = torch.bfloat16, "on CUDA: tensor cores"
            model = load_model(spec, device, dtype)
        else:
            model = load_model(spec, device, torch.float32)
            options_ = dict(use_cache=use_cache, progress=progress, label="target")
            curves["float32"], _ = measure(model, max_gamma + 1, **options_)
            model.to(torch.bfloat16)
            curves["bfloat16"], _ = measure(model, max_gamma + 1, **options_)
            name, reason = choose_dtype(curves)
            dtype = DTYPES[name]
            if dtype == torch.float32:  # the weights were rounded to bfloat16 to time them: load them again
                model = load_model(spec, device, torch.float32)
        target = model
    else:
        dtype, reason = next(target.parameters()).dtype, "the given model's"
    choice = Choice(dtype=dtype, dtype_reason=reason, target_curves=curves)
    drafters = [drafters] if isinstance(drafters, str) or not hasattr(drafters, "__iter__") else list(drafters)
    if gammas is not None:
        engine = SpeculativeEngine(target, drafters, gammas=gammas, tokenizer=tokenizer, device=device, dtype=dtype,
                                   compile=compile, **options)
        choice.gammas = {d.name: list(gammas) for d in engine.drafters}
        return engine, choice
    if not drafters:
        return SpeculativeEngine(target, [], tokenizer=tokenizer, device=device, dtype=dtype, compile=compile,
                                 **options), choice
    probe = SpeculativeEngine(target, drafters, gammas=list(range(1, max_gamma + 1)), selector="fixed",
                              target_only=True, slack=None, tokenizer=tokenizer, device=device, dtype=dtype,
                              compile=compile, bit_exact=options.get("bit_exact", False),
                              block_size=options.get("block_size"),
                              warmup=False)  # timed as it will run (measure_steps drops each arm's first step)
    choice.target_step, choice.step_seconds, choice.catch_up_seconds = measure_steps(
        probe, use_cache=use_cache, progress=progress)
    kept, gammas = [], set()
    for spec, drafter in zip(drafters, probe.drafters):
        name = drafter.name
        best = {a: max(range(1, max_gamma + 1), key=lambda g: choice.speedup(name, g, a)) for a in (ALPHA_LOW, ALPHA_HIGH)}
        if choice.speedup(name, best[ALPHA_HIGH], ALPHA_HIGH) <= 1.0:
            choice.dropped.append(name)
            continue
        choice.gammas[name] = sorted(set(best.values()))
        gammas |= set(best.values())
        # a drafter model loaded by the probe is handed over, not loaded again
        kept.append(drafter.model if isinstance(drafter, ModelDrafter) else spec)
    engine = SpeculativeEngine(probe.target, kept, gammas=sorted(gammas) if kept else None, tokenizer=probe.tokenizer,
                               device=device, dtype=dtype, compile=compile, **options)
    for drafter, name in zip(engine.drafters, [d.name for d in probe.drafters if d.name in choice.gammas]):
        drafter.name = name  # the probe's names (a model handed over would be renamed from its config)
    seed_guard_priors(engine, choice)
    return engine, choice


def seed_guard_priors(engine: Any, choice: Choice) -> None:
    """Start ``engine``'s never-slower guard from the measured costs instead of its cautious
    priors (SPEC.md §8): each arm's step and each drafter's catch-up on a prompt, in target-only
    steps (the catch-up of the calibration's prompt stands for its width class)."""
    from ..select.guard import bucket

    width = CONTEXT + 1  # the first proposal feeds the prompt and the first new token
    for a, (d, g) in enumerate(engine.arms):
        if d is None:
            continue
        name = engine.drafters[d].name
        if name in choice.step_seconds and g is not None and g <= len(choice.step_seconds[name]):
            engine.costs.seed_arm(a, choice.step_seconds[name][g - 1] / choice.target_step)
        if name in choice.catch_up_seconds:
            ratio = choice.catch_up_seconds[name] / choice.target_step * bucket(width) / width
            engine.costs.seed_catch_up((d, bucket(width)), ratio)


STEADY_SPREAD = 0.5  # steps of one arm whose quartiles differ by more than this share of their median


def erratic_steps(times: dict[str, list[float]]) -> str | None:
    """Why decode-step timings cannot be a steady machine's, or None: the steps of one arm do the
    same work, so their interquartile range beyond :data:`STEADY_SPREAD` of their median means the
    timings were disturbed (arms with fewer than 4 steps, or steps under
    :data:`~flashspec.tuning.calibrate.JUDGED` seconds, are not judged)."""
    for label, values in times.items():
        if len(values) < 4:
            continue
        q1, median, q3 = statistics.quantiles(values, n=4)
        if median >= JUDGED and (q3 - q1) / median > STEADY_SPREAD:
            return f"{label}: its steps' quartiles {q1 * 1e3:.1f}–{q3 * 1e3:.1f} ms around {median * 1e3:.1f} ms"
    return None

