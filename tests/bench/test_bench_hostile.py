"""``flashspec bench hostile``: its command, its cases and its table, without starting a server
(the cases themselves are tested against a server in tests/serve/)."""

from __future__ import annotations

import json

import pytest

from flashspec.bench import hostile


def test_bench_hostile_is_a_command_and_checks_its_tokenizer_first(tmp_path):
    from flashspec.cli import _parser

    args = _parser().parse_args(["bench", "hostile", "--tokenizer", str(tmp_path / "none")])
    assert args.run is hostile.command and args.target is None and args.out == "bench-results/hostile"
    with pytest.raises(ValueError, match="No tokenizer at"):
        args.run(args)


def test_the_cases_are_what_their_names_say():
    groups = hostile._request_cases()
    cases = {name: (route, hostile._encoded(body)) for _, group in groups for name, route, body in group}
    assert groups[0] == (True, []) and all(watched for watched, group in groups if len(group) > 1)
    assert len(cases["20 MB text prompt"][1]) > 20 * hostile.MB
    assert len(json.loads(cases["20 MB in the unused `user` field"][1])["user"]) == 20 * hostile.MB
    assert hostile.MB - 200 < len(cases["text prompt just under the 1 MiB body limit"][1]) <= hostile.MB
    plain = json.loads(cases["1,000 new tokens, no stop string (the three side by side)"][1])
    four = json.loads(cases["1,000 new tokens, four 10,000-character stop strings"][1])
    assert {k: v for k, v in four.items() if k != "stop"} == plain
    assert [len(s) for s in four["stop"]] == [10_000] * 4 and four["max_tokens"] == 1000
    assert cases["JSON nested 10,000 levels deep"][1].count(b"[") == 10_000
    assert len(json.loads(cases["a 10,001-character stop string"][1])["stop"][0]) == 10_001


def test_the_table_shows_every_row():
    row = hostile._row("a case", "400", 0.5, None, 700.0, completion_tokens=None)
    results = {"machine": {"cpu": "cpu", "cores": 2}, "config": {"target": "t", "tokenizer": "/x/tok",
                                                                  "server_flags": "f", "watch": "w"},
               "server_rss_ready_mb": 650.0, "rows": [row, hostile._row("slow", "closed", None)],
               "load_average_1min": {"before": 1.0, "after": 2.0}}
    table = hostile.summarize(results)
    assert "| a case | 400 | 0.50 | — | — | 700 |" in table and "| slow | closed | — |" in table
