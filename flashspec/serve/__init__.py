"""``flashspec serve``: an OpenAI-compatible server over one engine with continuous batching
(SPEC.md §12).

Needs the ``server`` extra (``pip install 'flashspec[server]'``: Starlette, uvicorn,
prometheus_client). :func:`start_server` runs it in-process (tests, notebooks); the command line
is :mod:`flashspec.cli.serve`. The names below load :mod:`flashspec.serve.server` on first use,
so that the command line can read the server's defaults (:mod:`flashspec.serve.limits`) without
the server's packages.
"""

from typing import Any

__all__ = ["Server", "build", "default_warmup_lengths", "freeze_heap", "load_cuda_modules_eagerly", "start_server",
           "warm_http"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
