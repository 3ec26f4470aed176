"""What one request may cost and how long it may take (SPEC.md §12, "The server's limits,
fields, authentication and shutdown"): the size of its body, the time to send it, the grace at
shutdown. Importable without the server's packages (the command line reads the defaults)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_READ_TIMEOUT", "DEFAULT_SHUTDOWN_GRACE", "TooLarge", "read_body"]

# nginx's default (client_max_body_size 1m): a prompt of tens of thousands of tokens as text or ids.
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_READ_TIMEOUT = 30.0  # seconds to send a request's headers and body
DEFAULT_SHUTDOWN_GRACE = 20.0  # seconds running requests may go on after SIGTERM (below Kubernetes' 30)


class TooLarge(ValueError):
    """A body over the limit: HTTP 413."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, or :class:`TooLarge` as soon as it is known to pass ``max_bytes``:
    from its ``Content-Length`` before anything is read, else once the bytes read pass it (no
    more than ``max_bytes`` of it is ever held)."""
    message = (f"The request body is larger than this server's limit of {max_bytes:,} bytes "
               "(flashspec serve --max-body-bytes).")
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise TooLarge(message)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(message)
        parts.append(chunk)
    return b"".join(parts)
