"""Calibration: what one forward of a model costs here, by width, and what that predicts.

:func:`measure` times one cached forward of a model over ``width`` new tokens after a fixed
context, for each width 1 … ``max_width``, on the model's own device and dtype, with the
benchmarks' timers (:mod:`flashspec.tuning.timing`: a CUDA-graph replay timed by CUDA events for a
:class:`~flashspec.models.static.StaticLM` on CUDA, as the engine runs it; else the best of a few calls on
the host clock). The result, a :class:`CostCurve`, is kept on disk (JSON under
``cache_dir()/calibration``) per model, device, dtype and library versions, so a second call
with the same key reads it back instead of timing again.

:func:`predict_speedup` turns a target's curve, a drafter's cost per drafted token and an
acceptance rate α into the expected speedup of drafting γ tokens per step over the target alone
(SPEC.md, "Calibration: what a forward costs here"); γ = 0 is the target alone, exactly 1.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import tempfile
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..models.cached import CachedLM, make_lm
from ..models.loading import context_window, eval_mode
from ..models.static import StaticLM
from ..paths import cache_dir
from ..version import __version__
from . import timing

__all__ = ["DEFAULT_CONTEXT", "CostCurve", "calibration_dir", "device_name", "erratic_curve", "measure", "model_identity",
           "predict_speedup", "predicted_tokens_per_second"]

FORMAT = 1  # the cache file's layout; a file of another format is re-measured


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward by width for one model on one device and dtype.

    ``seconds[w - 1]`` is one forward over ``w`` new tokens (batch 1) after ``context`` cached
    positions, for ``w`` = 1 … :attr:`max_width`. The other fields are the key the curve is
    cached under: a curve measured under another key says nothing about this one."""

    seconds: tuple[float, ...]
    model: str  # the model's identity (:func:`model_identity`)
    device: str  # :func:`device_name`
    dtype: str  # e.g. "bfloat16"
    torch_version: str
    transformers_version: str
    flashspec_version: str
    wrapper: str  # "StaticLM" or "CachedLM": the cache wrapper the engine runs it behind
    context: int  # cached positions before the timed tokens
    method: str  # "CUDA-graph replay" or "host clock"

    def __post_init__(self) -> None:
        seconds = tuple(self.seconds)
        if not seconds:
            raise ValueError("A cost curve needs the cost of at least one width (width 1).")
        for w, s in enumerate(seconds, start=1):
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                raise ValueError(f"The cost of a forward of width {w} must be a finite number of seconds > 0; "
                                 f"got {s!r}.")
        object.__setattr__(self, "seconds", tuple(float(s) for s in seconds))

    @property
    def max_width(self) -> int:
        """The widest forward measured."""
        return len(self.seconds)

    def at(self, width: int) -> float:
        """Seconds of one forward over ``width`` new tokens (1 ≤ ``width`` ≤ :attr:`max_width`)."""
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"A forward's width is a whole number of tokens >= 1; got {width!r}.")
        if width > self.max_width:
            raise ValueError(f"This cost curve was measured up to width {self.max_width}, not {width}: "
                             f"calibrate again with a larger maximum width (max_gamma >= {width - 1}).")
        return self.seconds[width - 1]

    def key(self) -> dict[str, Any]:
        """Everything but the measurements: what must match for a cached curve to be reused."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "seconds"}


# ----------------------------------------------------------------------------- prediction
def _check_alpha(alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"The acceptance rate alpha is a probability: a number from 0 to 1; got {alpha!r}.")
    return float(alpha)


def _drafter_seconds(drafter: float | CostCurve) -> float:
    if isinstance(drafter, CostCurve):
        return drafter.at(1)
    if isinstance(drafter, bool) or not isinstance(drafter, (int, float)) or not math.isfinite(drafter) \
            or drafter < 0:
        raise ValueError("The drafter's cost per drafted token must be a finite number of seconds >= 0 "
                         f"(or its CostCurve); got {drafter!r}.")
    return float(drafter)


def predicted_tokens_per_second(target: CostCurve, drafter_cost_per_token_s: float | CostCurve, alpha: float,
                                gamma: int) -> float:
    """Expected tokens per second of drafting ``gamma`` tokens per step at acceptance ``alpha``:
    E / (γ·d + T(γ+1)) with E = (1 − α^(γ+1)) / (1 − α) (γ + 1 at α = 1), ``d`` the drafter's
    seconds per drafted token (a :class:`CostCurve`'s width-1 cost) and ``T`` the target's curve.
    ``gamma = 0`` is the target alone: 1 / T(1)."""
    alpha = _check_alpha(alpha)
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma, the tokens drafted per step, is a whole number >= 0 (0: the target alone); "
                         f"got {gamma!r}.")
    verify = target.at(gamma + 1)  # checks the curve reaches width γ + 1
    if gamma == 0:
        return 1.0 / verify
    draft = _drafter_seconds(drafter_cost_per_token_s)
    tokens = gamma + 1.0 if alpha == 1 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
    return tokens / (gamma * draft + verify)


def predict_speedup(target: CostCurve, drafter_cost_per_token_s: float | CostCurve, alpha: float,
                    gamma: int) -> float:
    """Predicted speedup of drafting ``gamma`` tokens per step over the target alone:
    :func:`predicted_tokens_per_second` times the target's one-token cost T(1). ``gamma = 0``
    gives exactly 1.0 (the target alone); below 1 drafting loses."""
    rate = predicted_tokens_per_second(target, drafter_cost_per_token_s, alpha, gamma)
    if gamma == 0:
        _drafter_seconds(drafter_cost_per_token_s)  # a bad drafter cost is an error even at γ = 0
        return 1.0
    return rate * target.at(1)


# ----------------------------------------------------------------------------- identity and key
def model_identity(model: Any) -> str:
    """``name-hash`` for a model: its ``name_or_path`` (else its model type) and the first 16
    hex digits of the sha256 of its config (shapes, layers, vocabulary: what a forward's cost
    depends on; weight values do not change it, so they are not read)."""
    config = model.config
    name = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "") or type(model).__name__
    record = {k: v for k, v in config.to_dict().items()
              if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{name}-{digest}"


def device_name(device: torch.device) -> str:
    """A readable name of the hardware a forward runs on: the GPU's name and compute capability
    on CUDA; the CPU's model name, the threads torch uses and its vector instruction set elsewhere."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    cpu = platform.processor() or platform.machine() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # torch's vector instruction set (ATen's CPU capability) too: AVX2 and AVX-512 builds of the
    # same kernels differ in cost, and ATEN_CPU_CAPABILITY can lower it on the same CPU
    return f"{device.type}: {cpu}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"


def calibration_dir() -> Path:
    """Where cost curves are cached: ``cache_dir()/calibration`` (``$FLASHSPEC_CACHE`` or
    ``~/.cache/flashspec``)."""
    return cache_dir() / "calibration"


def _versions() -> dict[str, str]:
    import transformers

    return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "flashspec_version": __version__}


def _cache_path(key: dict[str, Any], prefix: str = "") -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(key["model"]).rsplit("-", 1)[0]).strip("_")[-60:] or "model"
    return calibration_dir() / f"{prefix}{name}-{key['dtype']}-{digest}.json"


def _read_json(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The record cached at ``path`` under exactly ``key`` (None when there is none or its key
    differs; an unreadable file is reported in a warning and ignored, then measured again)."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(f"not a calibration file of format {FORMAT}")
        seconds = record["seconds"]
        if not isinstance(seconds, list) or not seconds or not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0 for s in seconds):
            raise ValueError("its times are not finite positive numbers")
    except (OSError, ValueError, KeyError, TypeError) as error:
        warnings.warn(f"The calibration cache file {path} is unreadable ({error}); measuring again.",
                      RuntimeWarning, stacklevel=3)
        return None
    return record if record.get("key") == json.loads(json.dumps(key)) else None


def _write_json(path: Path, key: dict[str, Any], record: dict[str, Any]) -> None:
    """Write ``record`` under ``key`` atomically (a temporary file renamed over ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as f:
            f.write(json.dumps({"format": FORMAT, "key": key, **record}, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_cached(path: Path, key: dict[str, Any], max_width: int) -> CostCurve | None:
    """The curve cached at ``path`` when it holds this key and at least ``max_width`` widths;
    None when there is none or it was measured under another key (or too narrow); a file that
    cannot be read as a curve is reported in a warning and ignored (it is then re-measured)."""
    record = _read_json(path, key)
    if record is None or len(record["seconds"]) < max_width:
        return None
    return CostCurve(seconds=tuple(record["seconds"]), **key)


def _write_cached(path: Path, curve: CostCurve) -> None:
    """Write atomically (a temporary file renamed over ``path``), so readers never see half a file."""
    _write_json(path, curve.key(), {"seconds": list(curve.seconds),
                                    "seconds_by_width": {str(w): s for w, s in enumerate(curve.seconds, start=1)}})


# ----------------------------------------------------------------------------- measuring
def _forward_cost(lm: StaticLM | CachedLM, width: int, context: int, repeats: int) -> float:
    """Seconds of one forward of ``lm`` over ``width`` new tokens of one row after ``context``
    cached positions, with :mod:`flashspec.tuning.timing` (as ``bench e2e``'s forward costs)."""
    return timing.cached_forward_seconds(lm, 1, width, context, repeats,
                                         generator=torch.Generator().manual_seed(width))


DEFAULT_CONTEXT = 256  # cached positions before the timed tokens (half the window where that is shorter)


def measure(model: Any, max_width: int, *, context: int | None = None, repeats: int = 5, use_cache: bool = True,
            progress: bool = True, label: str | None = None) -> tuple[CostCurve, Path]:
    """The cost of one forward of ``model`` (a transformers causal LM, or the engine's
    :class:`~flashspec.models.static.StaticLM` / :class:`~flashspec.models.cached.CachedLM` around one) over each
    width 1 … ``max_width``, on its device and dtype, after ``context`` cached positions (default
    :data:`DEFAULT_CONTEXT`, or half the model's context window where that is less), and the
    cache file it is kept in. With ``use_cache`` a curve cached under the same key (model,
    device, dtype, versions, wrapper, context, timing method) and at least as wide is read back
    instead; ``use_cache=False`` always times and overwrites the file. ``repeats``: calls per
    width on the host clock (the best is kept). A progress bar (``tqdm``) unless ``progress`` is
    False. Timing resets and overwrites the wrapper's KV cache: do not calibrate an engine's own
    wrapper while it is generating."""
    from tqdm.auto import tqdm

    if isinstance(max_width, bool) or not isinstance(max_width, int) or max_width < 1:
        raise ValueError(f"max_width, the widest forward to time, is a whole number >= 1; got {max_width!r}.")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 0):
        raise ValueError(f"context, the cached positions before the timed tokens, is a whole number >= 0; "
                         f"got {context!r}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats is a whole number >= 1; got {repeats!r}.")
    lm = model if isinstance(model, (StaticLM, CachedLM)) else make_lm(model)
    net = lm.model
    window = context_window(net.config)
    if context is None:
        context = DEFAULT_CONTEXT if window is None else min(DEFAULT_CONTEXT, window // 2)
    if window is not None and context + max_width > window:
        raise ValueError(f"A context of {context} plus forwards of up to {max_width} tokens exceeds the model's "
                         f"context window of {window}: use a shorter context.")
    param = next(net.parameters())
    method = "CUDA-graph replay" if param.device.type == "cuda" and isinstance(lm, StaticLM) else "host clock"
    key = {"model": model_identity(net), "device": device_name(param.device),
           "dtype": str(param.dtype).removeprefix("torch."), **_versions(), "wrapper": type(lm).__name__,
           "context": context, "method": method}
    path = _cache_path(key)
    if use_cache:
        cached = _read_cached(path, key, max_width)
        if cached is not None:
            return CostCurve(seconds=cached.seconds[:max_width], **key), path
    seconds = []
    with eval_mode(net):
        _forward_cost(lm, max_width, context, 2)  # warm-up, untimed: first calls pay one-off costs
        for width in tqdm(range(1, max_width + 1), desc=f"calibrating {label or key['model']}", unit="width",
                          disable=not progress):
            seconds.append(_forward_cost(lm, width, context, repeats))
    curve = CostCurve(seconds=tuple(seconds), **key)
    erratic = erratic_curve(curve.seconds)
    if erratic is None:
        _write_cached(path, curve)
    else:  # used for this run, not kept: a busy machine's timings would decide every later run
        warnings.warn(f"The forward timings of {label or key['model']} are erratic ({erratic}): another program may "
                      "be using this machine. They are used now but not cached; run again when it is quiet.",
                      RuntimeWarning, stacklevel=2)
    return curve, path


ERRATIC = 0.6  # a wider forward measured below this share of a narrower one: not a steady machine
JUDGED = 0.02  # seconds: shorter timings are not judged (launch and timer noise, not another program)


def erratic_curve(seconds: tuple[float, ...] | list[float]) -> str | None:
    """Why a cost curve cannot be a steady machine's, or None: a forward over more tokens never
    costs much less than one over fewer (it does the same work and more), so a width timed under
    :data:`ERRATIC` of a narrower one (of at least :data:`JUDGED` seconds) means the timings were
    disturbed."""
    for width in range(2, len(seconds) + 1):
        narrower = max(range(1, width), key=lambda w: seconds[w - 1])
        if seconds[narrower - 1] >= JUDGED and seconds[width - 1] < ERRATIC * seconds[narrower - 1]:
            return (f"{width} tokens took {seconds[width - 1] / seconds[narrower - 1]:.2f}× the time of "
                    f"{narrower}")
    return None
