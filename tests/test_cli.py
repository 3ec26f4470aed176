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
