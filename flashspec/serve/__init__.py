"""``flashspec serve``: an OpenAI-compatible server over one engine with continuous batching
(SPEC.md §12).

Needs the ``server`` extra (``pip install 'flashspec[server]'``: Starlette, uvicorn,
prometheus_client). :func:`start_server` runs it in-process (tests, notebooks); the command line
is :mod:`flashspec.cli.serve`.
"""

from .server import (
                     Server,
                     build,
                     default_warmup_lengths,
                     freeze_heap,
                     load_cuda_modules_eagerly,
                     start_server,
                     warm_http,
)

__all__ = ["Server", "build", "default_warmup_lengths", "freeze_heap", "load_cuda_modules_eagerly", "start_server",
           "warm_http"]
