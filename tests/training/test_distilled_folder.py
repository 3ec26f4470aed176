"""Distilled folders (flashspec/training/distill.py, shards.py): token shards and their manifest
round-trip; a run stopped midway continues without making finished shards again; other
settings in the same folder are refused; training reads the folder; ``flashspec distill``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from distill_helpers import (
    RECORDED,
    GenerateSpy,
    RoleChatTokenizer,
    Stopped,
    keys,
    record,
    write_sharegpt,
)
from tiny_models import tiny_model, write_tiny_corpus

from flashspec.data.sharegpt import part_of, read_records, sha256_of_file
from flashspec.training.data import check_data, distilled_chunks, sample_windows, training_chunks
from flashspec.training.distill import DistillOptions, distill_folder, weights_sha256
from flashspec.training.shards import load_distilled, read_manifest

OPTIONS = DistillOptions(source="sharegpt", conversations=5, max_turns=2, max_context=150, max_new_tokens=4,
                         shard_size=2)


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory):
    """Six conversations (one in the estimate part, one starting with an answer), the file cut
    off inside a seventh."""
    folder = tmp_path_factory.mktemp("sharegpt")
    ids = keys(4, "train") + keys(1, "estimate")
    records = [record(key, [f"question {n}", f"follow-up {n}"]) for n, key in enumerate(ids)]
    records.insert(1, {"id": "answer-first_0", "conversations": [{"from": "gpt", "value": "hi"},
                                                                  {"from": "human", "value": "skipped"}]})
    records += [record("x_0", ["a", "b", "c"]), record("cut_0", ["never read"])]
    return write_sharegpt(folder / "sg.json", records, cut=20)


def _distill(target, folder, sharegpt, options=OPTIONS, **kwargs):
    return distill_folder(target, RoleChatTokenizer(), folder, options, sharegpt_file=sharegpt, batch=4,
                          progress=False, **kwargs)


def _contents(folder):
    return [(s.source, s.item, s.estimate, s.ids.tolist(), s.mask.tolist()) for s in load_distilled(folder)]


def test_shards_round_trip_with_masks_and_a_complete_manifest(target, sharegpt, tmp_path, monkeypatch):
    spy = GenerateSpy(monkeypatch)
    manifest = _distill(target, tmp_path / "out", sharegpt, arguments={"out": "here"})
    assert read_manifest(tmp_path / "out") == manifest
    # the answered contexts and answers are the samples, masked exactly on the answers
    samples = list(load_distilled(tmp_path / "out"))
    assert [s.item for s in samples] == [0, 1, 2, 3, 4]  # one sample per conversation (the template keeps turns)
    last = {}
    for prompts, outs in spy.calls:
        for p, o in zip(prompts, outs):
            last[tuple(p[:17])] = (p, o)  # "<u>question N</u>": the conversation
    for sample in samples:
        assert sample.ids.dtype == np.uint32 and sample.mask.dtype == bool
        prompt, out = last[tuple(sample.ids[:17].tolist())]
        assert sample.ids.tolist() == prompt + out and sample.mask[-len(out):].all()
        assert RECORDED not in "".join(map(chr, sample.ids.tolist()))
    assert [s.estimate for s in samples] == [False] * 4 + [True]
    assert [s.estimate for s in load_distilled(tmp_path / "out", "estimate")] == [True]
    assert len(list(load_distilled(tmp_path / "out", "train"))) == 4
    # the manifest: identity, names, arguments, per-shard counts and checksums, totals
    identity = manifest["identity"]
    assert identity["options"]["max_turns"] == 2 and identity["options"]["source"] == "sharegpt"
    assert identity["target_sha256"] == weights_sha256(target)
    assert len(identity["files"]["sharegpt_conversations_sha256"]) == 64  # the conversations used, not the file
    assert identity["tokenizer"]["chat_template_sha256"] and manifest["arguments"] == {"out": "here"}
    assert manifest["target"]["model_type"] == "llama"
    assert [e["name"] for e in manifest["shards"]] == ["sharegpt-00000.npz", "sharegpt-00001.npz",
                                                        "sharegpt-00002.npz"]
    assert [(e["first"], e["items"]) for e in manifest["shards"]] == [(0, 2), (2, 2), (4, 1)]
    for entry in manifest["shards"]:
        assert entry["sha256"] == sha256_of_file(tmp_path / "out" / entry["name"]) and entry["seconds"] > 0
    totals = manifest["totals"]
    assert totals["conversations"] == 5 and totals["answers"] == 10 == sum(len(p) for p, _ in spy.calls)
    assert totals["answer_tokens"] == sum(int(s.mask.sum()) for s in samples) == 40
    assert totals["tokens"] == sum(s.ids.size for s in samples) and totals["shards"] == 3
    assert totals["answers_cut"] == 10 and totals["skipped"] == 0


def test_a_stopped_run_continues_where_it_stopped(target, sharegpt, tmp_path, monkeypatch):
    whole = GenerateSpy(monkeypatch)
    _distill(target, tmp_path / "whole", sharegpt)
    assert len(whole.calls) == 6  # per shard: turn 1, turn 2

    GenerateSpy(monkeypatch, fail_at=4)  # stops inside the second shard
    with pytest.raises(Stopped):
        _distill(target, tmp_path / "stopped", sharegpt)
    assert [e["name"] for e in read_manifest(tmp_path / "stopped")["shards"]] == ["sharegpt-00000.npz"]
    again = GenerateSpy(monkeypatch)
    manifest = _distill(target, tmp_path / "stopped", sharegpt)
    assert len(again.calls) == 4  # the finished shard is kept, two are made
    assert _contents(tmp_path / "stopped") == _contents(tmp_path / "whole")
    assert manifest["totals"]["answers"] == 10

    once_more = GenerateSpy(monkeypatch)
    _distill(target, tmp_path / "stopped", sharegpt)
    assert once_more.calls == []  # all finished: nothing made
    # a damaged shard is not finished: reading refuses it, and the next run makes it again
    shard = tmp_path / "stopped" / "sharegpt-00001.npz"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match="does not match its sha256"):
        list(load_distilled(tmp_path / "stopped"))
    remade = GenerateSpy(monkeypatch)
    _distill(target, tmp_path / "stopped", sharegpt)
    assert len(remade.calls) == 2
    assert _contents(tmp_path / "stopped") == _contents(tmp_path / "whole")


def test_a_run_out_of_time_stops_between_shards_and_the_next_continues(target, sharegpt, tmp_path, monkeypatch):
    whole = _distill(target, tmp_path / "whole", sharegpt)
    assert whole["complete"] is True
    spy = GenerateSpy(monkeypatch)
    late = _distill(target, tmp_path / "late", sharegpt, max_seconds=1e-9)  # up before the first shard
    assert late["complete"] is False and late["shards"] == [] and spy.calls == []
    continued = _distill(target, tmp_path / "late", sharegpt)
    assert continued["complete"] is True and len(spy.calls) == 6
    assert _contents(tmp_path / "late") == _contents(tmp_path / "whole")
    spy.calls.clear()  # finished shards are not late: a finished folder stays complete
    assert _distill(target, tmp_path / "late", sharegpt, max_seconds=1e-9)["complete"] is True and spy.calls == []
    with pytest.raises(ValueError, match="max_seconds must be a number of seconds > 0"):
        _distill(target, tmp_path / "late", sharegpt, max_seconds=0)


def test_a_copy_of_the_file_cut_after_the_conversations_used_continues_the_folder(target, sharegpt, tmp_path,
                                                                                 monkeypatch):
    """The identity holds the conversations used, not the file's checksum: a shorter copy that
    still holds them (as one made to travel light) continues the folder without new answers."""
    _distill(target, tmp_path / "out", sharegpt)
    records = list(read_records(sharegpt))
    records = records[: [r["id"] for r in records].index("x_0")]  # the unused tail dropped
    assert len(records) == 6
    shorter = write_sharegpt(tmp_path / "shorter.json", records)
    spy = GenerateSpy(monkeypatch)
    _distill(target, tmp_path / "out", shorter)
    assert spy.calls == []


def test_other_settings_in_the_same_folder_are_refused(target, sharegpt, tmp_path, monkeypatch):
    _distill(target, tmp_path / "out", sharegpt)
    spy = GenerateSpy(monkeypatch)  # options of the corpus alone do not shape ShareGPT data: continued
    _distill(target, tmp_path / "out", sharegpt, DistillOptions(**{**vars(OPTIONS), "style": "text", "count": 9}))
    assert spy.calls == []
    with pytest.raises(ValueError, match=r"options\.max_turns: 2 before, 3 now"):
        _distill(target, tmp_path / "out", sharegpt, DistillOptions(**{**vars(OPTIONS), "max_turns": 3}))
    with pytest.raises(ValueError, match="target_sha256"):
        _distill(tiny_model("llama", seed=1), tmp_path / "out", sharegpt)
    other = write_sharegpt(tmp_path / "other.json", [record("z_0", ["q"])])
    with pytest.raises(ValueError, match="sharegpt_conversations_sha256"):
        _distill(target, tmp_path / "out", other)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        _distill(target, tmp_path / "full", sharegpt)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        _distill(target, tmp_path / "file", sharegpt)


@pytest.mark.parametrize("change, message", [
    ({"source": "web"}, "source must be"), ({"conversations": 0}, "conversations must be"),
    ({"max_turns": 0}, "max_turns"), ({"max_context": -1}, "max_context"), ({"shard_size": 0}, "shard_size"),
    ({"temperature": -1.0}, "temperature"), ({"domain": "poetry"}, "domain"), ({"style": "poem"}, "style"),
    ({"prompt_tokens": 0}, "prompt_tokens"), ({"seed": -1}, "seed"),
])
def test_bad_options(change, message):
    with pytest.raises(ValueError, match=message):
        DistillOptions(**{**vars(OPTIONS), **change})


def test_contexts_that_cannot_fit_the_window_are_refused_before_any_work(target, sharegpt, tmp_path):
    with pytest.raises(ValueError, match="context window of 256"):
        _distill(target, tmp_path / "out", sharegpt, DistillOptions(**{**vars(OPTIONS), "max_context": 253}))
    assert not (tmp_path / "out").exists()


def test_corpus_prompts_mix_with_conversations(target, sharegpt, tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus = write_tiny_corpus(tmp_path / "corpus", lines=600)
    options = DistillOptions(**{**vars(OPTIONS), "source": "mixed", "count": 3, "domain": "code",
                                "prompt_tokens": 20})
    manifest = _distill(target, tmp_path / "out", sharegpt, options, corpus_dir=corpus)
    names = [e["name"] for e in manifest["shards"]]
    assert names == ["corpus-00000.npz", "corpus-00001.npz", "sharegpt-00000.npz", "sharegpt-00001.npz",
                     "sharegpt-00002.npz"]
    corpus_samples = [s for s in load_distilled(tmp_path / "out") if s.source == "corpus"]
    assert [s.item for s in corpus_samples] == [0, 1, 2] and all(s.mask.sum() == 4 for s in corpus_samples)
    assert [s.estimate for s in corpus_samples] == [part_of(f"code-{i}") == "estimate" for i in range(3)]
    assert set(manifest["identity"]["files"]) == {"sharegpt_conversations_sha256", "corpus_sha256",
                                                    "evaluation_sets_left_out"}
    with pytest.raises(ValueError, match="corpus folder"):
        _distill(target, tmp_path / "other", sharegpt, options)


def test_training_reads_a_distilled_folder(target, sharegpt, tmp_path):
    """Training reads a folder's train part as windows of one sample each, with the loss mask on
    the target's answers (tests/training/test_loss_mask.py tests the windows themselves)."""
    _distill(target, tmp_path / "out", sharegpt)
    tok = RoleChatTokenizer()
    train = list(load_distilled(tmp_path / "out", "train"))
    chunks, mask = training_chunks([tmp_path / "out"], tok, 16)
    expected = sample_windows(train, 16)
    assert torch.equal(chunks, expected[0]) and torch.equal(mask, expected[1]) and mask.dtype == torch.bool
    assert int(mask[:, 1:].sum()) == sum(int(s.mask[1:].sum()) for s in train)  # each answer token scored once
    estimate, estimate_mask = training_chunks([tmp_path / "out"], tok, 16, "estimate")
    held = list(load_distilled(tmp_path / "out", "estimate"))
    assert all(torch.equal(a, b) for a, b in zip((estimate, estimate_mask), sample_windows(held, 16)))
    ids, answers = distilled_chunks(tmp_path / "out", 16)
    assert torch.equal(ids, chunks) and torch.equal(answers, mask)
    text = tmp_path / "data.txt"
    text.write_text("abcdefgh\n" * 100)
    both, both_mask = training_chunks([text, tmp_path / "out"], tok, 16)  # text files and folders mix
    assert torch.equal(both[-len(chunks):], chunks) and bool(both_mask[: len(both) - len(chunks)].all())
    check_data([text, tmp_path / "out"])
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a distilled folder"):
        check_data([tmp_path / "plain"])
    long, long_mask = distilled_chunks(tmp_path / "out", 10_000, "estimate")  # one padded row per sample
    assert len(long) == sum(1 for s in held if s.mask[1:].any()) and long[0, : len(held[0].ids)].tolist() == held[0].ids.tolist()
    assert not bool(long_mask[0, len(held[0].ids):].any())


def test_a_folder_made_with_another_tokenizer_is_refused(tmp_path):
    from flashspec.training.shards import save_manifest

    save_manifest(tmp_path, {"format": 1, "identity": {"tokenizer": {"size": 99}}, "shards": []})

    class Sized(RoleChatTokenizer):
        def __len__(self):
            return 128

    with pytest.raises(ValueError, match="tokenizer of 99 tokens"):
        training_chunks([tmp_path], Sized(), 4)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        check_data([tmp_path])


def test_the_command_writes_a_folder_continues_it_and_trains_on_it(sharegpt, tmp_path, capsys, monkeypatch):
    from chat_tokenizer import save_tiny_chat_pair

    from flashspec.cli import main

    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))
    target_dir, _ = save_tiny_chat_pair(tmp_path)
    out = tmp_path / "distilled"
    command = ["distill", "--target", str(target_dir), "--source", "sharegpt", "--sharegpt-file", str(sharegpt),
               "--conversations", "5", "--max-turns", "2", "--max-context", "150", "--max-new-tokens", "4",
               "--batch", "4", "--shard-size", "2", "--device", "cpu", "--dtype", "float32", "--out", str(out),
               "--no-progress"]
    assert main(command) == 0, capsys.readouterr().err
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"wrote {out}: 5 conversations") and "10 answers" in line and "40 answer tokens" in line
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["arguments"]["max_turns"] == 2 and manifest["arguments"]["out"] == str(out)
    # this template renders every turn as a user turn: each turn is its own sample
    assert manifest["totals"]["samples"] == 10
    spy = GenerateSpy(monkeypatch)
    assert main(command) == 0 and spy.calls == []  # the same command again: everything kept
    assert capsys.readouterr().out.strip().splitlines()[-1] == line
    assert main([*command[:-3], "--max-turns", "1", "--out", str(out)]) == 2
    assert "other settings" in capsys.readouterr().err
    assert main([*command, "--batch", "0"]) == 2 and "--batch must be" in capsys.readouterr().err
    assert main(["distill", "--target", "t", "--source", "sharegpt", "--out", "x.txt"]) == 2
    assert "give --out a folder" in capsys.readouterr().err
    rc = main(["train-drafter", "--target", str(target_dir), "--data", str(out), "--out", str(tmp_path / "drafter"),
               "--steps", "2", "--batch", "2", "--seq-len", "16", "--estimate-every", "1", "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "drafter" / "drafter.json").read_text())
    assert record["training"]["tokens"] == 2 * 2 * 16


def test_train_drafter_trains_on_several_distilled_folders(sharegpt, tmp_path, capsys, monkeypatch):
    """``train-drafter --data A --data B``: two folders made apart (other options, one without an
    estimate part) train together on A's windows then B's, and estimate on their estimate parts."""
    from chat_tokenizer import save_tiny_chat_pair

    from flashspec.cli import main

    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))
    target_dir, _ = save_tiny_chat_pair(tmp_path)
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder, conversations, turns in zip(folders, ("5", "3"), ("2", "1")):
        assert main(["distill", "--target", str(target_dir), "--source", "sharegpt", "--sharegpt-file", str(sharegpt),
                     "--conversations", conversations, "--max-turns", turns, "--max-context", "150",
                     "--max-new-tokens", "4", "--batch", "4", "--device", "cpu", "--dtype", "float32",
                     "--out", str(folder), "--no-progress"]) == 0, capsys.readouterr().err
    assert not list(load_distilled(folders[1], "estimate"))  # B: its 3 conversations all train
    each = [distilled_chunks(folder, 16) for folder in folders]
    assert len(each[0][0]) and len(each[1][0])
    both = training_chunks(folders, RoleChatTokenizer(), 16)
    assert torch.equal(both[0], torch.cat([e[0] for e in each]))
    assert torch.equal(both[1], torch.cat([e[1] for e in each]))
    estimate = training_chunks(folders, RoleChatTokenizer(), 16, "estimate")
    assert torch.equal(estimate[0], distilled_chunks(folders[0], 16, "estimate")[0])
    capsys.readouterr()
    rc = main(["train-drafter", "--target", str(target_dir), "--data", str(folders[0]), "--data", str(folders[1]),
               "--out", str(tmp_path / "drafter"), "--steps", "2", "--batch", "2", "--seq-len", "16",
               "--estimate-every", "1", "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    sequences = sum(len(e[0]) for e in each)
    assert f"training on {16 * sequences:,} tokens ({sequences} sequences of 16" in capsys.readouterr().out
    record = json.loads((tmp_path / "drafter" / "drafter.json").read_text())
    assert record["training"]["tokens"] == 2 * 2 * 16 and record["training"]["estimates"]


def test_conversations_that_quote_an_evaluation_set_are_left_out(target, tmp_path, monkeypatch):
    """MT-bench and HumanEval are never trained on: a ShareGPT conversation whose user turn holds
    an MT-bench turn is dropped before the target answers it, and the manifest counts it."""
    turn = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": [turn, "Rewrite it."]}) + "\n")
    monkeypatch.setenv("FLASHSPEC_MTBENCH", str(questions))
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))  # no cached HumanEval: that set is skipped
    ids = keys(3, "train")
    records = [record(ids[0], ["question 0"]), record(ids[1], [f"Please help. {turn.upper()} Thanks!"]),
               record(ids[2], ["question 2"])]
    path = write_sharegpt(tmp_path / "sg.json", records)
    options = DistillOptions(source="sharegpt", conversations=3, max_turns=1, max_context=150, max_new_tokens=4,
                             shard_size=4)
    manifest = _distill(target, tmp_path / "out", path, options)
    assert sorted({s.item for s in load_distilled(tmp_path / "out")}) == [0, 1]  # two conversations, the clean ones
    assert manifest["identity"]["files"]["evaluation_sets_left_out"] == ["mt-bench"]
    assert manifest["evaluation_overlap_dropped"] == 1


def test_sources_take_turns_shard_by_shard():
    from flashspec.training.distill import _in_turn

    order = [(source, number, group) for source, number, group in
             _in_turn([("sharegpt", iter("abcde"), 5), ("corpus", ["x", "y"], 2)], 2)]
    assert order == [("sharegpt", 0, ["a", "b"]), ("corpus", 0, ["x", "y"]), ("sharegpt", 1, ["c", "d"]),
                     ("sharegpt", 2, ["e"])]
