"""``flashspec bench tree-anatomy`` (a draft-tree step's cost part by part) on the tiny models and
a tiny corpus: every γ's row is measured, its node count is the tree's, its derived parts come
from its measured ones, and bad options fail before anything loads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from chat_tokenizer import save_tiny_chat_pair
from tiny_models import tiny_model, write_tiny_corpus

from flashspec import FeatureHead, SpeculativeEngine
from flashspec.bench import tree_anatomy
from flashspec.bench.tree_anatomy import derive, expansions_at
from flashspec.bench.tree_probes import StepProbe
from flashspec.cli import main
from flashspec.drafters.expansion import TreeExpansion
from flashspec.stats import StepRecord


def _nodes(gamma: int, expand: tuple[int, int] | None) -> int:
    """A part's nodes at depth γ: γ for a chain, min(N, K + (γ − 1)·K²) for an expansion (SPEC.md §7)."""
    if expand is None:
        return gamma
    topk, nodes = expand
    return min(nodes, topk + (gamma - 1) * topk * topk)


@pytest.mark.parametrize("kind", ["model", "feature"])
def test_every_gamma_is_measured_and_its_parts_add_up(kind, tmp_path, capsys):
    """Model drafter + n-gram (expanding 3 × 6) and feature head (expanding 2 × 4) + n-gram, batch 2,
    through the command line: one row per γ whose nodes are the tree's (the formula, and what the
    steps proposed per row), whose derived parts are computed from its measured ones, with the
    n-gram drafter's forwards 0 and the model's timed alone."""
    target, draft = save_tiny_chat_pair(tmp_path)
    (tmp_path / "corpus").mkdir()
    corpus = write_tiny_corpus(tmp_path / "corpus", lines=1500)
    if kind == "model":
        drafts, name, expand = [str(draft), "ngram"], "draft", {"ngram": (3, 6)}
    else:
        from flashspec.drafters.checkpoint import save_drafter
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        save_drafter(FeatureHead(AutoModelForCausalLM.from_pretrained(target).config, 1),
                     AutoModelForCausalLM.from_pretrained(target), tmp_path / "head")
        drafts, name, expand = [f"feature:{tmp_path / 'head'}", "ngram"], "feature-head", {"feature-head": (2, 4)}
    out = tmp_path / "out"
    argv = ["bench", "tree-anatomy", "--target", str(target), "--corpus", str(corpus), "--prompts", "2", "--batch", "2",
            "--gammas", "1,2", "--max-new-tokens", "10", "--snippet-tokens", "24", "--device", "cpu",
            "--dtype", "float32", "--rounds", "2", "--out", str(out)]
    for d in drafts:
        argv += ["--draft", d]
    for n, (k, m) in expand.items():
        argv += ["--expand", f"{n}={k},{m}"]
    assert main(argv) == 0, capsys.readouterr().err
    results = json.loads((out / "tree-anatomy.json").read_text())
    assert results["graphs"] is False and results["batch"] == 2 and results["drafters"] == [name, "ngram"]
    assert [r["gamma"] for r in results["rows"]] == [1, 2]
    for r in results["rows"]:
        g = r["gamma"]
        sizes = {n: _nodes(g, expand.get(n)) for n in (name, "ngram")}
        assert r["node_sizes"] == sizes
        assert r["nodes"] == sum(sizes.values()) == r["nodes_run"]  # what the steps proposed per row
        labels = [f"{n}@{g}" + (f"(top{expand[n][0]},{sizes[n]})" if n in expand else "") for n in (name, "ngram")]
        assert r["allocation"] == "+".join(labels)
        assert r["steps"] > 0 and r["cold_steps"] == 0  # no graph captured, nothing compiled on a CPU
        assert 1 <= r["tokens_per_step"] <= g + 1
        assert r["graph_source"] == "in the loop" and r["graph_ms"] == r["graph_in_loop_ms"]
        for key in ("step_ms", "graph_ms", "target_forward_ms", "selection_ms"):
            assert r[key] > 0, key
        assert all(r["drafting_ms"][n] > 0 for n in (name, "ngram"))
        assert r["drafter_forwards_ms"]["ngram"] == 0 and r["drafter_forwards_source"]["ngram"] == "none"
        assert r["drafter_forwards_ms"][name] > 0 and r["drafter_forwards_source"][name] == "forwards alone"
        assert r["drafting_total_ms"] == pytest.approx(sum(r["drafting_ms"].values()))
        assert r["drafter_forwards_total_ms"] == pytest.approx(sum(r["drafter_forwards_ms"].values()))
        expected = derive(r["step_ms"], r["graph_ms"], r["target_forward_ms"], r["drafting_total_ms"],
                          r["drafter_forwards_total_ms"], r["selection_ms"])
        assert r["derived_ms"] == pytest.approx(expected)
        assert r["selection_steps"] == sum(r["selection_allocations"].values()) > 0
    report = (out / "tree-anatomy.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[:2] for line in rows] == [["| 1", "4" if kind == "model" else "3"],
                                                       ["| 2", "8" if kind == "model" else "6"]]
    assert "no CUDA graphs on this device" in report
    pytest.importorskip("matplotlib")
    assert (out / "tree-anatomy.png").stat().st_size > 0


def test_the_derivation_on_hand_made_numbers():
    """A 10 ms step: graph 7 (forward 5), proposals 2 (their forwards 1.5), selection 0.5."""
    d = derive(step=10.0, graph=7.0, forward=5.0, drafting=2.0, drafter_forwards=1.5, selection=0.5)
    assert d["machinery"] == pytest.approx(2.0)  # mask, verification, compaction, counts
    assert d["host"] == pytest.approx(1.0)  # staging, the read, host updates
    assert d["drafting_outside_forwards"] == pytest.approx(0.5)
    assert d["outside_share"] == pytest.approx(0.35)  # 1 - (5 + 1.5) / 10
    assert d["outside_share_with_selection"] == pytest.approx(1 - 6.5 / 10.5)
    assert derive(10.0, 7.0, 5.0, 2.0, 0.0)["outside_share_with_selection"] is None


def test_an_expansion_keeps_what_a_part_of_that_depth_holds():
    assert expansions_at({"ngram": (3, 6)}, 1) == {"ngram": TreeExpansion(3, 3)}  # 3 + 0·9
    assert expansions_at({"ngram": (3, 6)}, 2) == {"ngram": TreeExpansion(3, 6)}
    assert expansions_at({"f": (4, 16), "ngram": (2, 3)}, 2) == {"f": TreeExpansion(4, 16),
                                                                "ngram": TreeExpansion(2, 3)}
    assert expansions_at(None, 3) == {}
    with pytest.raises(ValueError, match="topk"):
        expansions_at({"ngram": (0, 4)}, 2)


def test_the_probe_keeps_warm_steps_only():
    """A call's timings are kept where its step was warm; where their count is not one per step,
    all of them."""
    engine = SimpleNamespace(target=SimpleNamespace(device=torch.device("cpu")), drafters=[SimpleNamespace(name="a")])
    probe = StepProbe(engine)
    probe._pending["a"].extend([9.0, 1.0, 2.0])
    probe._pending_after.extend([8.0, 3.0, 4.0])
    probe.keep([StepRecord("a@1", 0, 1, 1, 0.1, cold=True), StepRecord("a@1", 0, 1, 1, 0.1),
                StepRecord("a@1", 0, 1, 1, 0.1)])
    assert probe.proposals["a"] == [1.0, 2.0] and probe.after == [3.0, 4.0]
    probe._pending["a"].extend([5.0, 6.0])
    probe.keep([StepRecord("a@1", 0, 1, 1, 0.1, cold=True)])
    assert probe.proposals["a"] == [1.0, 2.0, 5.0, 6.0] and probe._pending["a"] == []


def _engine() -> SpeculativeEngine:
    model = tiny_model("llama", seed=0)
    return SpeculativeEngine(model, [tiny_model("llama", seed=1), "ngram"], device="cpu")


def test_results_are_written_after_every_gamma_and_the_engine_is_left_as_it_was(tmp_path, monkeypatch):
    """A run cut short at its second γ has written the first γ's row; the probes' wrappers are gone
    and the engine's tree budget is the one it had."""
    engine = _engine()
    engine.tree_budget = None
    measure = tree_anatomy.measure

    def cut_short(engine, groups, gamma, *args, **kwargs):
        if gamma == 2:
            raise RuntimeError("cut short")
        return measure(engine, groups, gamma, *args, **kwargs)

    monkeypatch.setattr(tree_anatomy, "measure", cut_short)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7, 5]]
    with pytest.raises(RuntimeError, match="cut short"):
        tree_anatomy.run(engine, prompts, gammas=[1, 2], max_new_tokens=6, rounds=1, out=tmp_path)
    results = json.loads((tmp_path / "tree-anatomy.json").read_text())
    assert [r["gamma"] for r in results["rows"]] == [1]
    assert (tmp_path / "tree-anatomy.md").read_text().count("\n| 1 | 2 |") == 1  # γ 1: two chains of 1
    assert all(not {"propose", "expand"} & set(vars(d)) for d in engine.drafters)
    assert "run" not in vars(engine._graphs) and engine.tree_budget is None


@pytest.mark.parametrize("expand, message", [
    ({"llama": (2, 2)}, "cannot expand a draft tree"),
    ({"nope": (2, 2)}, "not a drafter of this engine"),
    ({"ngram": (3, 300)}, "nodes"),  # past the 256 nodes a part may keep
])
def test_expansions_are_checked_against_the_engine_before_anything_runs(expand, message, monkeypatch):
    engine = _engine()
    monkeypatch.setattr(tree_anatomy, "measure", lambda *a, **k: pytest.fail("measured before checking"))
    with pytest.raises(ValueError, match=message):
        tree_anatomy.run(engine, [[1, 2, 3]], gammas=[1, 2], expand=expand)


@pytest.mark.parametrize("options, message", [
    (["--gammas", "0"], "--gammas must be comma-separated integers >= 1"),
    (["--gammas", "2,65"], "--gammas must be at most 64"),
    (["--expand", "ngram=3"], "--expand takes NAME=TOPK,NODES"),
    (["--expand", "ngram=0,4"], "topk"),
    (["--prompts", "3", "--batch", "2"], "must be a multiple of --batch"),
    (["--max-new-tokens", "1"], "--max-new-tokens"),
    (["--rounds", "0"], "--rounds"),
    (["--corpus", "/nonexistent/corpus"], "is not a folder"),
])
def test_bad_options_are_clear_errors_before_the_target_loads(options, message, tmp_path, capsys):
    """Each bad option is named (exit 2) though the target does not exist: checked before loading."""
    (tmp_path / "corpus").mkdir()
    code = main(["bench", "tree-anatomy", "--target", str(tmp_path / "missing"), "--corpus", str(tmp_path / "corpus"),
                 "--out", str(tmp_path / "out"), *options])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()
