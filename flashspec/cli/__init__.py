"""The ``flashspec`` command: one function per command (``generate``, ``demo``, ``train-drafter``,
``calibrate``, ``bench ...``).

Each sub-parser names its function with ``set_defaults(run=...)``; :func:`main` calls it and
turns a ``ValueError`` into a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from .bench.cli import add_parsers as add_bench_parsers
from .demo import DEMO_PROMPT, DRAFTER_KINDS
from .distill import add_parser as add_distill_parser
from .models import DTYPES
from .select.guard import DEFAULT_SLACK
from .serve import add_parser as add_serve_parser

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except ValueError as error:
        print(f"flashspec: error: {error}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashspec", description="Exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt speculatively")
    gen.add_argument("--target", required=True, help="folder, hub id or .gguf file")
    gen.add_argument(
        "--draft", action="append", default=[], help="drafter: folder, hub id, .gguf file or 'ngram' (repeatable)"
    )
    gen.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the target's)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--compare", action="store_true", help="also run target-only decoding and print the speedup")
    _add_sampling(gen)
    gen.set_defaults(run=generate)

    demo_parser = sub.add_parser("demo", help="Qwen2.5-Coder 1.5B with a drafter trained from it, on a code prompt")
    demo_parser.add_argument("--prompt", default=DEMO_PROMPT)
    demo_parser.add_argument("--drafter", default="feature", choices=list(DRAFTER_KINDS),
                             help="feature (default): the feature drafter trained from the target, shipped in "
                                  "the package; model: the 0.5B Qwen2.5-Coder model")
    _add_sampling(demo_parser)
    demo_parser.set_defaults(run=demo)

    train = sub.add_parser("train-drafter", help="train a drafter made from the target (SPEC.md §11)")
    train.add_argument("--target", required=True, help="folder, hub id or .gguf file")
    train.add_argument("--kind", default="feature", choices=["feature", "shallow"],
                       help="feature: fc[target feature; next embedding] -> decoder layers -> the target's head; "
                            "shallow: the target's first layers -> adapter layers -> MLP -> the target's head")
    train.add_argument("--data", action="append", required=True,
                       help="a text file (.txt or .xz; repeatable): its first 90 %% trains, the next 5 %% "
                            "estimates acceptance, the last 5 %% is never read")
    train.add_argument("--out", required=True, help="folder for drafter.safetensors and drafter.json")
    train.add_argument("--tokenizer", default=None, help="default: the target's")
    train.add_argument("--layers", type=int, default=None,
                       help="decoder layers of the drafter's own part (default: 1 feature, 2 shallow adapters)")
    train.add_argument("--shared-layers", type=int, default=None,
                       help="shallow: the target's layers it shares (default: a quarter of them)")
    train.add_argument("--head-width", type=int, default=None, help="shallow: the MLP's width (default: hidden size)")
    train.add_argument("--width", type=int, default=None, help="feature: its layer's MLP width (default: the target's)")
    train.add_argument("--heads", type=int, default=None, help="feature: its layer's query heads (default: the target's)")
    train.add_argument("--draft-vocab", type=int, default=None,
                       help="feature: restrict its head to the N most frequent tokens of the data (default: all)")
    train.add_argument("--base", default=None,
                       help="a trained drafter folder to start from (e.g. a general one, for a per-domain drafter)")
    train.add_argument("--rank", type=int, default=None,
                       help="with --base: train and save only a low-rank delta of this rank over it")
    train.add_argument("--storage", default="int8", choices=["int8", "same"],
                       help="int8 (default): matrices as int8 rows with a scale each; same: the training dtype")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--batch", type=int, default=8, help="sequences per step")
    train.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    train.add_argument("--lr-layers", type=float, default=5e-5)
    train.add_argument("--lr-head", type=float, default=1e-4)
    train.add_argument("--hard-labels", action="store_true", help="cross-entropy on the next token, not the target's law")
    train.add_argument("--estimate-every", type=int, default=50, help="steps between acceptance estimates")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--unroll", type=int, default=3,
                       help="feature: passes per step, each fed the previous pass's predicted features (1: none)")
    train.add_argument("--feature-weight", type=float, default=1.0,
                       help="feature: weight of a smooth-L1 loss between predicted and true features (EAGLE-1)")
    train.add_argument("--max-minutes", type=float, default=None, help="stop training after this long (default: no limit)")
    train.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    train.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    train.set_defaults(run=train_drafter)

    cal = sub.add_parser("calibrate", help="time target (and drafter) forwards by width here; predict speedups")
    cal.add_argument("--target", required=True, help="folder, hub id or .gguf file")
    cal.add_argument("--draft", default=None, help="a drafter model: folder, hub id or .gguf file")
    cal.add_argument("--max-gamma", type=int, default=8, help="time forwards of 1 to this + 1 tokens (default 8)")
    cal.add_argument("--context", type=int, default=None,
                     help="cached positions before the timed tokens (default 256, half the window if less)")
    cal.add_argument("--no-cache", action="store_true", help="time again even when a cached curve matches")
    cal.add_argument("--no-progress", action="store_true")
    cal.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    cal.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    cal.set_defaults(run=calibrate)

    add_bench_parsers(sub)
    add_distill_parser(sub)
    add_serve_parser(sub)
    return parser


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 turns top-k off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 turns top-p off")
    p.add_argument("--num-draft-tokens", "--gamma", type=int, default=None,
                   help="tokens drafted per step (default: chosen per drafter by timing its steps here)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: bfloat16 on CUDA; on a CPU the faster of float32 and bfloat16 here (timed once)")
    p.add_argument("--no-calibration-cache", action="store_true",
                   help="time forwards and steps again even when cached timings match")
    p.add_argument("--bit-exact", action="store_true",
                   help="bit-exact mode: greedy output equal to target-only output token for token in bfloat16 "
                        "too (SPEC.md §14; a CUDA GPU, Llama/Qwen2/Qwen3/Mistral targets)")
    p.add_argument("--repeats", type=int, default=None,
                   help="with a comparison: alternating speculative / target-only pairs; the speedup is their "
                        "median ratio (default 3: one pair is too noisy on a shared machine)")


# ----------------------------------------------------------------------------- commands
def generate(args: argparse.Namespace) -> None:
    """Complete ``--prompt`` speculatively; with ``--compare`` also target-only, and the speedup."""
    _sampling_options(args)  # checked before minutes of model loading
    engine, baseline = _load_pair(args.target, args.draft, args.tokenizer, args)
    _complete(engine, baseline if args.compare else None, args.prompt, args)


def demo(args: argparse.Namespace) -> None:
    """The demo pair on a code prompt, speculative beside target-only."""
    from .demo import demo_pair

    _sampling_options(args)  # checked before the download and minutes of model loading
    target, draft = demo_pair(args.drafter)
    engine, baseline = _load_pair(target, [draft], None, args)
    _complete(engine, baseline, args.prompt, args)


def train_drafter(args: argparse.Namespace) -> None:
    """Train a drafter made from ``--target`` on ``--data`` and save it to ``--out``."""
    import json

    from .engine import SpeculativeEngine
    from .train import (TrainOptions, continued_record, estimate_acceptance, load_head, read_text, save_drafter,
                        token_chunks, train_head)

    layers = args.layers if args.layers is not None else (1 if args.kind == "feature" else 2)
    options = TrainOptions(layers=layers, shared_layers=args.shared_layers, head_width=args.head_width,
                           width=args.width, heads=args.heads, draft_vocab=args.draft_vocab, rank=args.rank,
                           unroll=args.unroll, feature_weight=args.feature_weight,
                           steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                           lr_layers=args.lr_layers, lr_head=args.lr_head, hard_labels=args.hard_labels,
                           seed=args.seed, estimate_every=args.estimate_every,
                           max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)  # checked first
    if args.rank is not None and args.base is None:
        raise ValueError("--rank trains a low-rank delta over a base drafter: give --base DIR too.")
    train_texts = [read_text(path, "train") for path in args.data]
    estimate_texts = [read_text(path, "estimate") for path in args.data]
    engine = SpeculativeEngine(args.target, [], tokenizer=args.tokenizer, device=args.device,
                               dtype=DTYPES[args.dtype] if args.dtype else None)
    if engine.tokenizer is None:
        raise ValueError("Training reads text: give --tokenizer (none could be loaded with the target).")
    base = load_head(args.base, engine.target, args.kind) if args.base else None
    from .demo import cache_dir

    tokens = cache_dir() / "tokens"  # each data file tokenized once, for every drafter trained on it
    chunks = token_chunks(train_texts, engine.tokenizer, options.seq_len, tokens)
    estimate = token_chunks(estimate_texts, engine.tokenizer, options.seq_len, tokens)[: 4 * options.batch]
    print(f"training on {chunks.numel():,} tokens ({len(chunks)} sequences of {options.seq_len}); "
          f"acceptance estimated on {estimate.numel():,}")
    eos = engine.target.generation_config.eos_token_id
    always = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    head, log = train_head(args.kind, engine.target, chunks, options, estimate=estimate, base=base, always=always)
    delta = args.rank is not None
    if args.base and not delta:  # the whole drafter trained further: a new full checkpoint, its history kept
        log["before"] = continued_record(args.base)
    out = save_drafter(head, engine.target, args.out, log, storage=args.storage, base=args.base if delta else None)
    saved = estimate_acceptance(load_head(out, engine.target, args.kind), engine.target, estimate, options.batch)
    record = json.loads((out / "drafter.json").read_text())
    record["training"]["alpha1_saved"] = saved[0]  # the checkpoint as saved (int8 rows, merged deltas)
    record["training"]["alpha_saved"] = saved
    (out / "drafter.json").write_text(json.dumps(record, indent=1) + "\n")
    size = (out / "drafter.safetensors").stat().st_size
    last = "/".join(f"{a:.3f}" for a in log["estimates"][-1]["alpha"]) if log["estimates"] else "?"
    print(f"saved {out} ({size / 1e6:.1f} MB) after {log['seconds']:.0f} s, {log['tokens']:,} tokens; "
          f"final loss {log['loss'][-1]:.3f}, α by draft depth {last} (as saved: {'/'.join(f'{a:.3f}' for a in saved)}); "
          f"use it as --draft {args.kind}:{out}")


CALIBRATION_ALPHAS = (0.3, 0.5, 0.7, 0.9)


def calibrate(args: argparse.Namespace) -> None:
    """Time one forward of ``--target`` (and ``--draft``) at each width 1 … ``--max-gamma`` + 1
    here (or read the cached curve), print the costs and the predicted speedup of each γ at a
    few acceptance rates (SPEC.md, "Calibration")."""
    from .calibrate import measure, predict_speedup
    from .drafters import ModelDrafter
    from .engine import SpeculativeEngine
    from .request import MAX_DRAFT_TOKENS

    if not 0 <= args.max_gamma <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--max-gamma must be from 0 to {MAX_DRAFT_TOKENS}; got {args.max_gamma}.")
    if args.context is not None and args.context < 0:
        raise ValueError(f"--context must be >= 0; got {args.context}.")
    if args.draft is not None and (args.draft.strip().lower() == "ngram" or args.draft.split(":", 1)[0] in
                                   ("early-exit", "feature", "shallow")):
        raise ValueError(f"calibrate times drafter models (a folder, hub id or .gguf file); {args.draft!r} is not "
                         "one: n-gram drafters and drafters made from the target have no forward of their own to time; "
                         "`flashspec generate` times their decode steps (SPEC.md §13).")
    engine = SpeculativeEngine(args.target, [args.draft] if args.draft else [], device=args.device,
                               dtype=DTYPES[args.dtype] if args.dtype else None)
    width = args.max_gamma + 1
    options = dict(context=args.context, use_cache=not args.no_cache, progress=not args.no_progress)
    target, target_file = measure(engine._target_lm, width, label="target", **options)
    drafter = None
    if engine.drafters:
        model_drafter = engine.drafters[0]
        if not isinstance(model_drafter, ModelDrafter):  # (checked above by name; a loaded object may differ)
            raise ValueError(f"calibrate times drafter models; {args.draft!r} is a {type(model_drafter).__name__}.")
        drafter, drafter_file = measure(model_drafter._lm, width, label="drafter", **options)
    print(f"target  {target.model}: {target.dtype} on {target.device}, after {target.context} cached "
          f"positions ({target.method})\n        cache file {target_file}")
    if drafter is not None:
        print(f"drafter {drafter.model}: {drafter.dtype}\n        cache file {drafter_file}")
    print()
    print(f"{'width':>5}  {'target ms':>10}" + (f"  {'drafter ms':>10}" if drafter is not None else ""))
    for w in range(1, width + 1):
        print(f"{w:>5}  {1e3 * target.at(w):>10.3f}" + (f"  {1e3 * drafter.at(w):>10.3f}" if drafter else ""))
    print()
    if drafter is None:
        print("predicted speedup over the target alone with a drafter that costs nothing (an upper bound):")
    else:
        print(f"predicted speedup over the target alone (drafter {1e3 * drafter.at(1):.3f} ms per drafted token):")
    cost = drafter if drafter is not None else 0.0
    print(f"{'γ':>5}  " + "  ".join(f"{'α=' + str(a):>7}" for a in CALIBRATION_ALPHAS))
    for g in range(width):
        print(f"{g:>5}  " + "  ".join(f"{predict_speedup(target, cost, a, g):>7.2f}" for a in CALIBRATION_ALPHAS))
    print("(γ = 0 is the target alone; below 1.00 drafting loses)")


# ----------------------------------------------------------------------------- helpers
def _explain_speedup(engine: Any, stats: Any, speedup: float) -> None:
    """Which arms ran, what the calibration predicted for them at the acceptance measured, and
    plainly when drafting did not pay (issue 23)."""
    choice = engine.choice
    if not engine.drafters:
        print("no drafter can pay on this machine (see the table above): both runs decoded with the target alone, "
              "so any difference is timing noise")
        return
    used = {label: per.steps for label, per in stats.per_arm.items() if per.steps}
    steps = sum(used.values()) or 1
    print("steps by arm: " + ", ".join(f"{label} {n / steps:.0%}" for label, n in
                                        sorted(used.items(), key=lambda x: -x[1])))
    drafting = [(label, n) for label, n in used.items() if label != "target@0"]
    if choice is not None and drafting and stats.proposed and choice.step_seconds:
        label = max(drafting, key=lambda x: x[1])[0]
        name, gamma = label.rsplit("@", 1)
        if name in choice.step_seconds and int(gamma) <= len(choice.step_seconds[name]):
            predicted = choice.speedup(name, int(gamma), stats.acceptance_rate)
            print(f"predicted for {label} at the acceptance measured ({stats.acceptance_rate:.2f}): "
                  f"{predicted:.2f}×; measured {speedup:.2f}×")
    if stats.guard_refused:
        print(f"the never-slower guard ran the target alone instead of a drafter on {stats.guard_refused} of "
              f"{stats.steps} steps")
    if speedup < 1.0:
        print(f"drafting did not pay here: the never-slower guard keeps the speculative decode steps within "
              f"{DEFAULT_SLACK:.1%} (plus one step) of the target-only steps it measured in the same run; it cannot "
              "see the machine's speed change between two runs (the pairs' spread above)")



def _load_pair(target: str, drafts: list[str], tokenizer: str | None, args: argparse.Namespace) -> tuple[Any, Any]:
    """The speculative engine, configured by calibration unless ``--dtype`` / ``--gamma`` say
    otherwise (SPEC.md §13), and a target-only engine sharing its target. Prints the choice."""
    from .engine import SpeculativeEngine

    gamma = args.num_draft_tokens
    engine = SpeculativeEngine.calibrated(target, drafts, tokenizer=tokenizer, device=args.device,
                                          dtype=DTYPES[args.dtype] if args.dtype else None,
                                          gammas=None if gamma is None else [gamma],
                                          use_cache=not args.no_calibration_cache, bit_exact=args.bit_exact)
    print(engine.choice.explain())
    print()
    baseline = SpeculativeEngine(engine.target, [], tokenizer=engine.tokenizer, bit_exact=args.bit_exact)
    return engine, baseline


def _sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """``generate``'s sampling keywords from the flags (``--temperature 0``: greedy), checked."""
    import math

    from .request import MAX_DRAFT_TOKENS
    from .sampling import SamplingParams

    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 means greedy); got {args.temperature}.")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0; got {args.max_new_tokens}.")
    if args.repeats is not None and not getattr(args, "compare", True):
        raise ValueError("--repeats sets how many speculative / target-only pairs --compare times: add --compare.")
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats is how many speculative / target-only pairs to time: at least 1; "
                         f"got {args.repeats}.")
    if args.num_draft_tokens is not None and not 1 <= args.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--num-draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}; got {args.num_draft_tokens}.")
    if args.bit_exact:  # before minutes of calibration on a machine where the mode cannot run (SPEC.md §14)
        from .kernels import shim
        from .request import parse_device

        if parse_device(args.device).type != "cuda" and not shim.interpreted():
            raise ValueError("--bit-exact runs the Triton decode kernels: it needs a CUDA GPU with Triton "
                             "(pip install 'flashspec[gpu]').")
    do_sample = args.temperature > 0
    SamplingParams(do_sample=do_sample, temperature=args.temperature if do_sample else 1.0,
                   top_k=args.top_k, top_p=args.top_p)  # a ValueError naming the bad value
    return dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.temperature > 0,
        temperature=args.temperature if args.temperature > 0 else 1.0,
        top_k=args.top_k,
        top_p=args.top_p,
        num_draft_tokens=args.num_draft_tokens or 4,  # (the engine's arms carry their own γ)
        seed=args.seed,
    )


def _report(label: str, out: Any) -> None:
    s = out.stats
    drafts = f"acceptance {s.acceptance_rate:.2f}, " if s.proposed else ""
    print(
        f"[{label}] {s.new_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_second:.2f} tokens/s; "
        f"{drafts}{s.mean_tokens_per_step:.2f} tokens/step, {s.steps} steps, "
        f"engine overhead {s.overhead_fraction:.1%}"
    )


def _complete(engine: Any, baseline: Any, prompt: str, args: argparse.Namespace) -> None:
    options = _sampling_options(args)
    out = engine.generate(prompt, progress=True, **options)
    print(prompt + out.text[0])
    print()
    _report("speculative", out)
    if baseline is None:
        return
    base = baseline.generate(prompt, progress=True, **options)
    _report("target-only", base)
    # Alternating pairs, the median ratio (SPEC.md §13): one pair is as noisy as the machine.
    ratios = [out.stats.tokens_per_second / base.stats.tokens_per_second]
    for pair in range(2, (args.repeats or 3) + 1):
        again = engine.generate(prompt, **options)
        _report(f"speculative, pair {pair}", again)
        alone = baseline.generate(prompt, **options)
        _report(f"target-only, pair {pair}", alone)
        ratios.append(again.stats.tokens_per_second / alone.stats.tokens_per_second)
    speedup = statistics.median(ratios)
    if len(ratios) > 1:
        print(f"pairs: {', '.join(f'{r:.2f}x' for r in ratios)}; median {speedup:.2f}x")
    _explain_speedup(engine, out.stats, speedup)
    if base.sequences == out.sequences:
        same = "identical"
    elif options["do_sample"]:
        same = "different (sampling draws differ)"
    else:
        same = ("different: in reduced precision a (γ+1)-token forward can round a near-tie the other way "
                "(SPEC.md §7; float32 output is token-for-token equal, and so is 16-bit output with --bit-exact, "
                "§14)")
    print(f"speedup {speedup:.2f}x; outputs {same}")


if __name__ == "__main__":
    sys.exit(main())
