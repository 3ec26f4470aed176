"""``flashspec bench e2e`` (flashspec/bench/e2e.py) end to end on tiny random-weight models and a
tiny corpus: the JSON schema, greedy outputs identical across every system in float32, the
markdown and PNGs, the analytic formula, and clear errors for bad options."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flashspec.bench import e2e as bench_e2e
from flashspec.data.corpus import DOMAINS, heldout_text
from flashspec.bench.e2e import Regime, check_options, make_prompts, predicted_speedup
from flashspec.cli import main
from flashspec.select.fixed import ScriptedSelector
from flashspec.select.guard import DEFAULT_SLACK, bucket
from tiny_models import CharTokenizer, noisy_copy, tiny_model, write_tiny_corpus

REGIMES = {"long": Regime(24, 40, 12), "short": Regime(8, 8, 6)}  # tiny stand-ins for the real two
GAMMAS = [2, 3]
BATCH_SIZES = [1, 2]
PROMPTS_PER_DOMAIN = 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The corpus folder's three file names, each a few thousand short lines, xz-compressed."""
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0)
    return target, noisy_copy(target, 0.05, seed=1)


@pytest.fixture(scope="module")
def greedy(corpus, models, tmp_path_factory):
    """Every system, both regimes, batch sizes 1 and 2, greedy; written to a folder."""
    target, drafter = models
    prompts = make_prompts(REGIMES, PROMPTS_PER_DOMAIN, tokenizer=CharTokenizer(), corpus=corpus)
    results = bench_e2e.run(target, {"tiny": drafter, "ngram": "ngram"}, prompts, REGIMES,
                            batch_sizes=BATCH_SIZES, gammas=GAMMAS, progress=False)
    out = tmp_path_factory.mktemp("e2e")
    files = bench_e2e.write(results, out)
    return results, out, files


EXPECTED_SYSTEMS = ["hf", "hf-static", "hf-assisted tiny", "hf-lookup", "flashspec", "flashspec tiny@2",
                    "flashspec tiny@3", "flashspec ngram@2", "flashspec ngram@3", "flashspec bandit",
                    "flashspec auto"]


def test_prompts_come_from_the_heldout_part_with_the_regime_lengths(corpus):
    prompts = make_prompts(REGIMES, 3, tokenizer=CharTokenizer(), corpus=corpus)
    for name, regime in REGIMES.items():
        assert set(prompts[name]) == set(DOMAINS)
        for ps in prompts[name].values():
            assert len(ps) == 3 and all(regime.min_prompt <= len(p) <= regime.max_prompt for p in ps)
    for d in DOMAINS:  # the short prompts are the long ones' first tokens
        assert all(lp[:8] == sp for lp, sp in zip(prompts["long"][d], prompts["short"][d]))
    text = "".join(chr(t) for t in prompts["long"]["code"][0])
    assert text in heldout_text(corpus, "code")
    assert make_prompts(REGIMES, 3, tokenizer=CharTokenizer(), corpus=corpus) == prompts  # seeded


def test_json_schema(greedy):
    results, out, _ = greedy
    saved = json.loads((out / "e2e.json").read_text())
    assert {"machine", "settings", "systems", "families", "cells", "created"} <= set(saved)
    assert [s["name"] for s in saved["systems"]] == EXPECTED_SYSTEMS
    assert all(s["weight_bytes"] > 0 for s in saved["systems"])
    bandit = next(s for s in saved["systems"] if s["name"] == "flashspec bandit")
    assert bandit["arms"] == ["tiny@2", "tiny@3", "ngram@2", "ngram@3"] and bandit["context"] == "domain"
    assert [(c["regime"], c["batch_size"]) for c in saved["cells"]] == [
        ("long", 1), ("long", 2), ("short", 1), ("short", 2)]
    for cell in saved["cells"]:
        batch = cell["batch_size"]
        new_tokens = REGIMES[cell["regime"]].new_tokens
        skipped = {s["system"] for s in cell["not_applicable"]}
        assert skipped == ({"hf-assisted tiny", "hf-lookup"} if batch > 1 else set())
        running = [n for n in EXPECTED_SYSTEMS if n not in skipped]
        groups = len(DOMAINS) * (PROMPTS_PER_DOMAIN // batch)
        assert len(cell["calls"]) == groups * len(running)
        for call in cell["calls"]:
            assert {"domain", "group", "prompts", "prompt_tokens", "system", "new_tokens", "seconds",
                    "tokens_per_second", "first_token_seconds", "accepted", "proposed", "peak_memory_bytes",
                    "step_seconds", "step_tokens", "step_accepted", "sequences"} <= set(call)
            assert len(call["sequences"]) == batch == len(call["prompts"])
            assert all(len(s) == new_tokens for s in call["sequences"])
            assert call["new_tokens"] == batch * new_tokens
            assert 0 < call["first_token_seconds"] <= call["seconds"]
            assert len(call["step_seconds"]) == len(call["step_tokens"]) == len(call["step_accepted"])
            assert call["peak_memory_bytes"] is None  # CPU: not measured
            if call["system"].startswith("flashspec") and batch == 1:
                # every token after the prefill's first is committed by a logged step
                assert sum(call["step_tokens"]) == new_tokens - 1
        rows = {(r["system"], r["domain"]): r for r in cell["summary"]}
        for name in running:
            for domain in [*DOMAINS, "all"]:
                r = rows[(name, domain)]
                t = r["tokens_per_second"]
                assert t["min"] <= t["q1"] <= t["median"] <= t["q3"] <= t["max"]
                assert r["step_ms_p50"] <= r["step_ms_p99"]
                assert r["first_token_ms_median"] > 0 and r["speedup_vs_hf"] > 0 and r["speedup_vs_flashspec"] > 0
        assert rows[("hf", "all")]["speedup_vs_hf"] == 1.0
        assert rows[("flashspec", "all")]["acceptance_rate"] is None
        assert rows[("flashspec", "all")]["accepted_per_step"] == 0
        fixed = rows[("flashspec tiny@2", "all")]
        assert 0 <= fixed["acceptance_rate"] <= 1
        p = fixed["predicted"]
        assert p["gamma"] == 2 and p["c"] == cell["forward_costs"]["drafters"]["tiny"]["c"] > 0
        assert p["speedup"] == pytest.approx(predicted_speedup(p["alpha"], 2, p["c"]))
        assert p["measured_over_predicted"] == pytest.approx(fixed["speedup_vs_flashspec"] / p["speedup"])
        seconds = cell["forward_costs"]["target_seconds"]
        assert p["verify_cost"] == pytest.approx(seconds["3"] / seconds["1"])
        a = p["alpha"]
        assert p["speedup_with_verify_cost"] == pytest.approx((1 + a + a * a) / (2 * p["c"] + p["verify_cost"]))
        assert set(cell["forward_costs"]["target_seconds"]) == {"1", "3", "4"}
        assert sum(rows[("flashspec bandit", "all")]["arm_steps"].values()) > 0


def test_greedy_outputs_are_identical_across_systems_in_float32(greedy):
    results, _, _ = greedy
    for cell in results["cells"]:
        check = cell["greedy"]
        assert check["reference"] == "flashspec"
        skipped = {s["system"] for s in cell["not_applicable"]}
        assert set(check["systems"]) == set(EXPECTED_SYSTEMS) - skipped - {"flashspec"}
        for name, g in check["systems"].items():
            assert g["differing"] == [], (cell["regime"], cell["batch_size"], name, g["differing"])
            assert g["identical"] == g["compared"] == len(DOMAINS) * PROMPTS_PER_DOMAIN


def test_bandit_logs_one_arm_per_step(greedy):
    results, _, _ = greedy
    arms = {s["name"]: set(s["arms"]) for s in results["systems"] if s["name"] in ("flashspec bandit", "flashspec auto")}
    assert arms["flashspec auto"] == arms["flashspec bandit"] | {"target@0"}
    for cell in results["cells"]:
        for call in cell["calls"]:
            if call["system"] in arms:
                assert len(call["arms"]) == len(call["step_seconds"]) and set(call["arms"]) <= arms[call["system"]]
                assert call["selector_seconds"] > 0
            else:
                assert "arms" not in call and "selector_seconds" not in call
        row = next(r for r in cell["summary"] if r["system"] == "flashspec bandit" and r["domain"] == "all")
        assert row["selection_us_per_step"] > 0 and 0 < row["selection_share_of_step"] < 1
    assert "flashspec bandit: choosing arms and learning took" in bench_e2e.summarize(results)


def test_markdown_and_plots_are_written(greedy):
    _, out, files = greedy
    assert sorted(f.name for f in files) == sorted(
        ["e2e.json", "e2e.md", "tokens_per_second.png", "accepted_lengths.png", "bandit_arms.png"])
    for name in ("tokens_per_second.png", "accepted_lengths.png", "bandit_arms.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "e2e.md").read_text()
    assert "## long (24–40 prompt tokens, 12 new tokens), batch 1" in md
    assert "## short (8 prompt tokens, 6 new tokens), batch 2" in md
    assert "| hf-assisted tiny | n/a |" in md and "| flashspec bandit |" in md
    assert "Greedy outputs identical to `flashspec`" in md and "Analytic prediction" in md


def test_sampling_run_reports_perplexity(corpus, models):
    target, drafter = models
    regimes = {"short": REGIMES["short"]}
    prompts = make_prompts(regimes, 1, tokenizer=CharTokenizer(), corpus=corpus)
    results = bench_e2e.run(target, {"tiny": drafter}, prompts, regimes, systems=["hf", "flashspec", "flashspec-fixed"],
                            gammas=[2], temperature=0.8, progress=False)
    cell = results["cells"][0]
    assert "greedy" not in cell
    for call in cell["calls"]:
        assert len(call["perplexity"]) == 1 and math.isfinite(call["perplexity"][0]) and call["perplexity"][0] >= 1
    for row in cell["summary"]:
        assert row["perplexity_median"] >= 1
    assert "perplexity" in bench_e2e.summarize(results)


def test_analytic_formula_on_known_values():
    assert predicted_speedup(0.0, 4, 0.0) == 1.0
    assert predicted_speedup(0.0, 2, 0.5) == pytest.approx(1 / 2)
    assert predicted_speedup(1.0, 4, 0.0) == 5.0
    assert predicted_speedup(1.0, 3, 0.25) == pytest.approx(4 / 1.75)
    assert predicted_speedup(0.5, 2, 0.0) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert predicted_speedup(0.999999, 4, 0.0) == pytest.approx(5.0, rel=1e-5)  # continuous at α = 1
    for alpha, gamma, c, message in ((1.5, 2, 0.1, "alpha"), (-0.1, 2, 0.1, "alpha"), (0.5, 0, 0.1, "gamma"),
                                     (0.5, 2, -1.0, "c must")):
        with pytest.raises(ValueError, match=message):
            predicted_speedup(alpha, gamma, c)


GOOD = dict(systems=["hf", "flashspec"], batch_sizes=[1], gammas=[2], prompts_per_domain=2, temperature=0.0,
            regimes=REGIMES, drafters=["tiny"])


@pytest.mark.parametrize("change, message", [
    (dict(systems=["hf", "vllm"]), "Unknown system 'vllm'"),
    (dict(systems=[]), "No systems"),
    (dict(batch_sizes=[0]), "batch sizes must be integers >= 1"),
    (dict(batch_sizes=[]), "batch sizes must be a non-empty"),
    (dict(gammas=[0]), "gammas"),
    (dict(prompts_per_domain=0), "prompts per domain must be"),
    (dict(batch_sizes=[4]), r"at least the largest batch size \(4\)"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(regimes={}), "No regimes"),
    (dict(regimes={"odd": Regime(9, 8, 4)}), "min_prompt <= max_prompt"),
    (dict(systems=["flashspec-bandit"], drafters=[]), "needs at least one drafter"),
    (dict(drafters=["a", "a"]), "distinct"),
    (dict(hf_prompts_per_domain=0), "hf prompts per domain must be"),
    (dict(hf_prompts_per_domain=1.5), "hf prompts per domain must be"),
])
def test_bad_options_are_clear_value_errors(change, message):
    check_options(**GOOD)
    with pytest.raises(ValueError, match=message):
        check_options(**{**GOOD, **change})


def test_run_checks_before_decoding(models, corpus):
    target, drafter = models
    prompts = make_prompts({"short": REGIMES["short"]}, 1, tokenizer=CharTokenizer(), corpus=corpus)
    with pytest.raises(ValueError, match="Unknown system"):
        bench_e2e.run(target, {"tiny": drafter}, prompts, {"short": REGIMES["short"]}, systems=["nope"], progress=False)
    with pytest.raises(ValueError, match="batch sizes"):
        bench_e2e.run(target, {"tiny": drafter}, prompts, {"short": REGIMES["short"]}, batch_sizes=[0], progress=False)
    with pytest.raises(ValueError, match="nothing to run"):
        bench_e2e.run(target, {"ngram": "ngram"}, prompts, {"short": REGIMES["short"]}, systems=["hf-assisted"],
                      progress=False)
    with pytest.raises(ValueError, match="Unknown regime 'medium'"):
        bench_e2e.parse_regimes("long,medium")


@pytest.mark.parametrize("args, message", [
    (["--systems", "hf,nope"], "Unknown system"),
    (["--batch-sizes", "0"], "batch sizes"),
    (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated integers"),
    (["--regimes", "medium"], "Unknown regime"),
    (["--gammas", "2,0"], "gammas"),
    (["--temperature", "-1"], "temperature"),
    (["--shaped", "--draft", "ngram"], "--shaped builds its own"),
    (["--hf-prompts-per-domain", "0"], "hf prompts per domain"),
    (["--auto-slacks", "0.01,x"], "--auto-slacks must be comma-separated numbers"),
    (["--auto-slacks", "default,0.01"], "name the default"),
    (["--auto-slacks", "-0.5"], "slack is how much slower"),
    (["--auto-selectors", "default,fixed"], "learning selector"),
    (["--auto-selectors", ","], "non-empty"),
])
def test_cli_checks_options_before_loading(args, message, capsys):
    assert main(["bench", "e2e", "--target", "/nonexistent", "--draft", "ngram", "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_end_to_end(models, corpus, tmp_path, capsys):
    """Saved tiny models and a character-level tokenizer through ``flashspec bench e2e``."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target, drafter = models
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "draft")
    tokenizer = Tokenizer(tok_models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?").save_pretrained(tmp_path / "target")
    out = tmp_path / "out"
    rc = main(["bench", "e2e", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
               "--draft", "ngram", "--draft", "store:code", "--corpus", str(corpus), "--prompts-per-domain", "1",
               "--regimes", "short",
               "--systems", "hf,flashspec,flashspec-fixed,flashspec-bandit", "--gammas", "2", "--device", "cpu",
               "--dtype", "float32", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads((out / "e2e.json").read_text())
    assert [s["name"] for s in saved["systems"]] == ["hf", "flashspec", "flashspec draft@2", "flashspec ngram@2",
                                                     "flashspec store-code@2", "flashspec bandit"]
    assert saved["systems"][4]["weight_bytes"] == saved["systems"][1]["weight_bytes"]  # no model of its own
    assert "store-code" in saved["cells"][0]["forward_costs"]["drafters"]
    assert saved["settings"]["target"] == str(tmp_path / "target")
    assert all(g["differing"] == [] for g in saved["cells"][0]["greedy"]["systems"].values())
    assert (out / "e2e.md").is_file() and (out / "bandit_arms.png").is_file()
    assert "| flashspec bandit |" in capsys.readouterr().out
    assert saved["families_without_systems"] == []


def test_a_family_without_systems_is_reported(models, corpus):
    target, _ = models
    regimes = {"short": REGIMES["short"]}
    prompts = make_prompts(regimes, 1, tokenizer=CharTokenizer(), corpus=corpus)
    results = bench_e2e.run(target, {"ngram": "ngram"}, prompts, regimes, systems=["flashspec", "hf-assisted"],
                            progress=False)
    assert results["families_without_systems"] == ["hf-assisted"]
    assert [s["name"] for s in results["systems"]] == ["flashspec"]
    assert "**none here**" in bench_e2e.summarize(results)


def test_transformers_systems_can_run_on_fewer_prompts(models, corpus):
    """``hf_prompts_per_domain`` limits the ``hf*`` systems to each domain's first batches;
    FlashSpec's systems still run every prompt, and paired ratios use the shared batches."""
    target, drafter = models
    regimes = {"short": REGIMES["short"]}
    prompts = make_prompts(regimes, 3, tokenizer=CharTokenizer(), corpus=corpus)
    results = bench_e2e.run(target, {"ngram": "ngram"}, prompts, regimes, systems=["hf", "hf-lookup", "flashspec",
                            "flashspec-fixed"], gammas=[2], hf_prompts_per_domain=2, progress=False)
    calls = results["cells"][0]["calls"]
    count = {name: sum(c["system"] == name for c in calls) for name in ("hf", "hf-lookup", "flashspec",
                                                                         "flashspec ngram@2")}
    assert count == {"hf": 6, "hf-lookup": 6, "flashspec": 9, "flashspec ngram@2": 9}
    assert {c["prompts"][0] for c in calls if c["system"] == "hf"} == {0, 1}
    assert results["settings"]["hf_prompts_per_domain"] == 2
    summary = {(r["system"], r["domain"]): r for r in results["cells"][0]["summary"]}
    assert summary[("hf", "all")]["speedup_vs_flashspec"] is not None
    assert results["cells"][0]["greedy"]["systems"]["hf"]["compared"] == 6
    assert "first 2 batches of each domain" in bench_e2e.summarize(results)


def test_cli_shaped_models_run_with_random_prompts(monkeypatch, tmp_path, capsys):
    """``--shaped`` (random-weight 8B/1B shapes on the GPU) through the CLI, with tiny stand-ins
    for the shapes: one "random" domain, the drafters llama3-1b and ngram, the note saying so."""
    from flashspec.bench import gpu as bench_gpu

    monkeypatch.setattr(bench_gpu, "shaped_model",
                        lambda name, device="cpu", dtype=torch.float32, seed=0: tiny_model("llama", seed=seed))
    out = tmp_path / "shaped"
    rc = main(["bench", "e2e", "--shaped", "--device", "cpu", "--dtype", "float32", "--regimes", "short",
               "--prompts-per-domain", "2", "--hf-prompts-per-domain", "1", "--systems", "hf,flashspec,flashspec-fixed",
               "--gammas", "2", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads((out / "e2e.json").read_text())
    assert [s["name"] for s in saved["systems"]] == ["hf", "flashspec", "flashspec llama3-1b@2", "flashspec ngram@2"]
    calls = saved["cells"][0]["calls"]
    assert {c["domain"] for c in calls} == {"random"}
    assert sum(c["system"] == "hf" for c in calls) == 1 and sum(c["system"] == "flashspec" for c in calls) == 2
    assert "acceptance is meaningless" in saved["settings"]["note"]
    assert saved["settings"]["target"] == "llama3-8b (shaped)"


def test_rewrite_report_recomputes_tables_from_raw_calls(greedy, tmp_path, capsys):
    """``--rewrite-report`` reads e2e.json, recomputes every summary from the raw calls (equal to
    the run's own) and rewrites the markdown and plots; a folder without e2e.json is a clear error."""
    results, out, _ = greedy
    folder = tmp_path / "copy"
    folder.mkdir()
    (folder / "e2e.json").write_text((out / "e2e.json").read_text())
    assert main(["bench", "e2e", "--rewrite-report", str(folder)]) == 0
    rewritten = json.loads((folder / "e2e.json").read_text())
    assert [c["summary"] for c in rewritten["cells"]] == json.loads(json.dumps([c["summary"] for c in results["cells"]]))
    assert (folder / "e2e.md").read_text() == (out / "e2e.md").read_text()
    assert (folder / "tokens_per_second.png").is_file()
    assert main(["bench", "e2e", "--rewrite-report", str(tmp_path / "empty")]) == 2
    assert "No e2e.json" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    for text in ("{not json", '{"systems": []}'):
        (broken / "e2e.json").write_text(text)
        assert main(["bench", "e2e", "--rewrite-report", str(broken)]) == 2
        assert "is not an e2e.json written by" in capsys.readouterr().err


def test_prediction_with_c_from_steps():
    """c = (arm's median step / target-only's − 1) / γ, then the formula with that c."""
    rows = [{"domain": "all", "system": "flashspec", "step_ms_p50": 2.0, "speedup_vs_flashspec": 1.0},
            {"domain": "all", "system": "a@4", "step_ms_p50": 6.0, "speedup_vs_flashspec": 1.5,
             "predicted": {"alpha": 0.5, "gamma": 4}}]
    bench_e2e._add_step_cost_predictions(rows)
    p = rows[1]["predicted"]
    assert p["c_from_steps"] == pytest.approx(0.5)
    assert p["speedup_c_from_steps"] == pytest.approx(predicted_speedup(0.5, 4, 0.5))
    assert p["measured_over_predicted_c_from_steps"] == pytest.approx(1.5 / predicted_speedup(0.5, 4, 0.5))


def test_bandit_warm_up_meets_every_switch_width(models, corpus, monkeypatch):
    """The bandit's untimed warm-up runs each model-drafter arm right after another drafter's
    step, so the catch-up width of a switch (SPEC §4: ModelDrafter.SWITCH_WINDOW) is compiled
    and captured for every γ before timing starts (on the H200 it otherwise cost 17-27 s inside
    a timed call)."""
    from flashspec.drafters import ModelDrafter

    target, drafter = models
    seen = set()
    propose = ModelDrafter.propose

    def spy(self, history, num_tokens, params, uniforms):
        if not self._seen.first:
            seen.add((self._window(history), num_tokens))
        return propose(self, history, num_tokens, params, uniforms)

    monkeypatch.setattr(ModelDrafter, "propose", spy)
    setup = bench_e2e.Setup(target, {"tiny": drafter, "ngram": "ngram"}, [2, 3], 0, False)
    (bandit,) = bench_e2e._flashspec_bandit(setup)
    prompt = make_prompts({"long": REGIMES["long"]}, 1, tokenizer=CharTokenizer(), corpus=corpus)["long"]["code"]
    bandit.warm(prompt, 12, 0.0, 0)
    assert {(ModelDrafter.SWITCH_WINDOW, 2), (ModelDrafter.SWITCH_WINDOW, 3)} <= seen
    assert bandit.engine.selection.selector.kind == bench_e2e.BANDIT_SELECTOR  # the bandit again after the warm-up


@pytest.mark.default_configuration
def test_the_auto_warm_up_measures_catch_ups_for_the_guard(models, corpus):
    """flashspec-auto's warm-up runs each arm of a drafter with a cache after gaps of target-only
    steps, so its guard starts the timed calls knowing what a catch-up costs (SPEC §8), and
    the selector starts afresh."""
    target, drafter = models
    setup = bench_e2e.Setup(target, {"tiny": drafter, "ngram": "ngram"}, [2], 0, False)
    (auto,) = bench_e2e._flashspec_auto(setup)
    prompt = make_prompts({"long": REGIMES["long"]}, 1, tokenizer=CharTokenizer(), corpus=corpus)["long"]["code"]
    auto.warm(prompt, 40, 0.0, 0)
    engine = auto.engine
    widths = {b for d, b in engine.catch_up_costs if d == 0}
    assert bucket(len(prompt[0]) + 1) in widths and 32 in widths  # the prompt; a 20-step gap
    assert all(d == 0 for d, _ in engine.catch_up_costs)  # n-gram keeps no cache
    assert set(engine.arm_costs) == {0, 1} and engine.slack == DEFAULT_SLACK
    assert engine.selection.selector.kind == "thompson"


def test_scripted_selector_plays_its_script_and_rejects_bad_arms():
    selector = ScriptedSelector(3, [2, 0])
    assert [selector.select() for _ in range(5)] == [2, 0, 2, 0, 2]
    with pytest.raises(ValueError, match="arms in"):
        ScriptedSelector(2, [2])
    with pytest.raises(ValueError, match="arms in"):
        ScriptedSelector(2, [])


def test_the_default_configuration_is_checked_call_by_call_against_target_only(corpus, models):
    """flashspec-auto (SPEC.md §8): each call's ratio to FlashSpec target-only on the same batch, the
    lowest and those below 0.97×, and per domain the median against the best fixed arm's."""
    target, drafter = models
    regimes = {"long": REGIMES["long"]}
    prompts = make_prompts(regimes, 2, tokenizer=CharTokenizer(), corpus=corpus)
    results = bench_e2e.run(target, {"tiny": drafter, "ngram": "ngram"}, prompts, regimes, gammas=[2],
                            systems=["flashspec", "flashspec-fixed", "flashspec-auto"], progress=False)
    system = next(s for s in results["systems"] if s["name"] == "flashspec auto")
    assert system["arms"] == ["tiny@2", "ngram@2", "target@0"] and system["slack"] == DEFAULT_SLACK
    cell = results["cells"][0]
    assert all(g["differing"] == [] for g in cell["greedy"]["systems"].values())
    report = cell["never_slower"]["systems"]["flashspec auto"]
    base = {(c["domain"], c["group"]): c["tokens_per_second"] for c in cell["calls"] if c["system"] == "flashspec"}
    ratios = [c["tokens_per_second"] / base[(c["domain"], c["group"])] for c in cell["calls"]
              if c["system"] == "flashspec auto"]
    assert report["calls"] == len(ratios) == len(DOMAINS) * 2
    assert report["lowest"]["ratio"] == pytest.approx(min(ratios))
    assert len(report["below_floor"]) == sum(r < 0.97 for r in ratios)
    for domain, d in report["domains"].items():
        assert d["best_fixed"] in ("flashspec tiny@2", "flashspec ngram@2")
        assert d["of_best_fixed"] == pytest.approx(d["median_ratio"] / d["best_fixed_ratio"])
    assert "bandit" not in cell["never_slower"]["systems"]
    md = bench_e2e.summarize(results)
    assert "Never slower:" in md and "| flashspec auto | 6 |" in md


def test_the_default_configuration_runs_at_several_slacks_side_by_side(corpus, models):
    """``auto_slacks``: one flashspec-auto system per δ (None: the engine's default), each with its
    own engine at that δ and its own never-slower report; bad lists are refused before loading."""
    target, drafter = models
    regimes = {"long": REGIMES["long"]}
    prompts = make_prompts(regimes, 1, tokenizer=CharTokenizer(), corpus=corpus)
    results = bench_e2e.run(target, {"ngram": "ngram"}, prompts, regimes, gammas=[2], auto_slacks=[None, 0.5, 0],
                            systems=["flashspec", "flashspec-auto"], progress=False)
    slacks = {s["name"]: s["slack"] for s in results["systems"] if s["family"] == "flashspec-auto"}
    assert slacks == {"flashspec auto": DEFAULT_SLACK, "flashspec auto δ=0.5": 0.5, "flashspec auto δ=0": 0.0}
    assert set(results["cells"][0]["never_slower"]["systems"]) == set(slacks)
    assert bench_e2e.parse_slacks("default, 0.02,") == [None, 0.02]
    for bad, words in (([], "non-empty"), ([0.02, 0.02], "differ"), ([None, DEFAULT_SLACK], "twice"),
                       ([-1.0], "slack is how much slower"), ([float("nan")], "slack is how much slower")):
        with pytest.raises(ValueError, match=words):
            bench_e2e.check_options(systems=["flashspec-auto"], batch_sizes=[1], gammas=[2], prompts_per_domain=1,
                                    temperature=0.0, regimes=regimes, auto_slacks=bad)
    with pytest.raises(ValueError, match="--auto-slacks must be"):
        bench_e2e.parse_slacks("0.01,lots")


def test_the_default_configuration_runs_with_several_selectors_side_by_side(corpus, models):
    """``auto_selectors``: one flashspec-auto system per (selector, δ), each its own engine with
    the target-only arm and the guard, the named selector behind it; bad lists are refused
    before loading."""
    target, drafter = models
    regimes = {"long": REGIMES["long"]}
    prompts = make_prompts(regimes, 1, tokenizer=CharTokenizer(), corpus=corpus)
    results = bench_e2e.run(target, {"ngram": "ngram"}, prompts, regimes, gammas=[2], auto_selectors=[None, "request"],
                            auto_slacks=[None, 0.5], systems=["flashspec", "flashspec-auto"], progress=False)
    auto = {s["name"]: (s["selector"], s["slack"], s["arms"][-1]) for s in results["systems"]
            if s["family"] == "flashspec-auto"}
    assert auto == {"flashspec auto": ("auto", DEFAULT_SLACK, "target@0"),
                    "flashspec auto δ=0.5": ("auto", 0.5, "target@0"),
                    "flashspec auto [request]": ("request", DEFAULT_SLACK, "target@0"),
                    "flashspec auto [request] δ=0.5": ("request", 0.5, "target@0")}
    assert set(results["cells"][0]["never_slower"]["systems"]) == set(auto)
    assert bench_e2e.parse_selectors("default, request,") == [None, "request"]
    for bad, words in (([], "non-empty"), (["request", "request"], "differ"), (["fixed"], "learning selector"),
                       (["bogus"], "learning selector")):
        with pytest.raises(ValueError, match=words):
            bench_e2e.check_options(systems=["flashspec-auto"], batch_sizes=[1], gammas=[2], prompts_per_domain=1,
                                    temperature=0.0, regimes=regimes, auto_selectors=bad)


def test_bit_exact_systems_are_checked_against_bit_exact_target_only(corpus):
    """``--systems flashspec,flashspec-exact,flashspec-fixed-exact`` (SPEC.md §14; on a CPU through
    Triton's interpreter): each bit-exact fixed arm's greedy outputs are compared with the
    bit-exact target-only system's, and equal them in bf16; bit-exact target-only is compared with
    the default kernels' target-only; not run unless named."""
    pytest.importorskip("triton")
    assert "flashspec-exact" not in bench_e2e.DEFAULT_FAMILIES
    target = tiny_model("llama", seed=0).to(torch.bfloat16)
    drafter = noisy_copy(tiny_model("llama", seed=0), 0.05, seed=1).to(torch.bfloat16)
    regimes = {"short": Regime(8, 8, 6)}
    prompts = make_prompts(regimes, 2, tokenizer=CharTokenizer(), corpus=corpus)
    results = bench_e2e.run(target, {"tiny": drafter, "ngram": "ngram"}, prompts, regimes, batch_sizes=[2],
                            gammas=[3], systems=["flashspec", "flashspec-exact", "flashspec-fixed-exact"],
                            progress=False)
    check = results["cells"][0]["greedy"]
    assert check["exact_reference"] == "flashspec exact"
    assert check["systems"]["flashspec exact"]["reference"] == "flashspec"
    for name in ("flashspec exact tiny@3", "flashspec exact ngram@3"):
        g = check["systems"][name]
        assert g["reference"] == "flashspec exact" and g["differing"] == [] and g["compared"] == 2 * len(DOMAINS)
    assert "(against `flashspec exact`)" in bench_e2e.summarize(results)
