"""The API key (SPEC.md §12, "The server's limits, fields, authentication and shutdown"): with
one, every request but ``GET /health`` must carry ``Authorization: Bearer KEY``."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from .protocol import error_body

__all__ = ["ENV", "RequireKey"]

# The environment variable `flashspec serve` reads the key from (it keeps the key out of `ps`).
ENV = "FLASHSPEC_API_KEY"

_OPEN = {"/health"}


class RequireKey:
    """ASGI middleware: HTTP requests outside :data:`_OPEN` without the bearer ``key`` get 401
    with OpenAI's error object; ``refused`` is called for each (a metric)."""

    def __init__(self, app: Any, key: str, refused: Callable[[], None] = lambda: None) -> None:
        if not isinstance(key, str) or not key.strip():
            raise ValueError("The API key is empty; give a non-empty key or none.")
        self.app, self.refused = app, refused
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        self.refused()
        reason = "Missing" if not given else "Incorrect"
        body = json.dumps(error_body(f"{reason} API key: send 'Authorization: Bearer <key>' with the key this "
                                     "server was started with.", "invalid_request_error",
                                     code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
