"""Calibrated defaults (flashspec.tuning.auto; SPEC.md §13, "Choosing the dtype and γ"): the dtype and
draft lengths chosen from timings on this machine, on tiny random-weight models (no downloads)."""

from __future__ import annotations

import time

import pytest
import torch
from chat_tokenizer import save_tiny_chat_pair
from tiny_models import noisy_copy, tiny_model

import flashspec
from flashspec import Draft, SpeculativeEngine
from flashspec.tuning import auto
from flashspec.tuning.auto import ALPHA_HIGH, ALPHA_LOW, Choice, calibrate_engine, choose_dtype, speedup_from_steps
from flashspec.tuning.calibrate import CostCurve
from flashspec.cli import main
from flashspec.select.guard import DEFAULT_SLACK

pytestmark = pytest.mark.default_configuration

KEY = dict(model="m-0", device="cpu: test", dtype="float32", torch_version="t", transformers_version="tf",
           flashspec_version="f", wrapper="StaticLM", context=8, method="host clock")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))


def curve(*seconds: float) -> CostCurve:
    return CostCurve(seconds=seconds, **KEY)


# ----------------------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("alpha, gamma, step, expected", [
    (0.0, 1, 1.5, 1 / 1.5),  # one token per step of 1.5 target steps
    (0.5, 2, 1.25, 1.75 / 1.25),  # E = 1 + 0.5 + 0.25
    (1.0, 4, 2.0, 5 / 2.0),  # every draft accepted: γ + 1 tokens
])
def test_speedup_from_steps_by_hand(alpha, gamma, step, expected):
    assert speedup_from_steps(2.0, 2.0 * step, alpha, gamma) == pytest.approx(expected)


def test_the_faster_dtype_is_chosen_unless_another_is_as_fast_and_flatter():
    fast_flat = {"float32": curve(0.2, 0.4, 0.6), "bfloat16": curve(0.17, 0.17, 0.18)}
    assert choose_dtype(fast_flat)[0] == "bfloat16"
    emulated = {"float32": curve(0.2, 0.3, 0.4), "bfloat16": curve(0.5, 0.9, 1.4)}  # bf16 without hardware support
    name, reason = choose_dtype(emulated)
    assert name == "float32" and "bfloat16: 1 token 500.0 ms, 3 tokens 2.80× that" in reason
    close = {"float32": curve(0.20, 0.40, 0.60), "bfloat16": curve(0.205, 0.21, 0.22)}  # 2.5 % slower, flat
    assert choose_dtype(close)[0] == "bfloat16"


def test_choice_explains_every_step_and_what_it_kept():
    choice = Choice(dtype=torch.bfloat16, dtype_reason="test", target_curves={"bfloat16": curve(0.1, 0.1)},
                    target_step=0.1, step_seconds={"good": [0.11, 0.12], "bad": [0.5, 0.9]},
                    gammas={"good": [1, 2]}, dropped=["bad"])
    text = choice.explain()
    assert "dtype: bfloat16 (test)" in text and "target alone 100.0 ms" in text
    assert "bad cannot pay on this machine" in text and "drafting with good at γ = 1, 2" in text
    assert choice.speedup("good", 2, ALPHA_LOW) == pytest.approx((1 + 0.6 + 0.36) / 1.2)
    assert choice.gammas and not Choice(torch.float32, "x").gammas


# ----------------------------------------------------------------------------- the engine
class SlowDrafter:
    """Sleeps 60 ms per proposal: it cannot pay whatever it drafts."""

    name = "slow"

    def begin(self, batch_size: int) -> None:
        pass

    def propose(self, history, num_tokens, params, uniforms) -> Draft:
        time.sleep(0.06)
        return Draft(torch.zeros(history.tokens.shape[0], num_tokens, dtype=torch.long), None)


def test_a_drafter_that_cannot_pay_is_dropped_and_the_engine_decodes_alone():
    target = tiny_model("llama")
    engine, choice = calibrate_engine(target, [SlowDrafter()], max_gamma=2, progress=False)
    assert choice.dropped == ["slow"] and not choice.gammas and engine.drafters == []
    assert all(choice.speedup("slow", g, ALPHA_HIGH) <= 1 for g in (1, 2))
    assert "speculation cannot pay here" in choice.explain()
    assert engine.choice is None  # (SpeculativeEngine.calibrated sets it)


def test_kept_drafters_get_the_best_gammas_and_the_default_configuration():
    target = tiny_model("llama")
    draft = noisy_copy(target, 0.05, seed=1)
    engine, choice = calibrate_engine(target, [draft, "ngram"], max_gamma=3, progress=False)
    assert len(choice.step_seconds) == 2 and all(len(s) == 3 for s in choice.step_seconds.values())
    for name, gammas in choice.gammas.items():
        best = {a: max((1, 2, 3), key=lambda g: choice.speedup(name, g, a)) for a in (ALPHA_LOW, ALPHA_HIGH)}
        assert gammas == sorted(set(best.values()))
    assert engine.target_only_arm is not None and engine.slack == DEFAULT_SLACK  # selector "auto"
    assert sorted({g for _, g in engine.arms if g}) == sorted({g for gs in choice.gammas.values() for g in gs})
    assert [d.name for d in engine.drafters] == list(choice.gammas)
    # the guard starts from what was measured (SPEC.md §13): every drafting arm's step, and the
    # model drafter's catch-up on the calibration's prompt (n-gram keeps no cache)
    for a, (d, g) in enumerate(engine.arms):
        if d is not None:
            name = engine.drafters[d].name
            assert engine.arm_costs[a] == pytest.approx(choice.step_seconds[name][g - 1] / choice.target_step)
    model_name = list(choice.step_seconds)[0]
    assert set(choice.catch_up_seconds) == {model_name}
    kept = [d.name for d in engine.drafters]
    assert set(engine.catch_up_costs) == ({(kept.index(model_name), 256)} if model_name in kept else set())
    assert "also feeds the prompt" in choice.explain()
    ids = [[1, 2, 3, 4]]
    expected = SpeculativeEngine(target, []).generate(ids, max_new_tokens=12, eos_token_id=[]).sequences
    assert engine.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences == expected


def test_step_timings_are_cached(monkeypatch):
    target = tiny_model("llama")
    calibrate_engine(target, ["ngram"], max_gamma=2, progress=False)
    calls, generate = [], SpeculativeEngine.generate
    monkeypatch.setattr(SpeculativeEngine, "generate", lambda self, *a, **k: calls.append(1) or generate(self, *a, **k))
    _, choice = calibrate_engine(target, ["ngram"], max_gamma=2, progress=False)
    assert calls == [] and len(choice.step_seconds["ngram"]) == 2  # read back, nothing timed
    calibrate_engine(target, ["ngram"], max_gamma=2, progress=False, use_cache=False)
    assert len(calls) == 3  # timed again: the target alone and γ = 1, 2


def test_a_target_given_as_a_folder_gets_its_dtype_chosen_on_the_cpu(tmp_path):
    folder, draft = save_tiny_chat_pair(tmp_path)
    engine = flashspec.calibrated_engine(str(folder), [str(draft)], device="cpu", max_gamma=2, progress=False)
    choice = engine.choice
    assert set(choice.target_curves) == {"float32", "bfloat16"}
    assert str(choice.dtype).removeprefix("torch.") == choose_dtype(choice.target_curves)[0]
    assert next(engine.target.parameters()).dtype == choice.dtype
    assert engine.tokenizer is not None
    asked = flashspec.calibrated_engine(str(folder), [str(draft)], device="cpu", dtype=torch.float32, gammas=[3],
                                         progress=False)
    assert asked.choice.dtype_reason == "as asked" and asked.choice.target_curves == {}
    assert {g for _, g in asked.arms} == {3, 0}


@pytest.mark.parametrize("bad", [0, -1, 65, 2.5, True])
def test_bad_max_gamma_is_refused(bad):
    with pytest.raises(ValueError, match="max_gamma"):
        calibrate_engine(tiny_model("llama"), ["ngram"], max_gamma=bad)


def test_generate_compare_prints_the_choice_and_why(tmp_path, capsys):
    folder, draft = save_tiny_chat_pair(tmp_path)
    code = main(["generate", "--target", str(folder), "--draft", str(draft), "--draft", "ngram", "--prompt", "abc",
                 "--max-new-tokens", "12", "--compare", "--device", "cpu", "--repeats", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "dtype: " in out and "target forward ms by tokens, float32" in out and "one decode step" in out
    assert "[speculative]" in out and "[target-only]" in out and "speedup" in out
    # two alternating pairs, the speedup their median (SPEC.md §13)
    assert "[speculative, pair 2]" in out and "[target-only, pair 2]" in out
    pairs = [float(r.rstrip("x")) for r in out.split("pairs: ")[1].split(";")[0].split(", ")]
    median = float(out.split("; median ")[1].split("x")[0])
    assert len(pairs) == 2 and abs(median - sum(pairs) / 2) < 0.011
    assert f"speedup {median:.2f}x" in out
    assert ("steps by arm" in out) or ("no drafter can pay on this machine" in out)


def test_module_is_exported():
    assert flashspec.calibrated_engine is auto.calibrated_engine


@pytest.mark.parametrize("bad", ["-1", "gpu", 3.5])
def test_a_bad_device_is_refused_before_anything_loads(bad):
    with pytest.raises(ValueError, match="device"):
        calibrate_engine("/nonexistent/model.gguf", ["ngram"], device=bad)


@pytest.mark.parametrize("bad", ["bf16", 16])
def test_a_bad_dtype_is_refused_before_anything_loads(bad):
    with pytest.raises(ValueError, match="dtype"):
        calibrate_engine("/nonexistent/model.gguf", ["ngram"], dtype=bad)
