"""The HTTP side: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (JSON and server-sent
events), ``/v1/models``, ``/health`` and ``/metrics``, on Starlette."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .metrics import Metrics
from .protocol import BadRequest, Job, error_body, parse_chat, parse_completion
from .scheduler import QueueFull, Scheduler, Ticket

__all__ = ["create_app"]


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param), status_code=status, headers=headers)


class _Text:
    """Incremental detokenisation with stop strings: text is released only once no stop string
    can still begin in it, and never in the middle of a multi-byte character. At a stop string
    ``ids`` is cut to the tokens of the text returned (OpenAI's ``completion_tokens``): a token
    whose text lies wholly at or after the stop string's start is not counted."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """New releasable text, and whether a stop string ended the completion."""
        self.ids += ids
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.ids = self.ids[: self.covering(at)]
                return self.flush(), True
        end = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):
            end = min(end, len(self.text) - 1)
        if end <= self.sent:
            return "", False
        delta, self.sent = self.text[self.sent : end], end
        return delta, False

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta

    def covering(self, chars: int) -> int:
        """The fewest leading ids whose text holds the first ``chars`` characters."""
        k = len(self.ids)
        while k > 0 and len(self.tokenizer.decode(self.ids[: k - 1], skip_special_tokens=True)) >= chars:
            k -= 1
        return k

    def released(self) -> int:
        """Tokens whose text has been released so far (all of them once the completion ended;
        without stop strings no token can still be cut, so every one received counts)."""
        return self.covering(self.sent) if self.stop else len(self.ids)


def create_app(scheduler: Scheduler, metrics: Metrics, tokenizer: Any, model_name: str,
               default_max_tokens: int = 256) -> Starlette:
    """The ASGI application over a started :class:`Scheduler`."""
    created = int(time.time())

    def prompt_ids(job: Job) -> list[int]:
        if job.chat:
            if getattr(tokenizer, "chat_template", None) is None:
                raise BadRequest("This model's tokenizer has no chat template: use /v1/completions.", "messages")
            out = tokenizer.apply_chat_template(job.prompt, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return list(ids[0] if ids and isinstance(ids[0], list) else ids)
        if isinstance(job.prompt, str):
            return list(tokenizer(job.prompt)["input_ids"])
        return list(job.prompt)

    async def events(job: Job, request: Request) -> AsyncIterator[tuple[str, str | None, dict[str, int]]]:
        """(text delta, finish reason or None, usage) as tokens arrive; raises BadRequest /
        QueueFull before the first yield, RuntimeError for a failure after admission."""
        ids = prompt_ids(job)
        sampling = dict(max_new_tokens=job.max_tokens, do_sample=job.do_sample, temperature=job.temperature,
                        top_k=job.top_k, top_p=job.top_p, seed=job.seed)
        try:
            scheduler.check(ids, sampling)
        except ValueError as error:
            raise BadRequest(str(error)) from None
        ticket = Ticket(ids, sampling, asyncio.get_running_loop())
        scheduler.submit(ticket)
        text = _Text(tokenizer, job.stop)
        counted = 0  # of this request's tokens, in the server's generated-token counter

        def usage(final: bool) -> dict[str, int]:
            """The usage object; also counts the tokens now returned (released text; at the end all
            of them, and at a stop string none of those cut) in the generated-token metric."""
            nonlocal counted
            count = len(text.ids) if final else text.released()
            if count > counted:
                metrics.generated_tokens.inc(count - counted)
                counted = count
            return {"prompt_tokens": len(ids), "completion_tokens": len(text.ids),
                    "total_tokens": len(ids) + len(text.ids)}

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
                    metrics.requests.labels("ok").inc()
                    delta = text.flush()
                    yield delta, event[1], usage(True)
                    return
                else:
                    ticket.answered = True
                    raise RuntimeError(event[1])
        finally:
            scheduler.cancel(ticket)  # a client that left (or a stop string): free the slot

    async def handle(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            metrics.requests.labels("bad_request").inc()
            return _error(400, "The request body is not valid JSON.")
        try:
            job = (parse_chat if chat else parse_completion)(body, default_max_tokens)
            stream = events(job, request)
            first = await stream.__anext__()  # admission errors surface here, before any byte is sent
        except BadRequest as error:
            metrics.requests.labels("bad_request").inc()
            return _error(400, str(error), param=error.param)
        except QueueFull as error:
            metrics.requests.labels("rejected").inc()
            return _error(429, str(error), "rate_limit_error", headers={"Retry-After": "1"})
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
        except RuntimeError as error:
            yield f"data: {json.dumps(error_body(str(error), 'server_error'))}\n\n"
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"

    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "flashspec"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "running": scheduler.running, "queued": scheduler.queued,
                             "slots": scheduler.options["slots"], "warmup_seconds": scheduler.warmup_seconds})

    async def prometheus(request: Request) -> Response:
        metrics.queue_depth.set(scheduler.queued)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ])
