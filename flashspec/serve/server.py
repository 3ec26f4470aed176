"""The server over one engine: build its scheduler and app, warm it, run it in-process.

The engine's step loop runs in one background thread (:mod:`flashspec.serve.scheduler`); HTTP
handlers (:mod:`flashspec.serve.app`) talk to it through queues. :func:`start_server` runs it
in-process (tests, notebooks); ``flashspec serve`` (:mod:`flashspec.cli.serve`) runs it as a
command.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import check_int
from .limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT, DEFAULT_SHUTDOWN_GRACE
from .scheduler import admissible_warmup_lengths

__all__ = ["Server", "build", "check_seconds", "default_slots", "default_warmup_lengths", "freeze_heap",
           "load_cuda_modules_eagerly", "start_server", "warm_http"]


MISSING = "flashspec serve needs the server extra: pip install 'flashspec[server]' ({error})."


@dataclass
class Server:
    """A running server: ``url`` (``http://host:port``), ``scheduler``, ``stop()``."""

    url: str
    scheduler: Any
    startup_seconds: float
    _uvicorn: Any
    _thread: threading.Thread

    def stop(self) -> None:
        """Shut down as on SIGTERM (SPEC.md §12): waiting requests get 503, running ones have the
        shutdown grace; then the engine thread ends."""
        self._uvicorn.should_exit = True
        self._thread.join(timeout=self._uvicorn.grace + 30)
        self.scheduler.stop()
        self._uvicorn.config.app.state.close()
        gc.unfreeze()  # what start-up froze may be collected again (freeze_heap)


def freeze_heap() -> None:
    """Collect once, then move every object alive now — models, compiled code, captured graphs,
    the server — out of the garbage collector's sight (``gc.freeze``), so that no later
    collection walks them all inside a request (SPEC.md §12: on this machine's CPU such a pass
    took about 200 ms during the first requests after start-up). Called once the server is warm."""
    gc.collect()
    gc.freeze()


def default_warmup_lengths(device_type: str, compile: bool, max_length: int) -> tuple[int, ...]:
    """The prompt lengths the server's warm-up prefills when :func:`build` is given none
    (SPEC.md §12), sorted, each once, none above ``max_length - 2``.

    ``device_type``: the target's ``torch.device.type``; ``compile``: the engine's; ``max_length``:
    the batch's (prompt + new tokens, >= 2). With ``compile``, every compiled width 1 … 16 (the
    Triton kernels of short forwards specialise per width), else 1. On ``"cuda"`` also the powers
    of two and the midpoints between consecutive ones (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96,
    …), the last clamped to ``max_length - 2``, so that every size class of prefill has run once
    before the first request. Why: prefills run eagerly, and on an H200 the first request of a
    prompt length longer than the warmed ones had a slower first token than a repeat (1.39× at
    200 tokens, bf16). That the cost is cuBLAS choosing and lazily loading a kernel for each new
    row count of the prefill's matrix multiplies is a hypothesis, not yet verified on a GPU. Any
    other device keeps the short list: a CPU probe found no cost per new prompt length, and long
    prefills there take seconds.

    >>> default_warmup_lengths("cuda", False, 100)
    (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 98)
    >>> default_warmup_lengths("cpu", False, 4096)
    (1,)
    """
    check_int("max_length", max_length, 2)
    from ..models.static import StaticLM

    lengths = list(range(1, StaticLM.COMPILED_WIDTHS + 1)) if compile else [1]
    if device_type == "cuda":
        top, power = max_length - 2, 1
        while True:
            lengths += [power, power + power // 2]  # (1 + 0 = 1 at the start)
            if power >= top:  # the midpoint above ``top`` clamps to it: the longest admissible prompt
                break
            power *= 2
    return tuple(sorted(admissible_warmup_lengths(lengths, max_length)))


def _check_warmup_lengths(lengths: Any) -> tuple[int, ...]:
    """An explicit ``warmup_lengths`` as a tuple, or ``ValueError`` with what is wrong with it."""
    try:
        values = tuple(lengths)
    except TypeError:
        values = None
    if values is None or isinstance(lengths, (str, bytes)):
        raise ValueError(f"warmup_lengths must be a list of prompt lengths (positive integers); got {lengths!r}.")
    if not values:
        raise ValueError("warmup_lengths is empty: give at least one prompt length to warm up "
                         "(or leave it out for the default).")
    bad = [n for n in values if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise ValueError(f"warmup_lengths must hold prompt lengths of at least 1 token (positive integers); "
                         f"got {bad[0]!r} in {lengths!r}.")
    return values


def _check_names(model_name: Any, model_aliases: Any) -> tuple[str, ...]:
    """The model aliases as a tuple, or ``ValueError`` for a name that is not a non-empty string."""
    aliases = tuple(model_aliases) if isinstance(model_aliases, (list, tuple)) else None
    if aliases is None:
        raise ValueError(f"model_aliases must be a list of names; got {model_aliases!r}.")
    for name in (model_name, *aliases):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"A model name must be a non-empty string; got {name!r}.")
    return aliases


def default_slots(device: Any) -> int:
    """The server's batch slots when none are asked for: 8 on a GPU, where a decode step reads
    the weights once for every row and an empty slot costs little; 1 elsewhere, where a step's
    cost grows with its rows whether they hold a request or not (SPEC.md §12)."""
    return 8 if torch.device(device).type == "cuda" else 1


def build(engine: Any, *, model_name: str = "flashspec", slots: int = 8, max_length: int | None = None,
          max_queue: int = 64, max_prefill_tokens: int = 2048, num_draft_tokens: int = 4,
          default_max_tokens: int = 256, warmup_lengths: tuple[int, ...] | None = None,
          model_aliases: tuple[str, ...] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          api_key: str | None = None) -> tuple[Any, Any]:
    """The started scheduler (batch open, warmed up) and the ASGI app over it. ``warmup_lengths``:
    the prompt lengths the warm-up prefills, each clamped to ``max_length - 2`` and run once
    (default: :func:`default_warmup_lengths` for the target's device, the engine's ``compile`` and
    the batch's ``max_length``); an empty list or a length below 1 is a ``ValueError``.
    ``model_name`` and ``model_aliases``: the names a request's ``model`` may give;
    ``max_body_bytes``: the largest request body (413 beyond); ``api_key``: the bearer token
    every route but ``/health`` needs (None: none) (SPEC.md §12)."""
    try:
        from .app import create_app
        from .metrics import Metrics
        from .scheduler import Scheduler
    except ImportError as error:
        raise ValueError(MISSING.format(error=error)) from None
    if engine.tokenizer is None:
        raise ValueError("flashspec serve needs a tokenizer: the target folder has none; pass --tokenizer.")
    check_int("max_queue", max_queue, 0)
    check_int("max_prefill_tokens", max_prefill_tokens, 1)
    check_int("max_body_bytes", max_body_bytes, 1)
    aliases = _check_names(model_name, model_aliases)
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("The API key is empty: give a non-empty key, or none to serve without one.")
    if warmup_lengths is None:
        # The scheduler calls it with the opened batch's max_length (when max_length is None, the
        # batch's default: the model's window, at most 4096). Looked up here, so a test may replace it.
        lengths: Any = functools.partial(default_warmup_lengths, engine.target.device.type, bool(engine.compile))
    else:
        lengths = _check_warmup_lengths(warmup_lengths)
    metrics = Metrics()
    scheduler = Scheduler(engine, metrics, slots=slots, max_length=max_length, max_queue=max_queue,
                          max_prefill_tokens=max_prefill_tokens, num_draft_tokens=num_draft_tokens,
                          warmup_lengths=lengths)
    scheduler.start()
    return scheduler, create_app(scheduler, metrics, engine.tokenizer, model_name, default_max_tokens,
                                 model_aliases=aliases, max_body_bytes=max_body_bytes, api_key=api_key)


def warm_http(url: str, scheduler: Any, tokenizer: Any, timeout: float = 120.0, api_key: str | None = None
              ) -> float:
    """Send throw-away requests through the running server's HTTP path (a completion, a streamed
    one and, when the tokenizer has a chat template, a streamed chat completion; 1 token each, so
    no decode step), so that the first client request pays none of that path's one-time costs
    (first use of the HTTP server's request path, the streaming response, the chat template).
    Then start the metrics afresh, so that they count the clients' requests only. Returns the
    seconds taken; a failed warm-up request is logged, never raised (SPEC.md §12). ``api_key``:
    the server's, if it has one."""
    import json
    import logging
    import urllib.request

    started = time.perf_counter()
    bodies = [("completions", {"prompt": "Hello", "max_tokens": 1, "temperature": 0}),
              ("completions", {"prompt": "Hello", "max_tokens": 1, "temperature": 0, "stream": True})]
    if getattr(tokenizer, "chat_template", None) is not None:
        bodies.append(("chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1,
                                            "temperature": 0, "stream": True}))
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    for route, body in bodies:
        request = urllib.request.Request(f"{url}/v1/{route}", data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # our own loopback URL
                response.read()
        except Exception as error:  # noqa: BLE001 — a warm-up is best effort
            logging.getLogger("flashspec.serve").warning("warm-up request to /v1/%s failed: %s", route, error)
    scheduler.reset_metrics()
    return time.perf_counter() - started


def start_server(engine: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 read_timeout: float = DEFAULT_READ_TIMEOUT, shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
                 **options: Any) -> Server:
    """Serve ``engine`` from a background thread; returns once it accepts connections.
    ``port=0`` picks a free port. ``read_timeout``: seconds a client has to send a request;
    ``shutdown_grace``: seconds running requests may go on once :meth:`Server.stop` is called
    (SPEC.md §12). ``options`` go to :func:`build`."""
    try:
        from .http import make_server
    except ImportError as error:
        raise ValueError(MISSING.format(error=error)) from None

    check_seconds("read_timeout", read_timeout)
    check_seconds("shutdown_grace", shutdown_grace, zero=True)
    started = time.perf_counter()
    scheduler, app = build(engine, **options)
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server = make_server(app, scheduler, host=host, port=port, log_level=log_level, read_timeout=read_timeout,
                         shutdown_grace=shutdown_grace)
    thread = threading.Thread(target=server.run, name="flashspec-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            scheduler.stop()
            raise ValueError(f"The HTTP server could not start on {host}:{port}.")
        time.sleep(0.02)
    url = f"http://{host}:{port}"
    warm_http(url, scheduler, engine.tokenizer, api_key=options.get("api_key"))
    freeze_heap()
    seconds = time.perf_counter() - started
    scheduler.metrics.startup.set(seconds)
    return Server(url, scheduler, seconds, server, thread)


def check_seconds(name: str, value: Any, zero: bool = False) -> float:
    """``value`` as seconds (a finite number > 0, or >= 0 with ``zero``), else a ``ValueError``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be a number of seconds {'>= 0' if zero else '> 0'}; got {value!r}.")
    return float(value)


def load_cuda_modules_eagerly() -> None:
    """Ask CUDA to load every kernel module at start-up rather than at each kernel's first
    launch (``CUDA_MODULE_LOADING=EAGER``, unless the environment sets it): with lazy loading,
    even prefill widths the warm-up ran paid on their first request (SPEC.md §12, "Prefill
    widths"). Only before CUDA starts in this process does it have any effect."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
