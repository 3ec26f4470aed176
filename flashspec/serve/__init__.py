"""``flashspec serve``: an OpenAI-compatible server over one engine with continuous batching.

Needs the ``server`` extra (``pip install 'flashspec[server]'``: Starlette, uvicorn,
prometheus_client). The engine's step loop runs in one background thread
(:mod:`flashspec.serve.scheduler`); HTTP handlers (:mod:`flashspec.serve.app`) talk to it through
queues. :func:`start_server` runs it in-process (tests, notebooks); :func:`add_parser` wires the
command into ``flashspec``.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Server", "add_parser", "start_server"]

_MISSING = "flashspec serve needs the server extra: pip install 'flashspec[server]' ({error})."


@dataclass
class Server:
    """A running server: ``url`` (``http://host:port``), ``scheduler``, ``stop()``."""

    url: str
    scheduler: Any
    startup_seconds: float
    _uvicorn: Any
    _thread: threading.Thread

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=30)
        self.scheduler.stop()


def build(engine: Any, *, model_name: str = "flashspec", slots: int = 8, max_length: int | None = None,
          max_queue: int = 64, max_prefill_tokens: int = 2048, num_draft_tokens: int = 4,
          default_max_tokens: int = 256, warmup_lengths: tuple[int, ...] | None = None) -> tuple[Any, Any]:
    """The started scheduler (batch open, warmed up) and the ASGI app over it. ``warmup_lengths``:
    the prompt lengths the warm-up prefills (default: every compiled width, 1 … 16, when the engine
    compiles — the Triton kernels of short forwards specialise per width; else one)."""
    try:
        from .app import create_app
        from .metrics import Metrics
        from .scheduler import Scheduler
    except ImportError as error:
        raise ValueError(_MISSING.format(error=error)) from None
    if engine.tokenizer is None:
        raise ValueError("flashspec serve needs a tokenizer: the target folder has none; pass --tokenizer.")
    for name, value, low in (("max_queue", max_queue, 0), ("max_prefill_tokens", max_prefill_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}.")
    if warmup_lengths is None:
        from ..cache import StaticLM

        warmup_lengths = tuple(range(1, StaticLM.COMPILED_WIDTHS + 1)) if engine.compile else (1,)
    metrics = Metrics()
    scheduler = Scheduler(engine, metrics, slots=slots, max_length=max_length, max_queue=max_queue,
                          max_prefill_tokens=max_prefill_tokens, num_draft_tokens=num_draft_tokens,
                          warmup_lengths=warmup_lengths)
    scheduler.start()
    return scheduler, create_app(scheduler, metrics, engine.tokenizer, model_name, default_max_tokens)


def warm_http(url: str, scheduler: Any, tokenizer: Any, timeout: float = 120.0) -> float:
    """Send throw-away requests through the running server's HTTP path (a completion, a streamed
    one and, when the tokenizer has a chat template, a streamed chat completion; 1 token each, so
    no decode step), so that the first client request pays none of that path's one-time costs
    (first use of the HTTP server's request path, the streaming response, the chat template).
    Then start the metrics afresh, so that they count the clients' requests only. Returns the
    seconds taken; a failed warm-up request is logged, never raised (SPEC.md §12)."""
    import json
    import logging
    import urllib.request

    started = time.perf_counter()
    bodies = [("completions", {"prompt": "Hello", "max_tokens": 1, "temperature": 0}),
              ("completions", {"prompt": "Hello", "max_tokens": 1, "temperature": 0, "stream": True})]
    if getattr(tokenizer, "chat_template", None) is not None:
        bodies.append(("chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1,
                                            "temperature": 0, "stream": True}))
    for route, body in bodies:
        request = urllib.request.Request(f"{url}/v1/{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # our own loopback URL
                response.read()
        except Exception as error:  # noqa: BLE001 — a warm-up is best effort
            logging.getLogger("flashspec.serve").warning("warm-up request to /v1/%s failed: %s", route, error)
    scheduler.reset_metrics()
    return time.perf_counter() - started


def start_server(engine: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 **options: Any) -> Server:
    """Serve ``engine`` from a background thread; returns once it accepts connections.
    ``port=0`` picks a free port. ``options`` go to :func:`build`."""
    import uvicorn

    started = time.perf_counter()
    scheduler, app = build(engine, **options)
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off"))
    thread = threading.Thread(target=server.run, name="flashspec-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            scheduler.stop()
            raise ValueError(f"The HTTP server could not start on {host}:{port}.")
        time.sleep(0.02)
    url = f"http://{host}:{port}"
    warm_http(url, scheduler, engine.tokenizer)
    seconds = time.perf_counter() - started
    scheduler.metrics.startup.set(seconds)
    return Server(url, scheduler, seconds, server, thread)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``flashspec serve`` to the ``flashspec`` parser's sub-parsers."""
    from ..models import DTYPES

    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("--target", required=True, help="folder, hub id or .gguf file")
    p.add_argument("--draft", action="append", default=[],
                   help="drafter: folder, hub id, .gguf file, 'ngram', 'early-exit:N', 'feature:DIR' or "
                        "'shallow:DIR' (repeatable)")
    p.add_argument("--selector", default="fixed", help="fixed, ucb1, thompson, ... (SPEC.md §8)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the target's)")
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
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode forwards (warmed up at start)")
    p.set_defaults(run=_run)
    return p


def _run(args: argparse.Namespace) -> None:
    try:
        import uvicorn
    except ImportError as error:
        raise ValueError(_MISSING.format(error=error)) from None
    from ..engine import SpeculativeEngine

    started = time.perf_counter()
    engine = SpeculativeEngine(args.target, args.draft, selector=args.selector, tokenizer=args.tokenizer,
                               device=args.device, dtype=args.dtype, compile=args.compile)
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
        seconds = time.perf_counter() - started
        scheduler.metrics.startup.set(seconds)
        print(f"flashspec serve: ready in {seconds:.1f} s (warm-up {scheduler.warmup_seconds:.2f} s, "
              f"HTTP {http:.2f} s) on http://{args.host}:{args.port}", flush=True)

    threading.Thread(target=ready, name="flashspec-ready", daemon=True).start()
    try:
        server.run()
    finally:
        scheduler.stop()
