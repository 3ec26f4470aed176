"""The command line reports bad input as an error message, not a traceback."""

from __future__ import annotations

import pytest

from flashspec.cli import main


def test_generate_with_a_missing_model_is_a_clean_error(capsys):
    assert main(["generate", "--target", "/nonexistent/model.gguf", "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


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
