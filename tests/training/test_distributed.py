"""Drafter training on several processes (SPEC.md §11.3, "Several processes";
flashspec/training/distributed.py, flashspec/cli/launch.py), on the CPU with gloo.

Two ranks run ``tests/training/ddp_worker.py`` under torchrun (or, where no agent may stop a rank
for the other, started directly over a ``file://`` rendezvous). Checked here:

* two ranks, each on half of every global batch, train the head one process trains on the whole
  batch (weights to 1e-5, losses to 1e-6), with a loss mask that scores each rank's rows unevenly;
* a clock that runs out on one rank only stops both at the same step;
* under ``flashspec train-drafter``, rank 0 alone writes; ``--resume`` continues a checkpoint on
  its schedule; ``--gpus N`` starts torchrun with the same options;
* a rank that fails mid-run leaves the checkpoint in ``--out`` as it was, and the other rank
  exits with an error instead of waiting;
* a checkpoint whose write fails leaves the previous one; bad launches are ``ValueError``s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddp_worker as worker
from flashspec.cli import main
from flashspec.cli import train as train_cli
from flashspec.cli.launch import forwarded_argv, launched
from flashspec.drafters import checkpoint
from flashspec.drafters.checkpoint import load_head, save_drafter
from flashspec.training.train import new_head, train_head

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ddp_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TIMEOUT = 120  # seconds a two-rank run may take before the test calls it a hang


def _settings(tmp: Path) -> dict[str, str]:
    """What the ranks' environment adds: this checkout first on the path, one thread, a cache, and
    no GPU (the ranks train on the CPU with gloo, also on a machine with GPUs)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "FLASHSPEC_CACHE": str(tmp / "cache"),
            "CUDA_VISIBLE_DEVICES": ""}


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, **_settings(tmp), **extra}


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def api_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The API worker's two ranks, run once: their folder and reports."""
    out = tmp_path_factory.mktemp("ranks")
    done = _run([*TORCHRUN, str(WORKER), "api", str(out)], _env(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out, [json.loads((out / f"api-rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_train_the_head_one_process_trains_on_the_whole_batch(api_ranks):
    out, reports = api_ranks
    torch.set_num_threads(1)
    chunks, mask = worker.data()
    head, log = train_head("feature", worker.target(), chunks, worker.OPTIONS, mask=mask, progress=False)
    alone = head.state_dict()
    torch.manual_seed(worker.OPTIONS.seed)
    start = new_head("feature", worker.target(), worker.OPTIONS).state_dict()
    for rank, report in enumerate(reports):
        two = torch.load(out / f"api-rank{rank}.pt")
        assert set(two) == set(alone)
        for name, tensor in alone.items():
            torch.testing.assert_close(two[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
        assert report["equal"]["loss"] == pytest.approx(log["loss"], rel=1e-6)
        assert report["equal"]["tokens"] == log["tokens"] == worker.OPTIONS.steps * worker.OPTIONS.batch * 16
        assert report["equal"]["target_tokens"] == log["target_tokens"]
        assert report["equal"]["processes"] == 2 and log["processes"] == 1
    assert max(float((alone[k] - start[k]).abs().max()) for k in alone) > 1e-2  # training moved the weights
    # the data makes the ranks' own means differ from their shares of the batch's mean
    rows = torch.randint(0, len(chunks), (worker.OPTIONS.batch,), generator=torch.Generator().manual_seed(0))
    scored = mask[rows][:, 1:].sum(1)
    assert scored[:2].sum() != scored[2:].sum()


def test_a_clock_that_runs_out_on_one_rank_stops_both_at_the_same_step(api_ranks):
    _, reports = api_ranks
    assert reports[0]["clock"] == reports[1]["clock"] == {"steps": 1, "stopped_at_step": 1}


def test_a_batch_the_ranks_cannot_split_is_refused_on_every_rank(api_ranks):
    _, reports = api_ranks
    for report in reports:
        assert "The batch (3 sequences per step, over every process) must be divisible by the number of " \
               "processes (2)" in report["odd_batch"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, list[str]]:
    """A tiny target with a character tokenizer, text data, and the options every command shares."""
    from tiny_models import tiny_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("cli")
    tiny_model("llama", seed=6, vocab_size=128).save_pretrained(folder / "target")
    tokenizer = Tokenizer(models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?").save_pretrained(folder / "target")
    (folder / "data.txt").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    common = ["--target", str(folder / "target"), "--data", str(folder / "data.txt"), "--batch", "2",
              "--seq-len", "32", "--estimate-every", "100"]
    return folder, common


def _first_run(folder: Path, common: list[str], monkeypatch) -> Path:
    """One process trains 3 of 6 steps into ``folder/first`` (once)."""
    monkeypatch.setenv("FLASHSPEC_CACHE", str(folder / "cache"))
    first = folder / "first"
    if not (first / "drafter.json").is_file():
        assert main(["train-drafter", *common, "--device", "cpu", "--out", str(first), "--steps", "3",
                     "--total-steps", "6"]) == 0
    return first


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_torchrun_resumes_a_checkpoint_and_rank_zero_alone_writes(setup, monkeypatch):
    folder, common = setup
    first = _first_run(folder, common, monkeypatch)
    out = folder / "resumed"
    done = _run([*TORCHRUN, str(WORKER), "cli", str(folder), *common, "--device", "cpu", "--out", str(out),
                 "--steps", "3", "--resume", str(first)], _env(folder))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert (folder / "writers.txt").read_text().split() == ["0"]
    assert done.stdout.count("training on ") == 1 and done.stdout.count(f"saved {out}") == 1
    record = json.loads((out / "drafter.json").read_text())["training"]
    assert record["schedule"] == {"total_steps": 6, "position": 6} and record["before"]["steps"] == 3
    assert record["processes"] == 2 and len(record["loss"]) == 3 and record["tokens"] == 3 * 2 * 32
    assert record["options"]["start_step"] == 3 and "alpha_saved" in record
    load_head(out, _target(folder))


def _target(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder / "target", dtype=torch.float32)


def test_a_rank_that_fails_leaves_the_checkpoint_and_the_other_rank_stops(setup, monkeypatch, tmp_path):
    """Started without torchrun, so that no agent ends rank 0 for it: it must stop by itself."""
    folder, common = setup
    first = _first_run(folder, common, monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("drafter.json", "drafter.safetensors"):
        (out / name).write_bytes((first / name).read_bytes())
    before = _digests(out)
    env = _env(folder, WORLD_SIZE="2", FAIL_AT_STEP="2", FLASHSPEC_TEST_INIT=f"file://{tmp_path / 'rendezvous'}")
    command = [sys.executable, str(WORKER), "cli", str(tmp_path), *common, "--device", "cpu", "--out", str(out),
               "--steps", "6", "--resume", str(out), "--total-steps", "20"]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=TIMEOUT)[0] for p in ranks]  # a rank left waiting: TimeoutExpired
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert ranks[1].returncode != 0 and "rank 1 fails at step 2" in logs[1]
    assert ranks[0].returncode != 0 and "Error" in logs[0] and "saved" not in logs[0], logs[0][-3000:]
    assert not (tmp_path / "writers.txt").exists()
    assert _digests(out) == before  # nothing written, nothing left half-written
    load_head(out, _target(folder))


def test_gpus_n_starts_torchrun_with_the_same_options(setup, monkeypatch, capfd):
    """``--gpus 2`` on a machine said to have two GPUs (here the ranks train on the CPU)."""
    folder, common = setup
    for key, value in _settings(folder).items():
        monkeypatch.setenv(key, value)
    out = folder / "launched"
    args = _parse(["train-drafter", *common, "--out", str(out), "--steps", "2", "--gpus", "2", "--hard-labels"])
    assert launched(args, visible=2)
    text = capfd.readouterr().out
    assert "--nproc-per-node 2 -m flashspec train-drafter" in text and "--gpus" not in text.splitlines()[0]
    record = json.loads((out / "drafter.json").read_text())["training"]
    assert record["processes"] == 2 and record["options"]["hard_labels"] and len(record["loss"]) == 2


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cli.add_parsers(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.mark.parametrize("extra", [[], ["--taps"], ["--taps", "1,2", "--kind", "feature"], ["--hard-labels", "--data",
                                   "more.txt", "--lr-head", "3e-05", "--max-minutes", "0.5", "--device", "cuda"]])
def test_the_options_torchrun_gets_read_back_as_given(extra):
    argv = ["train-drafter", "--target", "T", "--data", "d.txt", "--out", "o", "--steps", "7", "--gpus", "4", *extra]
    args = _parse(argv)
    forwarded = forwarded_argv(args.launch_parser, args)
    assert "--gpus" not in forwarded
    again = _parse(["train-drafter", *forwarded])
    assert {**vars(again), "gpus": 4, "launch_parser": None} == {**vars(args), "launch_parser": None}


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "0"], "--gpus must be an integer >= 1"),
    (["--gpus", "2", "--batch", "3"], "--batch 3 is the batch of all 2 GPUs together: it must be divisible by "
                                      "--gpus 2"),
    (["--gpus", "2", "--device", "cpu"], "--gpus trains on CUDA GPUs"),
    (["--gpus", "4", "--batch", "8"], "--gpus 4: this machine has 2 CUDA GPUs"),
])
def test_bad_launches_are_clear_errors(flags, message):
    args = _parse(["train-drafter", "--target", "T", "--data", "d.txt", "--out", "o", *flags])
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        launched(args, visible=2)


def test_gpus_under_torchrun_and_gpus_one_run_here(monkeypatch, capsys):
    args = _parse(["train-drafter", "--target", "T", "--data", "d.txt", "--out", "o", "--gpus", "1"])
    assert launched(args, visible=1) is False  # one GPU: this process trains
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="under torchrun leave --gpus out"):
        launched(args, visible=1)
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["train-drafter", "--target", "T", "--data", "d.txt", "--out", "o", "--gpus", "0"]) == 2
    assert "--gpus must be" in capsys.readouterr().err


def test_under_torchrun_a_rank_takes_no_device_but_its_own(monkeypatch):
    from flashspec.training.distributed import join

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="each trains on cuda:LOCAL_RANK .* got 'cuda:1'"):
        join("cuda:1")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda, but CUDA is not available"):
            join("cuda")
    assert not torch.distributed.is_initialized()  # refused before joining any group


def test_a_checkpoint_whose_write_fails_leaves_the_previous_one(tmp_path, monkeypatch):
    import safetensors.torch

    from tiny_models import tiny_model

    target = tiny_model("llama", seed=1, vocab_size=64)
    options = worker.OPTIONS
    chunks, _ = worker.data()
    head, log = train_head("feature", target, chunks, options, progress=False)
    save_drafter(head, target, tmp_path, log)
    before = _digests(tmp_path)
    real = safetensors.torch.save_file

    def dies_half_way(tensors, path, *args, **kwargs):
        real(tensors, path, *args, **kwargs)
        Path(path).write_bytes(Path(path).read_bytes()[:100])
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", dies_half_way)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(1.0)
    with pytest.raises(OSError, match="No space left"):
        save_drafter(head, target, tmp_path, log)
    assert _digests(tmp_path) == before  # and no temporary file left behind
    monkeypatch.setattr(checkpoint, "_flush", lambda path: (_ for _ in ()).throw(OSError("I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        checkpoint.write_meta(tmp_path, {"format": 1})
    assert _digests(tmp_path) == before
    load_head(tmp_path, target)
