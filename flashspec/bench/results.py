"""How the benchmarks write their results: one JSON writer, one markdown writer, one plotting helper.

Every ``flashspec bench ...`` command writes its raw results as JSON (``indent=1``) and its
tables as markdown beside them through :func:`write_results`; figures are drawn with
:func:`pyplot` (matplotlib, imported on first use: ``pip install "flashspec[bench]"``) and saved
with :func:`save_figure`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["pyplot", "save_figure", "write_results"]


def write_results(path: str | Path, results: Any = None, markdown: str | None = None) -> list[Path]:
    """Write ``results`` as JSON to ``path`` and ``markdown`` (a final newline added) to ``path``
    with the suffix ``.md``; either may be left out. Folders are made as needed. Returns the
    files written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if results is not None:
        path.write_text(json.dumps(results, indent=1))
        written.append(path)
    if markdown is not None:
        md = path.with_suffix(".md")
        md.write_text(markdown + "\n")
        written.append(md)
    return written


def pyplot(alternative: str = "") -> Any:
    """``matplotlib.pyplot`` with the non-interactive Agg backend; a ValueError saying how to
    install it when matplotlib is missing (``alternative``: another way out, for the message)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(f'Plots need matplotlib: pip install "flashspec[bench]"{alternative}.') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, **options: Any) -> Path:
    """Save ``fig`` to ``path`` (folders made as needed; ``options`` go to ``savefig``) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, **options)
    plt.close(fig)
    return path
