"""``flashspec serve``: the command that runs the OpenAI-compatible server (SPEC.md §12)."""

from __future__ import annotations

import argparse
import gc
import threading
import time
from typing import Any

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
    p.add_argument("--model-name", default=None, help="the id /v1/models reports (default: the target's)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (batch slots)")
    p.add_argument("--max-length", type=int, default=None,
                   help="prompt + max_tokens of a request (default: the context window, at most 4096)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot; more get 429")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="token budget: prompt tokens fed at one step boundary")
    p.add_argument("--num-draft-tokens", "--gamma", type=int, default=4)
    add_device(p)
    add_compile(p, help="torch.compile the decode forwards (warmed up at start)")
    p.add_argument("--bit-exact", action="store_true",
                   help="bit-exact mode: a request's logits do not depend on its batch or the draft length "
                        "(SPEC.md §14; a CUDA GPU, Llama/Qwen2/Qwen3/Mistral targets)")
    p.set_defaults(run=serve)


def serve(args: argparse.Namespace) -> None:
    """Load the engine, build and warm the server, serve until stopped."""
    from ..engine import SpeculativeEngine
    from ..serve.server import (
        MISSING,
        build,
        freeze_heap,
        load_cuda_modules_eagerly,
        warm_http,
    )

    try:
        import uvicorn
    except ImportError as error:
        raise ValueError(MISSING.format(error=error)) from None

    started = time.perf_counter()
    load_cuda_modules_eagerly()
    engine = SpeculativeEngine(args.target, args.draft or [], selector=args.selector, tokenizer=args.tokenizer,
                               device=args.device, dtype=args.dtype, compile=args.compile, bit_exact=args.bit_exact)
    scheduler, app = build(engine, model_name=args.model_name or str(args.target).rstrip("/").split("/")[-1],
                           slots=args.max_batch, max_length=args.max_length, max_queue=args.max_queue,
                           max_prefill_tokens=args.max_prefill_tokens, num_draft_tokens=args.num_draft_tokens)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))

    def ready() -> None:  # once uvicorn listens: warm its HTTP path, then say so
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.02)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        http = warm_http(f"http://{host}:{args.port}", scheduler, engine.tokenizer)
        freeze_heap()
        seconds = time.perf_counter() - started
        scheduler.metrics.startup.set(seconds)
        print(f"flashspec serve: ready in {seconds:.1f} s (warm-up {scheduler.warmup_seconds:.2f} s, "
              f"HTTP {http:.2f} s) on http://{args.host}:{args.port}", flush=True)

    threading.Thread(target=ready, name="flashspec-ready", daemon=True).start()
    try:
        server.run()
    finally:
        scheduler.stop()
        gc.unfreeze()
