"""OpenAI request bodies, checked field by field (every bad value: HTTP 400 with a sentence)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BadRequest", "Job", "parse_completion", "parse_chat", "error_body"]

# Fields accepted (and ignored when noted) beside the ones read below, so that ordinary clients
# that send them are served; anything else is a 400 (a typo must not be silently dropped).
_IGNORED = {"user", "logit_bias", "presence_penalty", "frequency_penalty", "stream_options", "suffix", "echo",
            "best_of", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls",
            "metadata", "store", "service_tier", "modalities", "prediction", "reasoning_effort", "audio",
            "max_completion_tokens"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n"}


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Job:
    """A parsed request: what to feed, how to sample, how to answer."""

    chat: bool
    prompt: Any  # a string, or token ids (chat: ids from the template)
    max_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str = ""


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number; got {value!r}.", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low:g} and {high:g}; got {value!r}.", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: Any, low: int, high: int | None = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise BadRequest(f"'{name}' must be {bound}; got {value!r}.", name)
    return value


def _common(body: Any, allowed: set[str], default_max_tokens: int) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    unknown = sorted(set(body) - allowed - _COMMON - _IGNORED)
    if unknown:
        raise BadRequest(f"Unknown field(s): {', '.join(unknown)}.", unknown[0])
    n = _integer(body, "n", 1, 1)
    if n != 1:
        raise BadRequest("Only n=1 is supported: send one request per completion.", "n")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise BadRequest("'top_p' must be in (0, 1]; got 0.", "top_p")
    top_k = _integer(body, "top_k", 0, -1)
    top_k = 0 if top_k == -1 else top_k  # vLLM's -1 means off, as FlashSpec's 0
    seed = _integer(body, "seed", None, -(2**63), 2**64 - 1)
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    max_tokens = _integer({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of at most 4 of them.", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false; got {stream!r}.", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", "stream_options")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string.", "model")
    return dict(max_tokens=max_tokens, do_sample=temperature > 0.0, temperature=temperature if temperature > 0 else 1.0,
                top_p=top_p, top_k=top_k, seed=seed, stop=stop, stream=stream,
                include_usage=bool(options.get("include_usage", False)), model=model)


def parse_completion(body: Any, default_max_tokens: int = 16) -> Job:
    """``/v1/completions``: ``prompt`` is a string or one list of token ids."""
    common = _common(body, {"prompt"}, default_max_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty; give at least one token of text.", "prompt")
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise BadRequest("'prompt' is empty; give at least one token.", "prompt")
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request).", "prompt")
    return Job(chat=False, prompt=prompt, **common)


def parse_chat(body: Any, default_max_tokens: int = 256) -> Job:
    """``/v1/chat/completions``: ``messages`` as ``{"role", "content"}`` objects (text content)."""
    common = _common(body, {"messages"}, default_max_tokens)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role' string.", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content may only hold text parts.", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string.", "messages")
        clean.append({"role": m["role"], "content": content})
    return Job(chat=True, prompt=clean, **common)
