"""The learning-rate schedule over one run or several (flashspec/training/schedule.py) and
``flashspec train-drafter --total-steps / --resume``: runs in separate sessions add up to one
schedule, recorded in the checkpoint, instead of warming up and annealing each time."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashspec.cli import main
from flashspec.training.schedule import FLOOR, REWARM, WARMUP, Schedule
from flashspec.training.train import TrainOptions


def _one_run(total: int, step: int) -> float:
    """The schedule of a single run, written out: a linear warm-up, then a cosine to FLOOR."""
    progress = min(1.0, step / total)
    if progress < 1 / WARMUP:
        return max(progress, 1 / total) * WARMUP
    done = (progress - 1 / WARMUP) / (1 - 1 / WARMUP)
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * done))


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 5000), cut=st.floats(0.01, 0.99), step=st.integers(0, 5000))
def test_two_runs_follow_the_one_run_schedule(total, cut, step):
    """A run of ``total`` steps, or two runs splitting them, give the same rates at the same place
    (past the resumed run's re-warm-up)."""
    step = min(step, total)
    whole = Schedule(total, total)
    assert whole.fraction(step, 0.0) == pytest.approx(_one_run(total, step))
    first = max(1, min(total - 1, round(cut * total))) if total > 1 else 1
    if first >= total:
        return
    second = Schedule(total, total - first, start=first)
    if step >= first + REWARM:
        assert second.fraction(step - first, 0.0) == pytest.approx(whole.fraction(step, 0.0))
    assert Schedule(total, first).record(first, 0.0) == {"total_steps": total, "position": first}
    assert second.record(total - first, 0.0) == {"total_steps": total, "position": total}


def test_a_resumed_run_ramps_up_again_and_a_clock_capped_run_ends_its_slice():
    resumed = Schedule(1000, 500, start=500)
    assert resumed.fraction(0, 0.0) == pytest.approx(Schedule(1000, 1000).fraction(500, 0.0) / REWARM)
    assert resumed.fraction(REWARM, 0.0) == pytest.approx(Schedule(1000, 1000).fraction(500 + REWARM, 0.0))
    capped = Schedule(1000, 500, max_seconds=10.0)
    assert capped.record(7, 10.0) == {"total_steps": 1000, "position": 500}  # the clock ended the slice
    assert capped.fraction(7, 10.0) == pytest.approx(Schedule(1000, 1000).fraction(500, 0.0))


def test_a_complete_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule of 10 steps is complete"):
        Schedule(10, 5, start=10)
    with pytest.raises(ValueError, match="complete"):
        TrainOptions(steps=5, schedule_steps=10, start_step=12)
    with pytest.raises(ValueError, match="start_step"):
        TrainOptions(start_step=-1)


def test_train_drafter_resumes_on_its_schedule(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))
    from tiny_models import tiny_model
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_model("llama", seed=6, vocab_size=128).save_pretrained(tmp_path / "target")
    tokenizer = Tokenizer(tok_models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?").save_pretrained(tmp_path / "target")
    text = tmp_path / "data.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    common = ["--target", str(tmp_path / "target"), "--data", str(text), "--batch", "2", "--seq-len", "32",
              "--estimate-every", "100", "--device", "cpu"]

    def train(*flags):
        return main(["train-drafter", *common, *flags])

    assert train("--out", str(tmp_path / "a"), "--steps", "3", "--total-steps", "6") == 0, capsys.readouterr().err
    first = json.loads((tmp_path / "a" / "drafter.json").read_text())["training"]
    assert first["schedule"] == {"total_steps": 6, "position": 3}
    assert first["lr_fraction"] > 0.5  # mid-schedule: not annealed
    assert train("--out", str(tmp_path / "b"), "--steps", "3", "--resume", str(tmp_path / "a")) == 0
    second = json.loads((tmp_path / "b" / "drafter.json").read_text())["training"]
    assert second["schedule"] == {"total_steps": 6, "position": 6}
    assert second["options"]["start_step"] == 3 and second["before"]["steps"] == 3
    assert second["lr_fraction"] == pytest.approx(FLOOR * 4 / REWARM)  # the next step's: annealed, re-warming
    capsys.readouterr()
    assert train("--out", str(tmp_path / "c"), "--steps", "3", "--resume", str(tmp_path / "b")) == 2
    assert "has done 6 of its schedule's 6 steps: give --total-steps larger than 6" in capsys.readouterr().err
    assert train("--out", str(tmp_path / "c"), "--steps", "3", "--resume", str(tmp_path / "b"),
                 "--base", str(tmp_path / "a")) == 2
    assert "give one of them" in capsys.readouterr().err
    assert train("--out", str(tmp_path / "c"), "--steps", "2", "--resume", str(tmp_path / "b"),
                 "--total-steps", "8") == 0
    third = json.loads((tmp_path / "c" / "drafter.json").read_text())["training"]
    assert third["schedule"] == {"total_steps": 8, "position": 8} and third["before"]["steps"] == 6
