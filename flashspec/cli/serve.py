"""``flashspec serve``: the command that runs the OpenAI-compatible server (SPEC.md §12)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from typing import Any

from ..serve.auth import ENV
from ..serve.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_SHUTDOWN_GRACE,
)
from .options import (
    DRAFTERS,
    add_compile,
    add_device,
    add_drafts,
    add_target,
    add_tokenizer,
)

__all__ = ["add_parsers"]


def add_parsers(sub: Any) -> None:
    """Add ``flashspec serve`` to the ``flashspec`` parser's sub-parsers."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    add_target(p)
    add_drafts(p, help=DRAFTERS)
    p.add_argument("--selector", default="auto",
                   help="auto (default: Thompson over the drafter arms and the target alone, never-slower guard), "
                        "fixed, ucb1, thompson, ... (SPEC.md §8)")
    add_tokenizer(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None,
                   help="the id /v1/models reports and a request's model must give (default: the target's name)")
    p.add_argument("--model-alias", action="append", default=[],
                   help="another name a request's model may give (repeatable); any other name gets 404")
    p.add_argument("--max-batch", type=int, default=None,
                   help="requests decoded together (batch slots; default 8 on a GPU, 1 on a CPU, where every "
                        "slot costs about what a request does, occupied or not)")
    p.add_argument("--max-length", type=int, default=None,
                   help="prompt + max_tokens of a request (default: the context window, at most 4096)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot; more get 429")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="token budget: prompt tokens fed at one step boundary")
    p.add_argument("--num-draft-tokens", "--gamma", type=int, default=None,
                   help="tokens drafted per step (default: chosen per drafter by timing its steps here, as "
                        "`flashspec generate` does)")
    p.add_argument("--no-calibration-cache", action="store_true",
                   help="time forwards and steps again even when cached timings match")
    add_device(p)
    add_compile(p, help="torch.compile the decode forwards (warmed up at start)")
    p.add_argument("--bit-exact", action="store_true",
                   help="bit-exact mode: a request's logits do not depend on its batch or the draft length "
                        "(SPEC.md §14; a CUDA GPU, Llama/Qwen2/Qwen3/Mistral targets)")
    p.add_argument("--api-key", default=None,
                   help=f"requests must send 'Authorization: Bearer KEY' (all but /health; else 401); default: "
                        f"${ENV} if set (which keeps the key out of the process list). Use one whenever --host "
                        "is reachable from other machines")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body; larger gets 413 (default: 1 MiB)")
    p.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT,
                   help="seconds a client has to send a request's headers and body; then the connection is closed")
    p.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE,
                   help="on SIGTERM: seconds running requests may go on (waiting ones get 503 at once); "
                        "a second signal exits at once")
    p.set_defaults(run=serve)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The server's limits from the flags (and the key from the environment), checked before any
    model loads."""
    from ..serve.server import check_seconds

    api_key = args.api_key if args.api_key is not None else os.environ.get(ENV) or None
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty: give a non-empty key, or none to serve without one.")
    if args.max_batch is not None and not 1 <= args.max_batch <= 1024:
        raise ValueError(f"--max-batch must be an integer from 1 to 1024; got {args.max_batch}.")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be at least 1; got {args.max_body_bytes}.")
    check_seconds("--read-timeout", args.read_timeout)
    check_seconds("--shutdown-grace", args.shutdown_grace, zero=True)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"flashspec serve: warning: listening on {args.host} without an API key; anyone who can reach "
              f"it may use it (set --api-key or ${ENV}).", file=sys.stderr, flush=True)
    return dict(api_key=api_key, max_body_bytes=args.max_body_bytes)


def serve(args: argparse.Namespace) -> None:
    """Load the engine, build and warm the server, serve until stopped."""
    from ..models.loading import DTYPES
    from ..tuning.auto import calibrated_engine
    from ..serve.server import (
        MISSING,
        build,
        default_slots,
        freeze_heap,
        load_cuda_modules_eagerly,
        warm_http,
    )

    try:
        from ..serve.http import make_server
    except ImportError as error:
        raise ValueError(MISSING.format(error=error)) from None

    options = _options(args)
    started = time.perf_counter()
    load_cuda_modules_eagerly()
    # The same measured choice of dtype, drafters and draft lengths as `flashspec generate` and
    # `flashspec demo` (SPEC.md §13), printed the same way.
    gamma = args.num_draft_tokens
    engine = calibrated_engine(args.target, args.draft or [], selector=args.selector, tokenizer=args.tokenizer,
                               device=args.device, dtype=DTYPES[args.dtype] if args.dtype else None,
                               gammas=None if gamma is None else [gamma], compile=args.compile,
                               bit_exact=args.bit_exact, use_cache=not args.no_calibration_cache,
                               warmup=False)  # the server warms its own batch's shapes (build)
    print(engine.choice.explain(), flush=True)
    slots = args.max_batch if args.max_batch is not None else default_slots(engine.target.device)
    print(f"batch slots: {slots}" + ("" if args.max_batch is not None or slots > 1 else
                                     " (a CPU: each slot costs about what a request does; --max-batch N batches)"),
          flush=True)
    scheduler, app = build(engine, model_name=args.model_name or str(args.target).rstrip("/").split("/")[-1],
                           slots=slots, max_length=args.max_length, max_queue=args.max_queue,
                           max_prefill_tokens=args.max_prefill_tokens, num_draft_tokens=gamma or 4,
                           model_aliases=tuple(args.model_alias), **options)
    server = make_server(app, scheduler, host=args.host, port=args.port, log_level="info",
                         read_timeout=args.read_timeout, shutdown_grace=args.shutdown_grace, lifespan="auto")

    def ready() -> None:  # once uvicorn listens: warm its HTTP path, then say so
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.02)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        http = warm_http(f"http://{host}:{args.port}", scheduler, engine.tokenizer, api_key=options["api_key"])
        freeze_heap()
        seconds = time.perf_counter() - started
        scheduler.metrics.startup.set(seconds)
        print(f"flashspec serve: ready in {seconds:.1f} s (warm-up {scheduler.warmup_seconds:.2f} s, "
              f"HTTP {http:.2f} s) on http://{args.host}:{args.port}", flush=True)

    threading.Thread(target=ready, name="flashspec-ready", daemon=True).start()
    try:
        server.run()
    finally:
        scheduler.stop(timeout=1.0 if server.force_exit else 30.0)
        app.state.close()
        gc.unfreeze()
