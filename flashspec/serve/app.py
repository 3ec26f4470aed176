"""The HTTP side: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (JSON and server-sent
events), ``/v1/models``, ``/health`` and ``/metrics``, on Starlette.

Nothing heavy runs on the event loop: bodies are bounded (:mod:`flashspec.serve.limits`),
prompts are tokenized and checked on a tokenizer thread, and output text is decoded
incrementally (:mod:`flashspec.serve.text`), so one request cannot hold up the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .auth import RequireKey
from .limits import DEFAULT_MAX_BODY_BYTES, TooLarge, read_body
from .metrics import Metrics
from .protocol import (
    BadRequest,
    Job,
    ModelNotFound,
    error_body,
    parse_body,
    parse_chat,
    parse_completion,
)
from .scheduler import QueueFull, Scheduler, ShuttingDown, Ticket
from .text import StopText

__all__ = ["create_app"]

log = logging.getLogger("flashspec.serve")


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def _prompt_ids(tokenizer: Any, job: Job) -> list[int]:
    """The token ids of ``job``'s prompt (chat: through the tokenizer's template); a
    :class:`BadRequest` when the template or the tokenizer refuses it."""
    if not job.chat:
        if not isinstance(job.prompt, str):
            return list(job.prompt)
        try:
            return list(tokenizer(job.prompt)["input_ids"])
        except Exception as error:  # noqa: BLE001 — the tokenizer refused this text
            raise BadRequest(f"The tokenizer could not encode the prompt: {error}", "prompt") from None
    if getattr(tokenizer, "chat_template", None) is None:
        raise BadRequest("This model's tokenizer has no chat template: use /v1/completions.", "messages")
    try:
        out = tokenizer.apply_chat_template(job.prompt, add_generation_prompt=True, tokenize=True)
    except Exception as error:  # noqa: BLE001 — a template that raises on these messages (roles out of order, ...)
        raise BadRequest(f"The chat template refused these messages: {error}", "messages") from None
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def create_app(scheduler: Scheduler, metrics: Metrics, tokenizer: Any, model_name: str,
               default_max_tokens: int = 256, *, model_aliases: tuple[str, ...] = (),
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None) -> Starlette:
    """The ASGI application over a started :class:`Scheduler`. A request's ``model`` must be
    ``model_name`` or one of ``model_aliases``; with ``api_key`` every route but ``/health`` needs
    it as a bearer token. ``app.state.close()`` ends its tokenizer thread."""
    created = int(time.time())
    models = (model_name, *model_aliases)
    pool = ThreadPoolExecutor(1, thread_name_prefix="flashspec-tokenize")
    preparing = 0  # requests on (or waiting for) the tokenizer thread

    def prepare(job: Job, sampling: dict[str, Any]) -> list[int]:
        """On the tokenizer thread: the prompt's ids, checked against the batch."""
        ids = _prompt_ids(tokenizer, job)
        try:
            scheduler.check(ids, sampling)
        except ValueError as error:
            raise BadRequest(str(error)) from None
        return ids

    async def events(job: Job, request: Request) -> AsyncIterator[tuple[str, str | None, dict[str, int]]]:
        """(text delta, finish reason or None, usage) as tokens arrive; raises BadRequest /
        QueueFull / ShuttingDown before the first yield, RuntimeError for a failure after admission."""
        nonlocal preparing
        sampling = dict(max_new_tokens=job.max_tokens, do_sample=job.do_sample, temperature=job.temperature,
                        top_k=job.top_k, top_p=job.top_p, seed=job.seed)
        if scheduler.draining:
            raise ShuttingDown("The server is shutting down; send the request again once it is back.")
        if preparing >= scheduler.capacity:
            raise QueueFull(f"The server is busy preparing {preparing} requests; retry shortly.")
        preparing += 1
        try:
            ids = await asyncio.get_running_loop().run_in_executor(pool, prepare, job, sampling)
        finally:
            preparing -= 1
        ticket = Ticket(ids, sampling, asyncio.get_running_loop())
        scheduler.submit(ticket)
        text = StopText(tokenizer, job.stop)
        counted = 0  # of this request's tokens, in the server's generated-token counter

        def usage(final: bool) -> dict[str, int]:
            """The usage object; also counts the tokens now returned (released text; at the end all
            of them, and at a stop string none of those cut) in the generated-token metric."""
            nonlocal counted
            count = text.tokens if final else text.released()
            if count > counted:
                metrics.generated_tokens.inc(count - counted)
                counted = count
            return {"prompt_tokens": len(ids), "completion_tokens": text.tokens, "total_tokens": len(ids) + text.tokens}

        try:
            while True:
                try:
                    event = await asyncio.wait_for(ticket.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if event[0] == "tokens":
                    delta, stopped = text.add(event[1])
                    if stopped:
                        ticket.answered = True
                        scheduler.cancel(ticket)
                        metrics.requests.labels("ok").inc()
                        yield delta, "stop", usage(True)
                        return
                    if delta:
                        yield delta, None, usage(False)
                elif event[0] == "done":
                    ticket.answered = True
                    delta, stopped = text.finish()
                    metrics.requests.labels("ok").inc()
                    yield delta, "stop" if stopped else event[1], usage(True)
                    return
                elif event[0] == "shutdown":
                    ticket.answered = True
                    raise ShuttingDown(event[1])
                else:
                    ticket.answered = True
                    raise RuntimeError(event[1])
        finally:
            scheduler.cancel(ticket)  # a client that left (or a stop string): free the slot

    async def handle(request: Request, chat: bool) -> Response:
        try:
            raw = await read_body(request, max_body_bytes)
        except TooLarge as error:
            metrics.requests.labels("too_large").inc()
            return _error(413, str(error), code="request_too_large")
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            job = (parse_chat if chat else parse_completion)(parse_body(raw), default_max_tokens, models)
            stream = events(job, request)
            first = await stream.__anext__()  # admission errors surface here, before any byte is sent
        except ModelNotFound as error:
            metrics.requests.labels("bad_request").inc()
            return _error(404, str(error), param=error.param, code="model_not_found")
        except BadRequest as error:
            metrics.requests.labels("bad_request").inc()
            return _error(400, str(error), param=error.param)
        except QueueFull as error:
            metrics.requests.labels("rejected").inc()
            return _error(429, str(error), "rate_limit_error", headers={"Retry-After": "1"})
        except ShuttingDown as error:
            metrics.requests.labels("shutdown").inc()
            return _error(503, str(error), "server_error", code="shutting_down")
        except RuntimeError as error:
            return _error(500, str(error), "server_error")
        except StopAsyncIteration:  # the client left before anything came
            return Response(status_code=499)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if job.stream:
            return StreamingResponse(_sse(job, chat, rid, first, stream), media_type="text/event-stream")
        parts, reason, usage = [first[0]], first[1], first[2]
        try:
            async for delta, reason, usage in stream:
                parts.append(delta)
        except ShuttingDown as error:
            metrics.requests.labels("shutdown").inc()
            return _error(503, str(error), "server_error", code="shutting_down")
        except RuntimeError as error:
            return _error(500, str(error), "server_error")
        text = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": model_name, "choices": [choice], "usage": usage})

    async def _sse(job: Job, chat: bool, rid: str, first: tuple, stream: AsyncIterator) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                d = {} if delta is None else {"content": delta}
                if role:
                    d["role"] = "assistant"
                choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            payload = {"id": rid, "object": kind, "created": int(time.time()), "model": model_name,
                       "choices": [choice]}
            return f"data: {json.dumps(payload)}\n\n"

        usage = first[2]
        try:
            if chat:
                yield chunk("", None, role=True)
            item = first
            while True:
                delta, reason, usage = item
                if delta:
                    yield chunk(delta, None)
                if reason is not None:
                    yield chunk(None, reason)
                    break
                item = await stream.__anext__()
            if job.include_usage:
                yield f"data: {json.dumps({'id': rid, 'object': kind, 'created': int(time.time()), 'model': model_name, 'choices': [], 'usage': usage})}\n\n"
        except ShuttingDown as error:
            metrics.requests.labels("shutdown").inc()
            yield f"data: {json.dumps(error_body(str(error), 'server_error', code='shutting_down'))}\n\n"
        except RuntimeError as error:
            yield f"data: {json.dumps(error_body(str(error), 'server_error'))}\n\n"
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"

    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "flashspec"}]})

    async def health(request: Request) -> Response:
        state = {"status": "shutting_down" if scheduler.draining else "ok", "running": scheduler.running,
                 "queued": scheduler.queued, "slots": scheduler.options["slots"],
                 "warmup_seconds": scheduler.warmup_seconds}
        return JSONResponse(state, status_code=503 if scheduler.draining else 200)

    async def prometheus(request: Request) -> Response:
        metrics.queue_depth.set(scheduler.queued)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind,
                      headers=error.headers)

    async def server_error(request: Request, error: Exception) -> Response:
        log.error("unexpected failure answering %s %s: %r", request.method, request.url.path, error)
        return _error(500, f"The server failed unexpectedly ({type(error).__name__}); see its log.", "server_error")

    middleware = []
    if api_key is not None:
        middleware.append(Middleware(RequireKey, key=api_key,
                                     refused=lambda: metrics.requests.labels("unauthorized").inc()))
    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ], middleware=middleware, exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.close = lambda: pool.shutdown(wait=False, cancel_futures=True)
    return app
