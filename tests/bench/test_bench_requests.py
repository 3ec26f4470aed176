"""``flashspec bench requests`` (the default configuration as a user meets it), on the tiny
models and a tiny corpus: the report's rows and goals are computed from what ran."""

from __future__ import annotations

import functools

import json
from pathlib import Path

import pytest
from chat_tokenizer import save_tiny_chat_pair
from tiny_models import write_tiny_corpus

from flashspec.bench import requests_tree
from flashspec.bench.requests import table
from flashspec.bench.requests_tree import settle_steps
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
        return {"tokens": 100, "seconds": 100 / tps, "tokens_per_second": tps, "steps": steps or {"target@0": 1},
                "cold_steps": 0}

    results = {"device": "cpu: test", "dtype": "float32", "compile": False, "batch": 1, "temperature": 0.0,
               "startup_seconds": 1.0, "warmup_seconds": 0.0,
               "groups": [{"domains": ["code"], "prompt_tokens": [10], "max_new_tokens": 8}] * 2,
               "systems": {"first": [call(90.0), call(100.0)], "warm": [call(100.0), call(100.0)],
                           "target@0": [call(100.0), call(50.0)], "ngram@4": [call(110.0), call(80.0)]}}
    report = table(results)
    assert "lowest 0.90, median 0.95" in report  # first / warm: 0.90 and 1.00
    assert "lowest 1.00, median 1.50" in report  # over the target alone: 1.00 and 2.00
    assert "lowest 1.25, median 1.25 over 1 requests" in report  # only the second pays (1.6x the target)
    # stream totals: default 200 tokens in 2 s; ngram 200 in 100/110 + 100/80 s = 2.159 s: 92.6 tok/s
    assert "best single fixed configuration (the target alone, every chain arm) ngram@4 92.6 tok/s" in report
    assert "default / best single fixed 1.08." in report


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


# ----------------------------------------------------------------------------- draft trees (--tree)
def _chat_corpus(tmp_path):
    target, draft = save_tiny_chat_pair(tmp_path)
    (tmp_path / "corpus").mkdir()
    return target, draft, write_tiny_corpus(tmp_path / "corpus", lines=1500)


@pytest.mark.default_configuration
def test_tree_adds_fixed_trees_and_tree_auto_per_request(tmp_path, capsys):
    """--tree, through the command line, batched and sampled: tree@4 (both drafters' chains of 4 in
    one tree) and tree auto beside the others, each call with its steps per allocation, and tree
    auto's allocation sequence, most-run allocation and settle steps read from the same steps."""
    target, draft, corpus = _chat_corpus(tmp_path)
    out = tmp_path / "out"
    code = main(["bench", "requests", "--target", str(target), "--draft", str(draft), "--draft", "ngram",
                 "--corpus", str(corpus), "--requests", "3", "--new-tokens", "12,20", "--snippet-tokens", "24,40",
                 "--batch", "2", "--temperature", "0.7", "--tree", "--device", "cpu", "--dtype", "float32",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "requests.json").read_text())
    systems = results["systems"]
    assert set(systems) == {"first", "warm", "draft@4", "ngram@4", "target@0", "tree@4", "tree auto"}
    assert results["tree"] == {"gammas": [4], "expand": {}, "settle_window": 20, "settle_share": 0.8}
    assert all(len(calls) == 2 for calls in systems.values())  # 3 requests, 2 per call
    for call in systems["tree@4"]:
        assert set(call["steps"]) == {"draft@4+ngram@4"} and call["tokens"] > 0
    for call in systems["tree auto"]:
        assert {"tokens", "seconds", "tokens_per_second", "selector_seconds"} <= set(call)
        labels = [label for label, n in call["allocations"] for _ in range(n)]
        assert {label: labels.count(label) for label in labels} == call["steps"]
        assert call["most_run"] == max(call["steps"], key=call["steps"].get)
        assert call["settle_steps"] == settle_steps(labels)
    # a fresh budget: the stream's first step is its probe, every drafter at its γ_max, which the
    # never-slower guard refuses (no target-only step measured yet): the target alone runs it
    assert systems["tree auto"][0]["allocations"][0][0] == "target@0"
    assert systems["tree auto"][0]["guard_refused"] >= 1
    summary = results["summary"]
    totals = summary["stream_tokens_per_second"]
    best = max(["draft@4", "ngram@4", "target@0", "tree@4"], key=totals.get)
    assert summary["best_single_fixed"] == best
    assert summary["tree_auto_over_best_single_fixed"] == pytest.approx(totals["tree auto"] / totals[best])
    report = (out / "requests.md").read_text()
    tree_table = report.split("Draft trees")[1]
    assert tree_table.count("\n| ") == 1 + 2  # its header, then one row per call
    assert "Tree auto over the target alone" in report and "Steps until tree auto settles" in report


def test_tree_auto_starts_from_a_fresh_budget():
    """run_trees sets the engine's budget aside: one already on the engine (here, one that always
    chooses the target alone) does not carry into the stream, whose first step is the probe of every
    drafter at its γ_max (unguarded here, as the guard would run the target alone for it)."""
    import flashspec
    from chat_tokenizer import ChatCharTokenizer
    from tiny_models import noisy_copy, tiny_model

    from flashspec.bench.requests_tree import run_trees
    from flashspec.select.tree_budget import TreeBudget

    class TargetAlone(TreeBudget):
        def choose(self, context=None):
            return (0, 0)

    target = tiny_model("llama", seed=0)
    engine = flashspec.SpeculativeEngine(target, ["ngram", noisy_copy(target, 0.05, seed=1)], device="cpu",
                                         tokenizer=ChatCharTokenizer())
    prompt = [ord(c) for c in "the cat sat on the mat; the cat sat on the"]
    engine.tree_budget = TargetAlone([4, 4])
    assert engine.generate_tree([prompt], gammas="auto", max_new_tokens=4).stats.step_log[0].arm is None
    engine.generate_tree = functools.partial(engine.generate_tree, slack=None)
    systems = run_trees(engine, [[{"ids": prompt, "max_new_tokens": 8}]], 0.0, 0, {}, progress=False)
    probe = "+".join(f"{d.name}@4" for d in engine.drafters)
    assert systems["tree auto"][0]["allocations"][0][0] == probe
    assert type(engine.tree_budget) is TreeBudget


def test_a_feature_drafters_part_of_every_tree_can_be_an_expansion(tmp_path):
    """--expand NAME=TOPK,NODES: the feature head's part of tree@4 and of tree auto's trees is a
    top-k expansion of NODES nodes, as its allocation labels say."""
    import transformers
    from test_tree_decode import head_folder

    from flashspec.bench.requests import run, workload_requests

    target_dir, _, corpus = _chat_corpus(tmp_path)
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    requests = workload_requests("corpus", tokenizer, count=2, corpus=corpus, new_tokens=(10,), snippets=(24,))
    folder = head_folder(target)
    name = f"feature-{Path(folder).name}"  # the engine names a feature:DIR drafter after its folder
    results = run(target, [f"feature:{folder}", "ngram"], requests, tokenizer=tokenizer, device="cpu",
                  progress=False, tree=True, expand={name: (3, 5)})
    assert results["tree"]["expand"] == {name: [3, 5]}
    assert all(set(c["steps"]) == {f"{name}@4(top3,5)+ngram@4"} for c in results["systems"]["tree@4"])
    used = {label for c in results["systems"]["tree auto"] for label in c["steps"]}
    assert used and all(f"{name}@0" in label or "(top3," in label for label in used if label != "target@0")


@pytest.mark.parametrize("options, message", [
    (["--expand", "ngram=2,3"], "add --tree"),
    (["--tree", "--expand", "ngram=2"], "NAME=TOPK,NODES"),
    (["--tree", "--expand", "ngram=2,3", "--expand", "ngram=2,4"], "twice"),
    (["--tree", "--expand", "other=2,3"], "not a drafter of this engine"),
    (["--tree", "--expand", "draft=2,3"], "cannot expand a draft tree"),
])
def test_bad_expansions_are_clear_errors_before_anything_is_timed(tmp_path, capsys, options, message):
    target, draft, corpus = _chat_corpus(tmp_path)
    out = tmp_path / "out"
    code = main(["bench", "requests", "--target", str(target), "--draft", "ngram", "--draft", str(draft),
                 "--corpus", str(corpus),
                 "--requests", "2", "--new-tokens", "8", "--device", "cpu", "--out", str(out), "--no-progress",
                 *options])
    assert code == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_run_refuses_an_expansion_without_trees(tmp_path):
    from tiny_models import tiny_model

    from flashspec.bench.requests import run

    with pytest.raises(ValueError, match="add --tree"):
        run(tiny_model("llama", seed=0), ["ngram"], [], device="cpu", progress=False, expand={"ngram": (2, 3)})


def _call(tokens, seconds, steps=None, **extra):
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "steps": steps or {"x": 1}, "cold_steps": 0, **extra}


def test_the_best_single_fixed_configuration_is_the_best_over_the_whole_stream():
    """Stream throughput is total tokens over total seconds: ngram wins request 0 and the tree
    request 1, but over the stream the tree is the best single fixed configuration (the mean of
    per-request tokens/s would pick ngram), and tree auto is divided by its total."""
    auto = dict(allocations=[["a", 1]], most_run="a", most_run_share=1.0, settle_steps=0, selector_seconds=0.0)
    results = {"device": "cpu: test", "dtype": "float32", "compile": False, "batch": 1, "temperature": 0.0,
               "startup_seconds": 1.0, "warmup_seconds": 0.0,
               "groups": [{"domains": ["code"], "prompt_tokens": [10], "max_new_tokens": 8},
                          {"domains": ["prose"], "prompt_tokens": [10], "max_new_tokens": 8}],
               "systems": {"first": [_call(100, 1.0), _call(300, 6.0)], "warm": [_call(100, 1.0), _call(300, 6.0)],
                           "target@0": [_call(100, 2.5), _call(300, 10.0)],
                           "ngram@4": [_call(100, 1.0), _call(300, 10.0)],
                           "tree@4": [_call(100, 2.0), _call(300, 5.0)],
                           "tree auto": [_call(100, 1.25, **auto), _call(300, 6.0, **auto)]}}
    summary = requests_tree.summary(results)
    assert summary["best_single_fixed"] == "tree@4"  # 400 / 7 s = 57.1 tok/s; ngram 400 / 11 s = 36.4
    assert summary["tree_auto_over_best_single_fixed"] == pytest.approx((400 / 7.25) / (400 / 7))
    assert summary["default_over_best_single_fixed"] == pytest.approx((400 / 7) / (400 / 7))
    assert summary["best_fixed_per_request"] == ["ngram@4", "tree@4"]
    assert summary["tree_auto_over_best_fixed_per_request"] == {"lowest": pytest.approx(0.8),
                                                                "median": pytest.approx((0.8 + 50 / 60) / 2)}
    assert summary["tree_auto_over_target"] == {"lowest": pytest.approx(1.67, abs=0.01),
                                                "median": pytest.approx(1.83, abs=0.01), "below": 0, "requests": 2}
    assert summary["settle"]["after_change"]["requests"] == [1]
    report = table(results)
    assert "tree@4 57.1 tok/s" in report and "0.97× the best single fixed configuration" in report


def test_settle_steps_find_the_first_window_where_the_most_run_allocation_holds():
    # A probe, 9 steps of "a", then five blocks of 7 "b" and one exploring "e" (50 steps; "b" runs 35):
    # from step 8 the window 8…27 holds 16 "b" (80 %), from step 7 only 15.
    labels = ["all"] + ["a"] * 9 + (["b"] * 7 + ["e"]) * 5
    assert requests_tree.most_run(labels) == ("b", 35 / 50)
    assert requests_tree.settle_steps(labels) == 8
    assert requests_tree.settle_steps(["b"] * 30) == 0
    assert requests_tree.settle_steps(["a", "b"] * 20) is None  # never 80 % of any window
    assert requests_tree.settle_steps(["a"] * 4 + ["b"]) == 0  # shorter than the window: the whole request
    assert requests_tree.settle_steps(["a", "a", "b"]) is None  # 2 of 3 < 80 %
    assert requests_tree.settle_steps([]) is None
