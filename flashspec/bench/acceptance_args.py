"""``flashspec bench acceptance``'s command line: its options and the command, which checks
them all before loading anything (:mod:`flashspec.bench.acceptance` measures). Kept apart from
the benchmark so that building the parser imports nothing heavy."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .workload_args import (
    acceptance_styles,
    add_workload_arguments,
    comma_gammas,
    comma_list,
    parse_expand,
    workload_options,
)

__all__ = ["add_parser", "command", "parse_expand"]


def add_parser(sub: Any) -> None:
    """Add ``flashspec bench acceptance`` to the ``bench`` sub-parsers."""
    from ..models.loading import DTYPES

    p = sub.add_parser("acceptance", help="accepted drafts and tokens per step by drafter, γ, domain and "
                                          "prompt style (one fixed arm each)")
    p.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    p.add_argument("--draft", action="append", default=None,
                   help="a drafter (repeatable): a folder / hub id / .gguf model, 'ngram', 'early-exit:N', "
                        "'feature:DIR', 'shallow:DIR' or 'store:DOMAIN'; default: the demo's 0.5B and ngram")
    p.add_argument("--tokenizer", default=None, help="default: the target's")
    p.add_argument("--corpus", default="../shared/corpus")
    add_workload_arguments(p, counts="--prompts-per-domain counts per category then (MT-bench: questions).", eos=True)
    p.add_argument("--gammas", default="2,4,8", help="comma-separated draft lengths")
    p.add_argument("--acceptance", default="token",
                   help="comma-separated acceptance rules, each measured beside the others: token (each draft "
                        "tested alone), block (the drafted block verified jointly, SPEC.md §2)")
    p.add_argument("--block-size", type=int, default=None,
                   help="every arm drafts, scores and verifies its drafts in chunks of this many (SPEC.md §2, "
                        "chunked drafting); default: in one piece")
    p.add_argument("--tree", action="store_true",
                   help="also, per γ, every drafter's chain in one draft tree per step (generate_tree, SPEC.md §7)")
    p.add_argument("--expand", action="append", default=None, metavar="NAME=TOPK,NODES",
                   help="with --tree: drafter NAME's part of each tree is an EAGLE-2 top-k expansion (TOPK children "
                        "per node, NODES kept) instead of its chain (feature and EAGLE-3 drafters; SPEC.md §7)")
    p.add_argument("--styles", default=None,
                   help="comma-separated: text (held-out continuations of --prompt-tokens), chat (chat-formatted "
                        "requests around --snippet-tokens snippets); default text,chat (chat for mt-bench, code-edit "
                        "and extraction)")
    p.add_argument("--prompts-per-domain", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128, help="text prompts' length")
    p.add_argument("--snippet-tokens", type=int, default=192, help="chat requests' corpus snippet length")
    p.add_argument("--batch", type=int, default=4, help="prompts decoded together")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--compile", action="store_true", help="torch.compile the decode forwards (GPU)")
    p.add_argument("--no-warm-up", action="store_true", help="skip the untimed call per engine and style")
    p.add_argument("--out", default="bench-results/acceptance",
                   help="folder for acceptance.json, acceptance.md and acceptance.png")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """Accepted drafts per step for every drafter × γ × rule × domain × prompt style."""
    from .acceptance import check_options, load_and_run, summarize
    from .e2e import drafter_name
    from ..demo import DEMO_DRAFT, DEMO_TARGET, fetch_demo_model

    gammas = comma_gammas(args.gammas)
    styles = comma_list(acceptance_styles(args))
    rules = comma_list(args.acceptance)
    options = {"batch": args.batch, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
               "block_size": args.block_size, "tree": args.tree, "expand": parse_expand(args.expand)}
    drafts = args.draft or ["ngram"]  # checked with a stand-in before the demo download
    check_options(drafters=[drafter_name(d) for d in drafts], gammas=gammas, styles=styles,
                  prompts_per_domain=args.prompts_per_domain, prompt_tokens=args.prompt_tokens,
                  snippet_tokens=args.snippet_tokens, rules=rules, **options)
    drafts = args.draft or [fetch_demo_model(DEMO_DRAFT), "ngram"]
    results = load_and_run(
        Path(args.out), target=args.target or fetch_demo_model(DEMO_TARGET), drafts=drafts, tokenizer=args.tokenizer,
        corpus=Path(args.corpus), device=args.device, dtype=args.dtype, styles=styles, gammas=gammas,
        prompts_per_domain=args.prompts_per_domain, prompt_tokens=args.prompt_tokens,
        snippet_tokens=args.snippet_tokens, seed=args.seed, compile=args.compile, rules=rules,
        warm_up=not args.no_warm_up, progress=not args.no_progress, **workload_options(args), **options,
    )
    print(summarize(results))

