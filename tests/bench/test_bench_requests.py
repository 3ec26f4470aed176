"""``flashspec bench requests`` (the default configuration as a user meets it), on the tiny
models and a tiny corpus: the report's rows and goals are computed from what ran."""

from __future__ import annotations

import json

import pytest
from chat_tokenizer import save_tiny_chat_pair
from tiny_models import write_tiny_corpus

from flashspec.bench.requests import table
from flashspec.cli import main


@pytest.mark.default_configuration
def test_the_command_runs_the_default_twice_then_every_arm_alone(tmp_path, capsys):
    target, draft = save_tiny_chat_pair(tmp_path)
    (tmp_path / "corpus").mkdir()
    corpus = write_tiny_corpus(tmp_path / "corpus", lines=1500)
    out = tmp_path / "out"
    code = main(["bench", "requests", "--target", str(target), "--draft", str(draft), "--draft", "ngram",
                 "--corpus", str(corpus), "--requests", "3", "--new-tokens", "12,20", "--snippet-tokens", "24,40",
                 "--device", "cpu", "--dtype", "float32", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "requests.json").read_text())
    assert set(results["systems"]) == {"first", "warm", "draft@4", "ngram@4", "target@0"}
    assert [g["max_new_tokens"] for g in results["groups"]] == [12, 20, 12]
    assert all(len(calls) == 3 for calls in results["systems"].values())
    # what the default's guard carried after each request: measured step costs, in target steps
    # (here the tiny drafters never fit the budget: nothing measured is carried)
    for call in results["systems"]["first"] + results["systems"]["warm"]:
        assert set(call["guard_step_costs"]) <= {"draft@4", "ngram@4"}
        assert all(r > 0 for r in [*call["guard_step_costs"].values(), *call["guard_catch_up_costs"].values()])
    report = (out / "requests.md").read_text()
    assert report.count("\n| ") == 1 + 3  # the header, then one row per request
    assert "First pass over warm: lowest" in report and "Default over the target alone" in report


def test_the_goals_count_only_requests_where_an_arm_pays():
    """Default over the best fixed arm is summarised over the requests where that arm beats the
    target alone by 15 % or more, and the first/warm ratio over every request."""
    def call(tps, steps=None):
        return {"tokens_per_second": tps, "steps": steps or {"target@0": 1}, "cold_steps": 0}

    results = {"device": "cpu: test", "dtype": "float32", "compile": False, "batch": 1, "temperature": 0.0,
               "startup_seconds": 1.0, "warmup_seconds": 0.0,
               "groups": [{"domains": ["code"], "prompt_tokens": [10], "max_new_tokens": 8}] * 2,
               "systems": {"first": [call(90.0), call(100.0)], "warm": [call(100.0), call(100.0)],
                           "target@0": [call(100.0), call(50.0)], "ngram@4": [call(110.0), call(80.0)]}}
    report = table(results)
    assert "lowest 0.90, median 0.95" in report  # first / warm: 0.90 and 1.00
    assert "lowest 1.00, median 1.50" in report  # over the target alone: 1.00 and 2.00
    assert "lowest 1.25, median 1.25 over 1 requests" in report  # only the second pays (1.6x the target)


@pytest.mark.default_configuration
def test_the_mixed_stream_runs_half_in_runs_then_shuffled_and_reports_by_category(tmp_path, capsys):
    target, _ = save_tiny_chat_pair(tmp_path)
    (tmp_path / "corpus").mkdir()
    corpus = write_tiny_corpus(tmp_path / "corpus", lines=1500)
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"Q{i}?", "And?"]}) + "\n"
                                 for i, c in enumerate(["writing", "math"])))
    problems = tmp_path / "he.jsonl"
    problems.write_text("".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"}) + "\n"
                                for i in range(2)))
    out = tmp_path / "out"
    code = main(["bench", "requests", "--workload", "mixed", "--mtbench-file", str(questions), "--humaneval-file",
                 str(problems), "--target", str(target), "--draft", "ngram", "--corpus", str(corpus), "--requests", "8",
                 "--new-tokens", "6", "--snippet-tokens", "24", "--device", "cpu", "--dtype", "float32",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "requests.json").read_text())
    names = [n for g in results["groups"] for n in g["names"]]
    # two of each workload: the first of each in runs (of one here), each MT-bench turn 2 after its turn 1
    assert names[:5] == ["mt-bench/0/turn1", "mt-bench/0/turn2", "HumanEval/0", "code-edit/0", "extraction/0"]
    assert sorted(names[5:]) == sorted(["mt-bench/1/turn1", "mt-bench/1/turn2", "HumanEval/1", "code-edit/1",
                                        "extraction/1"])
    assert names.index("mt-bench/1/turn2") == names.index("mt-bench/1/turn1") + 1
    assert results["workload"].startswith("mixed, 10 requests: 4 MT-bench requests (2 questions, turns 1 and 2), "
                                          "2 HumanEval problems, 2 code-edit requests (held-out code), 2 extraction")
    report = (out / "requests.md").read_text()
    by_category = [line.split(" (")[0] for line in report.splitlines() if line.startswith("* ") and "requests):" in line]
    assert sorted(by_category) == ["* code-edit", "* extraction/text-extraction", "* humaneval",
                                   "* mt-bench/math", "* mt-bench/writing"]
