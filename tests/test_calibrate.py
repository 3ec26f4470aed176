"""Calibration (flashspec.tuning.calibrate, ``flashspec calibrate``): the speedup formula, cost curves
cached on disk by key, and the command, on tiny random-weight models (no downloads)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashspec.tuning import calibrate
from flashspec.tuning import timing
from flashspec.tuning.calibrate import CostCurve, measure, predict_speedup, predicted_tokens_per_second
from flashspec.cli import main
from tiny_models import noisy_copy, tiny_model

KEY = dict(model="m-0", device="cpu: test", dtype="float32", torch_version="t", transformers_version="tf",
           flashspec_version="f", wrapper="StaticLM", context=8, method="host clock")


def curve(*seconds: float, **key) -> CostCurve:
    return CostCurve(seconds=seconds, **{**KEY, **key})


# T(w) = 1.0, 1.2, 1.4, 1.6 s; a drafter of 0.1 s per token.
T = curve(1.0, 1.2, 1.4, 1.6)


# ------------------------------------------------------------------ the formula
@pytest.mark.parametrize("alpha, gamma, expected", [
    (0.0, 1, 1 / 1.3),            # E = 1; step 0.1 + T(2) = 1.3
    (0.5, 2, 1.75 / 1.6),         # E = (1 - 0.5^3) / 0.5 = 1.75; step 0.2 + 1.4
    (0.9, 1, 1.9 / 1.3),          # E = 1 + 0.9
    (1.0, 3, 4 / 1.9),            # E = γ + 1 = 4; step 0.3 + 1.6
    (1.0, 1, 2 / 1.3),
])
def test_speedup_matches_hand_checked_values(alpha, gamma, expected):
    assert predict_speedup(T, 0.1, alpha, gamma) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_gamma_zero_is_exactly_the_target_alone(alpha):
    assert predict_speedup(T, 0.1, alpha, 0) == 1.0
    assert predict_speedup(curve(49.0, 50.0), 123.0, alpha, 0) == 1.0  # (1 / 49) * 49 is not 1.0 in floats
    assert predicted_tokens_per_second(curve(0.25), 0.1, alpha, 0) == 4.0  # 1 / T(1)


def test_tokens_per_second_scale_with_the_curve_but_the_speedup_does_not():
    twice = curve(*(2 * s for s in T.seconds))
    assert predicted_tokens_per_second(T, 0.1, 0.5, 2) == pytest.approx(1.75 / 1.6)
    assert predicted_tokens_per_second(twice, 0.2, 0.5, 2) == pytest.approx(1.75 / 3.2)
    assert predict_speedup(twice, 0.2, 0.5, 2) == pytest.approx(predict_speedup(T, 0.1, 0.5, 2))


def test_a_drafter_curve_costs_its_one_token_forward():
    drafter = curve(0.1, 5.0, 9.0)  # only the width-1 cost is a drafted token's
    assert predict_speedup(T, drafter, 0.5, 2) == predict_speedup(T, 0.1, 0.5, 2)


def test_a_slow_drafter_loses_to_the_target_alone():
    assert predict_speedup(T, 2.0, 0.3, 1) < 1.0 < predict_speedup(T, 0.01, 0.9, 1)


@settings(max_examples=200, deadline=None)
@given(seconds=st.lists(st.floats(1e-6, 10.0), min_size=1, max_size=9), drafter=st.floats(0.0, 10.0),
       alpha=st.floats(0.0, 1.0), gamma=st.integers(-2, 12))
@example(seconds=[1.0, 1.0], drafter=0.0, alpha=1.0, gamma=1)
@example(seconds=[1.0], drafter=0.5, alpha=0.5, gamma=1)  # γ = 1 needs width 2: out of range
def test_predictions_are_finite_and_positive_or_a_clear_error(seconds, drafter, alpha, gamma):
    target = curve(*seconds)
    if gamma < 0:
        with pytest.raises(ValueError, match="whole number >= 0"):
            predict_speedup(target, drafter, alpha, gamma)
    elif gamma + 1 > len(seconds):
        with pytest.raises(ValueError, match=f"measured up to width {len(seconds)}, not {gamma + 1}"):
            predict_speedup(target, drafter, alpha, gamma)
    else:
        speedup = predict_speedup(target, drafter, alpha, gamma)
        assert math.isfinite(speedup) and speedup > 0
        if gamma == 0:
            assert speedup == 1.0
        # Never more than γ + 1 tokens for one verify forward (a free drafter, every draft accepted).
        assert speedup <= (gamma + 1) * target.at(1) / target.at(gamma + 1) * (1 + 1e-12)
        # More acceptance never predicts less.
        assert predict_speedup(target, drafter, min(1.0, alpha + 0.1), gamma) >= speedup * (1 - 1e-12)


@pytest.mark.parametrize("args, message", [
    ((T, 0.1, -0.1, 1), "alpha is a probability"),
    ((T, 0.1, 1.5, 1), "alpha is a probability"),
    ((T, 0.1, float("nan"), 1), "alpha is a probability"),
    ((T, 0.1, True, 1), "alpha is a probability"),
    ((T, 0.1, 0.5, -1), "gamma, the tokens drafted per step, is a whole number >= 0"),
    ((T, 0.1, 0.5, 1.0), "gamma, the tokens drafted per step, is a whole number >= 0"),
    ((T, 0.1, 0.5, True), "gamma, the tokens drafted per step, is a whole number >= 0"),
    ((T, 0.1, 0.5, 4), "measured up to width 4, not 5"),
    ((T, -0.1, 0.5, 1), "cost per drafted token must be a finite number of seconds >= 0"),
    ((T, float("inf"), 0.5, 1), "cost per drafted token must be a finite number of seconds >= 0"),
    ((T, -0.1, 0.5, 0), "cost per drafted token must be a finite number of seconds >= 0"),  # even at γ = 0
    ((T, "fast", 0.5, 1), "cost per drafted token must be a finite number of seconds >= 0"),
])
def test_bad_prediction_arguments_are_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        predict_speedup(*args)


@pytest.mark.parametrize("seconds, message", [
    ((), "at least one width"),
    ((1.0, 0.0), "width 2 must be a finite number of seconds > 0"),
    ((-1.0,), "width 1 must be a finite number of seconds > 0"),
    ((1.0, float("nan")), "width 2 must be a finite number of seconds > 0"),
])
def test_bad_curves_are_clear_errors(seconds, message):
    with pytest.raises(ValueError, match=message):
        CostCurve(seconds=seconds, **KEY)


@pytest.mark.parametrize("width", [0, -1, 1.0, True])
def test_non_positive_or_fractional_widths_are_clear_errors(width):
    with pytest.raises(ValueError, match="width is a whole number of tokens >= 1"):
        T.at(width)


# ------------------------------------------------------------------ measuring and the disk cache
MODEL = tiny_model("llama")


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """The cache under tmp_path, and a list that grows by one per host-clock timing."""
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path))
    calls: list[int] = []
    best = timing.best_seconds

    def spy(fn, device, repeats):
        calls.append(repeats)
        return best(fn, device, repeats)

    monkeypatch.setattr(timing, "best_seconds", spy)
    return calls


def test_measure_times_every_width_on_the_benchmarks_timer(timed, tmp_path):
    got, path = measure(MODEL, 3, context=8, repeats=1, progress=False)
    assert got.max_width == 3 and all(s > 0 for s in got.seconds)
    assert len(timed) == 4  # a warm-up, then one per width
    assert (got.dtype, got.wrapper, got.context, got.method) == ("float32", "StaticLM", 8, "host clock")
    assert got.device.startswith("cpu: ") and got.transformers_version and got.torch_version == torch.__version__
    assert path.parent == tmp_path / "calibration" and path.is_file()
    record = json.loads(path.read_text())
    assert record["seconds"] == list(got.seconds) and record["key"] == got.key()


def test_a_second_call_reads_the_cache_and_does_not_time(timed):
    first, path = measure(MODEL, 3, context=8, repeats=1, progress=False)
    timed.clear()
    again, again_path = measure(MODEL, 3, context=8, repeats=1, progress=False)
    assert timed == [] and again == first and again_path == path
    narrower, _ = measure(MODEL, 2, context=8, repeats=1, progress=False)  # a wider cached curve covers it
    assert timed == [] and narrower.seconds == first.seconds[:2]
    wider, _ = measure(MODEL, 4, context=8, repeats=1, progress=False)  # it does not cover this
    assert len(timed) == 5 and wider.max_width == 4
    measure(MODEL, 3, context=8, repeats=1, progress=False, use_cache=False)  # --no-cache
    assert len(timed) == 5 + 4


def test_another_dtype_device_or_context_is_another_key_and_is_measured(timed, monkeypatch):
    first, path = measure(MODEL, 2, context=8, repeats=1, progress=False)
    timed.clear()
    half, half_path = measure(tiny_model("llama").to(torch.bfloat16), 2, context=8, repeats=1, progress=False)
    assert len(timed) == 3 and half.dtype == "bfloat16" and half_path != path
    timed.clear()
    measure(MODEL, 2, context=9, repeats=1, progress=False)
    assert len(timed) == 3
    timed.clear()
    monkeypatch.setattr(calibrate, "device_name", lambda device: "another machine")
    other, other_path = measure(MODEL, 2, context=8, repeats=1, progress=False)
    assert len(timed) == 3 and other.device == "another machine" and other_path != path
    timed.clear()
    monkeypatch.setattr(calibrate, "_versions", lambda: {"torch_version": "9", "transformers_version": "9",
                                                         "flashspec_version": "9"})
    measure(MODEL, 2, context=8, repeats=1, progress=False)
    assert len(timed) == 3


def test_a_key_mismatch_in_the_file_is_measured_again(timed):
    first, path = measure(MODEL, 2, context=8, repeats=1, progress=False)
    record = json.loads(path.read_text())
    record["key"]["transformers_version"] = "0.0-another"
    path.write_text(json.dumps(record))
    timed.clear()
    again, _ = measure(MODEL, 2, context=8, repeats=1, progress=False)
    assert len(timed) == 3 and again.key() == first.key()


@pytest.mark.parametrize("content", [
    "{not json",
    "",
    "[1, 2]",
    json.dumps({"format": 1}),
    json.dumps({"format": 99, "key": {}, "seconds": [1.0]}),
    "FILL-NEGATIVE",  # well-formed, but a negative time
])
def test_a_corrupt_cache_file_is_measured_again_with_a_warning(timed, content):
    first, path = measure(MODEL, 2, context=8, repeats=1, progress=False)
    if content == "FILL-NEGATIVE":
        record = json.loads(path.read_text())
        record["seconds"] = [-1.0, 1.0]
        content = json.dumps(record)
    path.write_text(content)
    timed.clear()
    with pytest.warns(RuntimeWarning, match="calibration cache file .* is unreadable"):
        again, again_path = measure(MODEL, 2, context=8, repeats=1, progress=False)
    assert len(timed) == 3 and again_path == path
    assert json.loads(path.read_text())["seconds"] == list(again.seconds)  # rewritten, readable again


def test_measure_works_behind_the_reference_cache_too(timed):
    got, _ = measure(tiny_model("gpt2"), 2, context=8, repeats=1, progress=False)
    assert got.wrapper == "CachedLM" and got.max_width == 2 and len(timed) == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_width=0), "max_width, the widest forward to time, is a whole number >= 1"),
    (dict(max_width=2, context=-1), "context, the cached positions before the timed tokens"),
    (dict(max_width=2, repeats=0), "repeats is a whole number >= 1"),
    (dict(max_width=8, context=250), "exceeds the model's context window of 256"),
])
def test_bad_measure_arguments_are_clear_errors(timed, kwargs, message):
    with pytest.raises(ValueError, match=message):
        measure(MODEL, progress=False, **kwargs)
    assert timed == []


def test_the_progress_bar_shows_and_can_be_turned_off(timed, capsys):
    measure(MODEL, 2, context=8, repeats=1, progress=False, use_cache=False)
    assert "calibrating" not in capsys.readouterr().err
    measure(MODEL, 2, context=8, repeats=1, progress=True, use_cache=False, label="the target")
    assert "calibrating the target" in capsys.readouterr().err


# ------------------------------------------------------------------ the command
def test_the_command_prints_the_table_and_reuses_its_cache(timed, tmp_path, capsys):
    MODEL.save_pretrained(tmp_path / "target")
    noisy_copy(MODEL, 0.1, seed=1).save_pretrained(tmp_path / "draft")
    argv = ["calibrate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
            "--max-gamma", "2", "--context", "8", "--no-progress", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(timed) == 2 * 4  # target and drafter: a warm-up and widths 1..3 each
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["width", "target", "ms", "drafter", "ms"])
    assert [line.split()[0] for line in lines[header + 1: header + 4]] == ["1", "2", "3"]
    gammas = next(i for i, line in enumerate(lines) if line.split()[:1] == ["γ"])
    assert lines[gammas].split() == ["γ", "α=0.3", "α=0.5", "α=0.7", "α=0.9"]
    assert lines[gammas + 1].split() == ["0", "1.00", "1.00", "1.00", "1.00"]
    assert [line.split()[0] for line in lines[gammas + 1: gammas + 4]] == ["0", "1", "2"]
    files = sorted((tmp_path / "calibration").glob("*.json"))
    assert len(files) == 2 and all(str(f) in out for f in files)
    curves = {}
    for f in files:
        record = json.loads(f.read_text())
        curves["draft" if "draft" in f.name else "target"] = CostCurve(seconds=tuple(record["seconds"]),
                                                                       **record["key"])
    for g in (1, 2):  # the table's numbers are the prediction from the two cached curves
        expected = [f"{predict_speedup(curves['target'], curves['draft'], a, g):.2f}" for a in (0.3, 0.5, 0.7, 0.9)]
        assert lines[gammas + 1 + g].split() == [str(g), *expected]
    timed.clear()
    assert main(argv) == 0
    assert timed == [] and capsys.readouterr().out == out  # read back, the same table


def test_the_command_without_a_drafter_gives_the_free_drafter_bound(timed, tmp_path, capsys):
    MODEL.save_pretrained(tmp_path / "target")
    assert main(["calibrate", "--target", str(tmp_path / "target"), "--max-gamma", "1", "--context", "8",
                 "--no-progress", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "drafter ms" not in out and "costs nothing (an upper bound)" in out
    assert len(timed) == 3


@pytest.mark.parametrize("flags, message", [
    (["--draft", "ngram"], "calibrate times drafter models"),
    (["--draft", "feature:/some/dir"], "calibrate times drafter models"),
    (["--max-gamma", "-1"], "--max-gamma must be from 0 to"),
    (["--context", "-3"], "--context must be >= 0"),
])
def test_the_command_checks_its_flags_before_loading(flags, message, capsys):
    assert main(["calibrate", "--target", "/nonexistent/model", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_cpu_device_name_says_which_vector_instructions_torch_uses():
    """AVX2 and AVX-512 kernels of one CPU differ in cost (ATEN_CPU_CAPABILITY can lower them), so
    the calibration key's device names torch's CPU capability (SPEC.md §13)."""
    name = calibrate.device_name(torch.device("cpu"))
    assert name.endswith(", " + torch.backends.cpu.get_cpu_capability()) and "threads" in name


def test_erratic_timings_are_used_but_not_cached(timed, monkeypatch):
    """A busy machine's timings would decide every later run from the cache: a curve where a wider
    forward took far less than a narrower one is used for this call, reported, and not kept."""
    from flashspec.tuning import calibrate

    monkeypatch.setattr(calibrate, "ERRATIC", 0.6)  # the check itself (tests/conftest.py turns it off)
    erratic = iter([0.5, 0.62, 1.98, 3.10, 1.42])  # the warm-up, then widths 1-4: width 4 at 0.46x width 3
    monkeypatch.setattr(calibrate, "_forward_cost", lambda lm, width, context, repeats: next(erratic))
    with pytest.warns(RuntimeWarning, match=r"erratic \(4 tokens took 0.46× the time of 3\)"):
        got, path = measure(MODEL, 4, context=8, repeats=1, progress=False)
    assert got.seconds == (0.62, 1.98, 3.10, 1.42) and not path.exists()
    steady = iter([0.5, 0.60, 0.61, 0.66, 0.70])
    monkeypatch.setattr(calibrate, "_forward_cost", lambda lm, width, context, repeats: next(steady))
    got, path = measure(MODEL, 4, context=8, repeats=1, progress=False)
    assert path.is_file() and json.loads(path.read_text())["seconds"] == [0.60, 0.61, 0.66, 0.70]


def test_erratic_curves_and_steps_are_told_from_steady_ones(monkeypatch):
    from flashspec.tuning import auto, calibrate
    from flashspec.tuning.auto import erratic_steps
    from flashspec.tuning.calibrate import erratic_curve

    monkeypatch.setattr(calibrate, "ERRATIC", 0.6)  # the checks' thresholds (tests/conftest.py turns them off)
    monkeypatch.setattr(auto, "STEADY_SPREAD", 0.5)

    assert erratic_curve([0.6, 0.58, 0.65, 0.7]) is None  # within noise
    assert erratic_curve([1.2, 1.85, 2.9, 3.3, 3.6, 3.1, 1.15]) == "7 tokens took 0.32× the time of 5"
    assert erratic_curve([0.001, 0.0001]) is None  # too short to judge
    steady = [0.80, 0.82, 0.79, 0.81, 0.80, 0.83]
    assert erratic_steps({"target@0": steady, "feature@4": [1.3, 1.31, 1.29, 1.32]}) is None
    busy = {"target@0": steady, "feature@4": [1.3, 4.8, 1.4, 5.2, 2.9, 6.0]}
    assert erratic_steps(busy).startswith("feature@4: its steps' quartiles")
    assert erratic_steps({"ngram@4": [0.001, 0.01, 0.002, 0.02]}) is None  # too short to judge
