"""The command line reports bad input as an error message, not a traceback."""

from __future__ import annotations

import pytest

from flashspec.cli import main


def test_generate_with_a_missing_model_is_a_clean_error(capsys):
    assert main(["generate", "--target", "/nonexistent/model.gguf", "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--target", "/nonexistent/model.gguf", "--prompt", "x", "--compare"],
                                     ["demo"]])
@pytest.mark.parametrize("repeats", ["0", "-2"])
def test_bad_repeats_are_a_clean_error(command, repeats, capsys):
    """Checked before any download or model loading."""
    assert main([*command, "--repeats", repeats]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_repeats_without_a_comparison_is_a_clean_error(capsys):
    assert main(["generate", "--target", "/nonexistent/model.gguf", "--prompt", "x", "--repeats", "2"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_bad_temperatures_list_is_a_clean_error(capsys):
    assert main(["bench", "core", "--target", "/nonexistent.gguf", "--draft", "ngram", "--temperatures", "a,b"]) == 2
    assert "--temperatures" in capsys.readouterr().err


def test_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit):
        main(["fly"])


def test_bench_bandit_writes_json_and_plot(tmp_path, capsys):
    rc = main(["bench", "bandit", "--steps", "200", "--seeds", "2", "--json", str(tmp_path / "b.json"),
               "--plot", str(tmp_path / "b.png"), "--no-progress"])
    assert rc == 0
    assert (tmp_path / "b.json").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0
    assert "ucb1" in capsys.readouterr().out


def test_bench_bandit_bad_arms(capsys):
    assert main(["bench", "bandit", "--arms", "0", "--no-progress", "--json", "", "--plot", ""]) == 2
    assert "arms" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [("--gammas", "2,x", "gammas"), ("--gammas", "0", "gammas"),
                                                   ("--selectors", "nope", "bandit")])
def test_bench_select_checks_options_before_loading(flag, value, message, capsys):
    assert main(["bench", "select", "--target", "/nonexistent", flag, value]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"), (["--temperature", "1e-9"], "temperature"),
    (["--top-p", "0"], "top_p"), (["--top-k", "-2"], "top_k"), (["--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["--max-new-tokens", "-5"], "--max-new-tokens"),
])
def test_sampling_flags_are_checked_before_any_model_loads(flags, message, capsys):
    """The target does not exist: an error about the flag (not the path) shows that the flags are
    checked first; before, --temperature -1 or nan silently decoded greedily."""
    assert main(["generate", "--target", "/nonexistent/model.gguf", "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "does not exist" not in err
