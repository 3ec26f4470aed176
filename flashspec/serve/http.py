"""The HTTP server under the app: uvicorn with h11, a deadline for receiving each request, and a
gentle shutdown (SPEC.md §12, "The server's limits, fields, authentication and shutdown")."""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import DEFAULT_READ_TIMEOUT, DEFAULT_SHUTDOWN_GRACE
from .scheduler import Scheduler

__all__ = ["GentleServer", "ReadDeadline", "make_server"]


class ReadDeadline(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for receiving each request: a connection whose
    request (headers and body) has not wholly arrived ``read_timeout`` seconds after the
    connection opened, or after its previous response, is closed. (h11 has no such timer, and
    uvicorn's keep-alive timer stops at a request's first byte, so a client sending a byte at a
    time would otherwise hold a connection open forever.)"""

    read_timeout = DEFAULT_READ_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is not h11.DONE:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closed a connection whose request did not arrive within %.0f s", self.read_timeout)
            self.transport.close()


class GentleServer(uvicorn.Server):
    """uvicorn's server that, when told to exit, first drains the scheduler (waiting requests
    get 503 at once, running ones have ``grace`` seconds), and exits at once on a second signal
    (uvicorn itself forces an exit only on a second SIGINT)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float) -> None:
        super().__init__(config)
        self.scheduler, self.grace = scheduler, grace

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Any = None) -> None:
        self.scheduler.drain(0.0 if self.force_exit else self.grace)
        await super().shutdown(sockets)


def make_server(app: Any, scheduler: Scheduler, *, host: str, port: int, log_level: str | int | None,
                read_timeout: float = DEFAULT_READ_TIMEOUT, shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
                lifespan: str = "off") -> GentleServer:
    """The uvicorn server for ``app``: h11 with :class:`ReadDeadline`, keep-alive connections
    closed after uvicorn's 5 idle seconds, and a shutdown that drains ``scheduler``."""
    protocol = type("FlashSpecH11", (ReadDeadline,), {"read_timeout": float(read_timeout)})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan=lifespan, http=protocol,
                            timeout_graceful_shutdown=int(shutdown_grace) + 5)  # a backstop past the grace
    return GentleServer(config, scheduler, shutdown_grace)
