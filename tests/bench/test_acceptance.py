"""``flashspec bench acceptance`` (flashspec/bench/acceptance.py) on a tiny random-weight model and a
tiny corpus: one row per (drafter, γ, domain, style), consistent numbers, the markdown and plot,
the command line, and clear errors before any model is loaded."""

from __future__ import annotations

import json

import pytest
import torch
from chat_tokenizer import ChatCharTokenizer, save_tiny_chat_pair
from tiny_models import noisy_copy, tiny_model, write_tiny_corpus

from flashspec.bench import acceptance
from flashspec.data.corpus import DOMAINS
from flashspec.cli import main

GAMMAS = [2, 3]
DRAFTERS = {"ngram": "ngram", "early-exit-1": "early-exit:1"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"), lines=1500)


@pytest.fixture(scope="module")
def measured(corpus, tmp_path_factory):
    tok = ChatCharTokenizer()
    requests = acceptance.make_requests(corpus, tok, styles=["text", "chat"], prompts_per_domain=3,
                                        prompt_tokens=16, snippet_tokens=16)
    results = acceptance.run(tiny_model("llama", seed=0), DRAFTERS, requests, gammas=GAMMAS, batch=2,
                             max_new_tokens=10, tokenizer=tok, progress=False)
    out = tmp_path_factory.mktemp("acceptance")
    return results, out, acceptance.write(results, out)


def test_every_drafter_gamma_domain_and_style_has_a_row(measured):
    _, out, files = measured
    saved = json.loads((out / "acceptance.json").read_text())
    keys = [(r["drafter"], r["gamma"], r["domain"], r["style"]) for r in saved["rows"]]
    assert sorted(keys) == sorted((d, g, dom, s) for d in DRAFTERS for g in GAMMAS for dom in DOMAINS
                                  for s in ("text", "chat"))
    assert saved["settings"]["selector"] == "fixed" and saved["settings"]["eos"].startswith("disabled")
    assert sorted(f.name for f in files) == ["acceptance.json", "acceptance.md", "acceptance.png"]
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_numbers_are_consistent(measured):
    results, _, _ = measured
    for r in results["rows"]:
        assert r["prompts"] == 3 and r["batches"] == 2  # batches of 2: one full, one of 1
        assert r["new_tokens"] == 3 * 10  # EOS never stops a row
        assert r["steps"] >= 1 and r["row_steps"] >= r["steps"]
        assert 0 <= r["accepted"] <= r["proposed"] == r["gamma"] * r["row_steps"]
        assert r["acceptance_rate"] == pytest.approx(r["accepted"] / r["proposed"])
        assert r["accepted_per_step"] == pytest.approx(r["accepted"] / r["row_steps"])
        # a row's step commits its accepted drafts and the target's token (the last step may be cut
        # at max_new_tokens)
        assert r["tokens_per_step"] <= r["accepted_per_step"] + 1 + 1e-9
        assert r["tokens_per_step"] >= r["accepted_per_step"] + 1 - r["gamma"] * r["prompts"] / r["row_steps"] - 1e-9
        assert r["decode_tokens"] == r["new_tokens"] - r["prompts"]  # the prefill's first token excluded
        assert r["decode_tokens_per_second"] > 0
        assert r["drafter_forward_share"] is None  # neither n-gram lookup nor early exit has forwards of its own


def test_markdown_has_a_table_per_style(measured):
    _, out, _ = measured
    md = (out / "acceptance.md").read_text()
    assert "## text prompts" in md and "## chat prompts" in md
    assert "| drafter@γ | code | prose | chat | all |" in md
    assert md.count("| early-exit-1@3 |") == 4  # two tables per style


def test_the_all_column_pools_the_domains_steps(measured):
    results, out, _ = measured
    md = (out / "acceptance.md").read_text()
    own = [r for r in results["rows"] if (r["drafter"], r["gamma"], r["style"]) == ("ngram", 2, "text")]
    tokens, steps = sum(r["decode_tokens"] for r in own), sum(r["row_steps"] for r in own)
    alpha = sum(r["accepted"] for r in own) / sum(r["proposed"] for r in own)
    line = next(line for line in md.splitlines() if line.startswith("| ngram@2 |"))  # the text table comes first
    assert line.endswith(f"| {tokens / steps:.2f} ({alpha:.2f}) |")


def test_answers_stop_at_eos_where_asked(corpus):
    target = tiny_model("llama", seed=0)
    tok = ChatCharTokenizer()
    requests = acceptance.make_requests(corpus, tok, styles=["text"], prompts_per_domain=2, prompt_tokens=12)
    common = dict(gammas=[2], batch=2, max_new_tokens=8, tokenizer=tok, warm_up=False, progress=False)
    free = acceptance.run(target, {"ngram": "ngram"}, requests, **common)
    assert all(r["new_tokens"] == 2 * 8 for r in free["rows"])
    # make the first token every row draws its EOS: each answer then ends right there
    firsts = {int(target(torch.tensor([p])).logits[0, -1].argmax()) for d in requests["text"].values() for p in d}
    target.generation_config.eos_token_id = sorted(firsts)
    stopped = acceptance.run(target, {"ngram": "ngram"}, requests, stop_at_eos=True, **common)
    assert stopped["settings"]["eos"].startswith("stops each answer")
    assert all(r["new_tokens"] == 2 and r["decode_tokens"] == 0 for r in stopped["rows"])


def test_a_model_drafter_reports_its_forward_share(corpus):
    target = tiny_model("llama", seed=0)
    tok = ChatCharTokenizer()
    requests = acceptance.make_requests(corpus, tok, styles=["text"], prompts_per_domain=1, prompt_tokens=12)
    results = acceptance.run(target, {"tiny": noisy_copy(target, 0.05, seed=1)}, requests, gammas=[2], batch=1,
                             max_new_tokens=6, tokenizer=tok, warm_up=False, progress=False)
    assert len(results["rows"]) == len(DOMAINS)
    assert all(0 < r["drafter_forward_share"] < 1 for r in results["rows"])


GOOD = {"drafters": ["ngram"], "gammas": [2], "styles": ["text"], "prompts_per_domain": 2, "batch": 1,
        "max_new_tokens": 4}


@pytest.mark.parametrize("change, message", [
    ({"drafters": []}, "at least one drafter"),
    ({"drafters": ["a", "a"]}, "distinct"),
    ({"gammas": []}, "gammas"),
    ({"gammas": [0]}, "gammas"),
    ({"gammas": [2, 2]}, "gammas must be distinct"),
    ({"styles": ["markdown"]}, "Unknown prompt style 'markdown'"),
    ({"styles": []}, "No prompt styles"),
    ({"prompts_per_domain": 0}, "prompts per domain"),
    ({"batch": 0}, "batch"),
    ({"max_new_tokens": 0}, "max new tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"rules": []}, "acceptance rules"),
    ({"rules": ["token", "token"]}, "acceptance rules must be distinct"),
    ({"rules": ["tree"]}, "acceptance rules must be distinct names from token, block"),
])
def test_bad_options_are_clear_value_errors(change, message):
    acceptance.check_options(**GOOD)
    with pytest.raises(ValueError, match=message):
        acceptance.check_options(**{**GOOD, **change})


@pytest.mark.parametrize("args, message", [
    (["--gammas", "2,x"], "--gammas must be"),
    (["--styles", "text,poem"], "Unknown prompt style"),
    (["--batch", "0"], "batch"),
    (["--prompts-per-domain", "0"], "prompts per domain"),
    (["--acceptance", "token,poem"], "acceptance rules"),
])
def test_cli_checks_options_before_loading(args, message, capsys):
    assert main(["bench", "acceptance", "--target", "/nonexistent", "--draft", "ngram", "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_end_to_end(corpus, tmp_path, capsys):
    target, draft = save_tiny_chat_pair(tmp_path)
    out = tmp_path / "out"
    rc = main(["bench", "acceptance", "--target", str(target), "--draft", str(draft), "--draft", "ngram",
               "--draft", "early-exit:1", "--corpus", str(corpus), "--gammas", "2,3", "--styles", "text,chat",
               "--prompts-per-domain", "1", "--prompt-tokens", "12", "--snippet-tokens", "12", "--batch", "1",
               "--max-new-tokens", "6", "--device", "cpu", "--dtype", "float32", "--out", str(out),
               "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads((out / "acceptance.json").read_text())
    assert saved["settings"]["drafters"] == ["draft", "ngram", "early-exit-1"] and saved["complete"] is True
    assert saved["settings"]["target"] == str(target)
    assert len(saved["rows"]) == 3 * 2 * len(DOMAINS) * 2
    assert "| draft@2 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, stop", [
    ([], False),  # held-out corpus continuations: every row generates --max-new-tokens
    (["--workload", "mt-bench"], True),  # the field's benchmarks: answers end at EOS
    (["--workload", "humaneval", "--eos", "ignore"], False),
    (["--workload", "code-edit"], True),  # answers that quote the prompt end at EOS too
    (["--workload", "extraction"], True),
    (["--workload", "mixed"], True),
    (["--eos", "stop"], True),
])
def test_eos_follows_the_workload_unless_given(argv, stop):
    import argparse

    from flashspec.bench.workload_args import add_workload_arguments, workload_options

    parser = argparse.ArgumentParser()
    add_workload_arguments(parser, counts="", eos=True)
    assert workload_options(parser.parse_args(argv))["stop_at_eos"] is stop
    plain = argparse.ArgumentParser()  # a benchmark without --eos passes no such option
    add_workload_arguments(plain, counts="")
    assert "stop_at_eos" not in workload_options(plain.parse_args([]))


def test_token_and_block_rules_are_measured_side_by_side(corpus, tmp_path):
    target = tiny_model("llama", seed=0)
    tok = ChatCharTokenizer()
    requests = acceptance.make_requests(corpus, tok, styles=["text"], prompts_per_domain=2, prompt_tokens=12)
    results = acceptance.run(target, {"tiny": noisy_copy(target, 0.3, seed=1)}, requests, gammas=[3], batch=2,
                             max_new_tokens=12, temperature=0.7, tokenizer=tok, warm_up=False, progress=False,
                             rules=("token", "block"))
    assert results["settings"]["acceptance"] == ["token", "block"]
    rows = {(r["acceptance"], r["domain"]): r for r in results["rows"]}
    assert sorted(rows) == sorted((rule, d) for rule in ("token", "block") for d in DOMAINS)
    assert all(r["new_tokens"] == 2 * 12 and r["proposed"] == 3 * r["row_steps"] for r in rows.values())
    acceptance.write(results, tmp_path)
    md = (tmp_path / "acceptance.md").read_text()
    assert md.count("| tiny@3 |") == 2 and md.count("| tiny@3 block |") == 2  # both tables, each rule


def test_a_run_cut_short_keeps_the_rows_it_measured(corpus, tmp_path, monkeypatch):
    from flashspec.engine import SpeculativeEngine

    target, _ = save_tiny_chat_pair(tmp_path)
    calls = {"n": 0}
    generate = SpeculativeEngine.generate

    def stopped_after_four(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 4:  # the fifth batch: the run is stopped, as a timeout would
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "generate", stopped_after_four)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "acceptance", "--target", str(target), "--draft", "ngram", "--corpus", str(corpus),
              "--gammas", "2,3", "--styles", "text", "--prompts-per-domain", "1", "--prompt-tokens", "12",
              "--batch", "1", "--max-new-tokens", "4", "--device", "cpu", "--dtype", "float32", "--no-warm-up",
              "--out", str(out), "--no-progress"])
    saved = json.loads((out / "acceptance.json").read_text())
    assert saved["complete"] is False and saved["settings"]["target"] == str(target)
    assert [(r["gamma"], r["domain"]) for r in saved["rows"]] == [(2, d) for d in DOMAINS] + [(3, "code")]
    assert "| ngram@2 |" in (out / "acceptance.md").read_text()


def test_a_tree_of_every_drafters_chain_is_measured_beside_them(corpus, tmp_path):
    target = tiny_model("llama", seed=0)
    tok = ChatCharTokenizer()
    requests = acceptance.make_requests(corpus, tok, styles=["text"], prompts_per_domain=2, prompt_tokens=12)
    drafters = {"ngram": "ngram", "self": target, "noisy": noisy_copy(target, 0.3, seed=1)}
    results = acceptance.run(target, drafters, requests, gammas=[2], batch=2, max_new_tokens=10, tokenizer=tok,
                             warm_up=False, progress=False, tree=True)
    rows = {(r["drafter"], r["domain"]): r for r in results["rows"]}
    for domain in DOMAINS:  # the target drafting for itself keeps both drafts: a tree holding it does too
        assert rows[("self", domain)]["tokens_per_step"] == pytest.approx(3.0, abs=0.3)
        tree = rows[("tree", domain)]
        assert tree["tokens_per_step"] >= rows[("self", domain)]["tokens_per_step"] - 1e-9
        assert tree["proposed"] == 3 * 2 * tree["row_steps"]  # every drafter's 2 nodes, every step
    acceptance.write(results, tmp_path)
    assert "| tree@2 |" in (tmp_path / "acceptance.md").read_text()


def test_each_arms_engine_is_gone_before_the_next_one_is_built(corpus, monkeypatch):
    """An arm's engine (and with it, on a GPU, its CUDA graphs' memory pools) is collected before
    the next arm builds its own: otherwise every arm's pools stay held."""
    import weakref

    target = tiny_model("llama", seed=0)
    tok = ChatCharTokenizer()
    requests = acceptance.make_requests(corpus, tok, styles=["text"], prompts_per_domain=1, prompt_tokens=12)
    built, alive_at_build = [], []
    original = acceptance._engine

    def engine(*args, **kwargs):
        alive_at_build.append(sum(ref() is not None for ref in built))
        made = original(*args, **kwargs)
        built.append(weakref.ref(made))
        return made

    monkeypatch.setattr(acceptance, "_engine", engine)
    acceptance.run(target, {"ngram": "ngram"}, requests, gammas=[1, 2, 3], batch=1, max_new_tokens=4,
                   tokenizer=tok, warm_up=False, progress=False)
    assert alive_at_build == [0, 0, 0]


def test_a_feature_drafters_part_of_the_tree_can_be_a_top_k_expansion(corpus, tmp_path):
    """--expand: the tree arm's feature drafter expands EAGLE-2 top-k trees; its nodes are counted."""
    from test_tree_decode import head_folder

    target = tiny_model("llama", seed=0)
    tok = ChatCharTokenizer()
    requests = acceptance.make_requests(corpus, tok, styles=["text"], prompts_per_domain=1, prompt_tokens=12)
    drafters = {"head": f"feature:{head_folder(target)}", "ngram": "ngram"}
    common = dict(gammas=[2], batch=1, max_new_tokens=6, tokenizer=tok, warm_up=False, progress=False, tree=True)
    chains = acceptance.run(target, drafters, requests, **common)
    expanded = acceptance.run(target, drafters, requests, expand={"head": (3, 5)}, **common)
    assert expanded["settings"]["expand"] == {"head": [3, 5]} and chains["settings"]["expand"] is None
    tree = [r for r in expanded["rows"] if r["drafter"] == "tree"]
    chain_tree = [r for r in chains["rows"] if r["drafter"] == "tree"]
    for r, c in zip(tree, chain_tree):  # 5 expanded nodes and n-gram's 2 against two chains of 2, every step
        assert r["proposed"] == (5 + 2) * r["row_steps"] and c["proposed"] == (2 + 2) * c["row_steps"]
    acceptance.write(expanded, tmp_path)
    assert "head's part is a top-k expansion" in (tmp_path / "acceptance.md").read_text()


@pytest.mark.parametrize("change, message", [
    (dict(expand={"head": (2, 3)}), "add --tree"),
    (dict(tree=True, expand={"other": (2, 3)}), "not a drafter measured"),
    (dict(tree=True, expand={"head": (0, 3)}), "topk"),
    (dict(tree=True, expand={"head": (2, 3)}, gammas=[1, 2]), "at most 2 nodes"),
])
def test_bad_expansions_are_clear_value_errors(change, message):
    options = dict(drafters=["head", "ngram"], gammas=[2], styles=["text"], prompts_per_domain=1, batch=1,
                   max_new_tokens=4)
    with pytest.raises(ValueError, match=message):
        acceptance.check_options(**{**options, **change})


@pytest.mark.parametrize("values, expected", [
    (None, None), (["feature-general=4,16"], {"feature-general": (4, 16)}), (["a=b=1,2"], {"a=b": (1, 2)}),
])
def test_expand_arguments_parse(values, expected):
    from flashspec.bench.acceptance_args import parse_expand

    assert parse_expand(values) == expected


@pytest.mark.parametrize("values", [["x=4"], ["=4,16"], ["x=4,y"], ["x=1,2", "x=3,4"], ["x=-1,2"]])
def test_bad_expand_arguments_are_clear_value_errors(values):
    from flashspec.bench.acceptance_args import parse_expand

    with pytest.raises(ValueError, match="--expand"):
        parse_expand(values)
