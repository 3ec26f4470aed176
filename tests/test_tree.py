"""The tree speaks of the product, not of how it was made: no tracked file names development
runs, tickets or the tooling that reached a GPU (CHANGELOG.md keeps what was tried, as facts)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Built from pieces so that this file does not match itself.
HISTORY = re.compile("|".join([r"sessions? [0-9]+", r"issues? [0-9]+", "/tmp/" + "pieces", r"\$" + "OUT\\b",
                               "docs/" + "lab"]), re.IGNORECASE)


def _tracked() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: which files are tracked is unknown")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [ROOT / n for n in names.decode().split("\0") if n]


def _hits(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []  # binary files (weights, compressed results) hold no prose
    return [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}" for n, line in enumerate(text.splitlines(), 1)
            if HISTORY.search(line)]


def test_no_tracked_file_speaks_of_development_history():
    hits = [hit for path in _tracked() if path.is_file() for hit in _hits(path)]
    assert not hits, "\n".join(hits[:50])


@pytest.mark.parametrize("line", ["as measured in sess" + "ion 28", "Iss" + "ue 23: the guard", "cp x /tmp/" + "pieces/",
                                  "tar -cf $" + "OUT/res.tar", "see docs/" + "lab/NOTES.md"])
def test_the_patterns_catch_history(line, tmp_path):
    assert HISTORY.search(line)


@pytest.mark.parametrize("line", ["issues a 400", "an OUTPUT folder", "the 5 % held out", "session()"])
def test_the_patterns_leave_the_product_alone(line):
    assert not HISTORY.search(line)
