"""OpenAI request bodies, checked field by field (SPEC.md §12, "The server's limits, fields,
authentication and shutdown"): every bad value is an HTTP 400 with a sentence naming the field."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from .text import MAX_STOP_CHARS

__all__ = ["BadRequest", "Job", "ModelNotFound", "error_body", "parse_body", "parse_chat", "parse_completion"]

_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "n"}
# Accepted and not used: they do not change the answer (each with the type OpenAI gives it).
_UNUSED = {"user": str, "metadata": dict, "store": bool, "service_tier": str, "parallel_tool_calls": bool,
           "prediction": dict}
# Not supported: refused unless they hold the value that asks for nothing (null is always that).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},), "presence_penalty": (0,),
    "frequency_penalty": (0,), "echo": (False,), "suffix": ("",), "best_of": (1,),
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none", "auto"),
    "modalities": (["text"],), "reasoning_effort": (), "audio": (),
}
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "developer": "system"}


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(BadRequest):
    """A ``model`` this server does not serve: HTTP 404, as OpenAI answers it."""


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a value may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def parse_body(raw: bytes) -> Any:
    """The JSON value of a request body; :class:`BadRequest` for anything that is not JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRequest(f"The request body is not UTF-8 text ({error.reason} at byte {error.start}).") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise BadRequest("The request body is not valid JSON for this server: it is nested too deeply.") from None
    except ValueError as error:  # json.JSONDecodeError, or an integer of more than 4,300 digits
        raise BadRequest(f"The request body is not valid JSON: {str(error).split(';')[0]}.") from None


@dataclass
class Job:
    """A parsed request: what to feed, how to sample, how to answer."""

    chat: bool
    prompt: Any  # a string or token ids; chat: the messages, for the template
    max_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number; got {_show(value)}.", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low:g} and {high:g}; got {_show(value)}.", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: Any, low: int, high: int | None = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise BadRequest(f"'{name}' must be {bound}; got {_show(value)}.", name)
    return value


def _text(value: str, name: str) -> str:
    """``value`` unless it holds a lone surrogate (``"\\ud800"`` in JSON), which no tokenizer takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadRequest(f"'{name}' is not valid Unicode: it holds a lone surrogate ({error.object[error.start]!r} "
                         f"at character {error.start}).", name) from None
    return value


def _same(value: Any, neutral: Any) -> bool:
    """Whether ``value`` is ``neutral`` as JSON sees it (``0`` and ``0.0`` alike; ``false`` is not ``0``)."""
    if isinstance(neutral, numbers.Real) and not isinstance(neutral, bool):
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    """Refuse unknown fields, unsupported ones that ask for something, and ill-typed unused ones."""
    unknown = sorted(set(body) - allowed - _COMMON - set(_UNUSED) - set(_NEUTRAL))
    if unknown:
        raise BadRequest(f"Unknown field(s): {', '.join(unknown)}.", unknown[0])
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same(value, n) for n in neutral):
            raise BadRequest(f"'{name}' is not supported by this server; leave it out"
                             + (f" (or send {json.dumps(neutral[0])})" if neutral else "") + ".", name)
    for name, kind in _UNUSED.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise BadRequest(f"'{name}' must be {'an object' if kind is dict else 'a ' + kind.__name__}; "
                             f"got {_show(value)}.", name)


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of at most 4 of them.", "stop")
    longest = max(len(s) for s in stops) if stops else 0
    if longest > MAX_STOP_CHARS:
        raise BadRequest(f"A stop string may have at most {MAX_STOP_CHARS:,} characters; got one of {longest:,}.",
                         "stop")
    return [_text(s, "stop") for s in stops]


def _common(body: Any, allowed: set[str], default_max_tokens: int, models: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    _check_fields(body, allowed)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string; got {_show(model)}.", "model")
    if model is not None and models and model not in models:
        raise ModelNotFound(f"The model {_show(model)} is not served here; this server serves "
                            f"{', '.join(repr(m) for m in models)}.", "model")
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
    max_tokens = _integer(body, "max_tokens", None, 1)
    alias = _integer(body, "max_completion_tokens", None, 1)
    if max_tokens is not None and alias is not None and max_tokens != alias:
        raise BadRequest(f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({alias}) disagree; send one.",
                         "max_completion_tokens")
    max_tokens = max_tokens or alias or default_max_tokens
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false; got {_show(stream)}.", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest("'stream_options' must be an object with 'include_usage' only.", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest(f"'stream_options.include_usage' must be true or false; got {_show(include_usage)}.",
                         "stream_options")
    return dict(max_tokens=max_tokens, do_sample=temperature > 0.0, temperature=temperature if temperature > 0 else 1.0,
                top_p=top_p, top_k=top_k, seed=seed, stop=_stop(body), stream=stream, include_usage=include_usage)


def parse_completion(body: Any, default_max_tokens: int = 16, models: tuple[str, ...] = ()) -> Job:
    """``/v1/completions``: ``prompt`` is a string or one list of token ids. ``models``: the names
    ``model`` may give (empty: any)."""
    common = _common(body, {"prompt"}, default_max_tokens, models)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty; give at least one token of text.", "prompt")
        _text(prompt, "prompt")
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise BadRequest("'prompt' is empty; give at least one token.", "prompt")
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request).", "prompt")
    return Job(chat=False, prompt=prompt, **common)


def parse_chat(body: Any, default_max_tokens: int = 256, models: tuple[str, ...] = ()) -> Job:
    """``/v1/chat/completions``: ``messages`` as ``{"role", "content"}`` objects (text content);
    ``developer`` is passed to the template as ``system``."""
    common = _common(body, {"messages"}, default_max_tokens, models)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role' string.", "messages")
        extra = sorted(k for k, v in m.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise BadRequest(f"messages[{i}] has field(s) this server does not support: {', '.join(extra)} "
                             "(a message is a role and its content).", "messages")
        if m["role"] not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {_show(m['role'])}.",
                             "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       and set(p) == {"type", "text"} for p in content):
                raise BadRequest(f"messages[{i}].content may only hold text parts ({{type: text, text}}).",
                                 "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string.", "messages")
        clean.append({"role": ROLES[m["role"]], "content": _text(content, f"messages[{i}].content")})
    return Job(chat=True, prompt=clean, **common)
