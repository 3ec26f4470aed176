"""``flashspec generate``, ``demo`` and ``calibrate``: complete a prompt speculatively (beside the
target alone, with ``--compare`` or in the demo) and time forwards on this machine."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from ..demo import DEMO_PROMPT, DRAFTER_KINDS
from ..models.loading import DTYPES
from ..select.guard import DEFAULT_SLACK
from .options import (
    MODEL,
    add_device,
    add_drafts,
    add_sampling,
    add_target,
    add_tokenizer,
    check_block_size_flag,
)

__all__ = ["add_parsers"]


def add_parsers(sub: Any) -> None:
    """Add ``generate``, ``demo`` and ``calibrate`` to the ``flashspec`` parser's sub-parsers."""
    gen = sub.add_parser("generate", help="complete a prompt speculatively")
    add_target(gen)
    add_drafts(gen)
    add_tokenizer(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--compare", action="store_true", help="also run target-only decoding and print the speedup")
    add_sampling(gen)
    gen.set_defaults(run=generate)

    demo_parser = sub.add_parser(
        "demo", help="Qwen2.5-Coder 1.5B with a drafter trained from it, on a code prompt",
        description="Qwen2.5-Coder-1.5B-Instruct completes a code prompt speculatively, beside the target "
                    "alone, and prints the speedup. The first run downloads the model's GGUF copy (about 1.1 GB; "
                    "with --drafter model also the 0.5B drafter) into ~/.cache/flashspec ($FLASHSPEC_CACHE), "
                    "checked by sha256; the feature drafter ships with the package.")
    demo_parser.add_argument("--prompt", default=DEMO_PROMPT)
    demo_parser.add_argument("--drafter", default="feature", choices=list(DRAFTER_KINDS),
                             help="feature (default): the feature drafter trained from the target, shipped in "
                                  "the package; model: the 0.5B Qwen2.5-Coder model")
    add_sampling(demo_parser)
    demo_parser.set_defaults(run=demo)

    cal = sub.add_parser("calibrate", help="time target (and drafter) forwards by width here; predict speedups")
    add_target(cal)
    add_drafts(cal, repeatable=False, help=f"a drafter model: {MODEL}")
    cal.add_argument("--max-gamma", type=int, default=8, help="time forwards of 1 to this + 1 tokens (default 8)")
    cal.add_argument("--context", type=int, default=None,
                     help="cached positions before the timed tokens (default 256, half the window if less)")
    cal.add_argument("--no-cache", action="store_true", help="time again even when a cached curve matches")
    cal.add_argument("--no-progress", action="store_true")
    add_device(cal)
    cal.set_defaults(run=calibrate)


def generate(args: argparse.Namespace) -> None:
    """Complete ``--prompt`` speculatively; with ``--compare`` also target-only, and the speedup."""
    _sampling_options(args)  # checked before minutes of model loading
    engine, baseline = _load_pair(args.target, args.draft or [], args.tokenizer, args)
    _complete(engine, baseline if args.compare else None, args.prompt, args)


def demo(args: argparse.Namespace) -> None:
    """The demo pair on a code prompt, speculative beside target-only."""
    from ..demo import demo_pair

    _sampling_options(args)  # checked before the download and minutes of model loading
    target, draft = demo_pair(args.drafter)
    engine, baseline = _load_pair(target, [draft], None, args)
    _complete(engine, baseline, args.prompt, args)


CALIBRATION_ALPHAS = (0.3, 0.5, 0.7, 0.9)


def calibrate(args: argparse.Namespace) -> None:
    """Time one forward of ``--target`` (and ``--draft``) at each width 1 … ``--max-gamma`` + 1
    here (or read the cached curve), print the costs and the predicted speedup of each γ at a
    few acceptance rates (SPEC.md, "Calibration")."""
    from ..decode.request import MAX_DRAFT_TOKENS
    from ..drafters import ModelDrafter
    from ..engine import SpeculativeEngine
    from ..tuning.calibrate import measure, predict_speedup

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


def _explain_speedup(engine: Any, stats: Any, speedup: float) -> None:
    """Which arms ran, what the calibration predicted for them at the acceptance measured, and
    plainly when drafting did not pay."""
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
    from ..engine import SpeculativeEngine
    from ..tuning.auto import calibrated_engine

    gamma = args.num_draft_tokens
    engine = calibrated_engine(target, drafts, tokenizer=tokenizer, device=args.device,
                                          dtype=DTYPES[args.dtype] if args.dtype else None,
                                          gammas=None if gamma is None else [gamma],
                                          use_cache=not args.no_calibration_cache, bit_exact=args.bit_exact,
                                          acceptance=args.acceptance, block_size=args.block_size)
    print(engine.choice.explain())
    print()
    baseline = SpeculativeEngine(engine.target, [], tokenizer=engine.tokenizer, bit_exact=args.bit_exact)
    return engine, baseline


def _sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """``generate``'s sampling keywords from the flags (``--temperature 0``: greedy), checked."""
    import math

    from ..decode.request import MAX_DRAFT_TOKENS
    from ..sampling import SamplingParams

    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 means greedy); got {args.temperature}.")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0; got {args.max_new_tokens}.")
    if args.repeats is not None and not getattr(args, "compare", True):
        raise ValueError("--repeats sets how many speculative / target-only pairs --compare times: add --compare.")
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats is how many speculative / target-only pairs to time: at least 1; "
                         f"got {args.repeats}.")
    check_block_size_flag(args)
    if args.num_draft_tokens is not None and not 1 <= args.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--num-draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}; got {args.num_draft_tokens}.")
    if args.bit_exact:  # before minutes of calibration on a machine where the mode cannot run (SPEC.md §14)
        from ..decode.request import parse_device
        from ..kernels import shim

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
