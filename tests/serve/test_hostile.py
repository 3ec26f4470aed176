"""Hostile and malformed requests to ``flashspec serve`` (SPEC.md §12, "The server's limits,
fields, authentication and shutdown"): every one gets an OpenAI-style error (never a 500 or a
field silently ignored), and none holds up the other clients."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from chat_tokenizer import save_tiny_chat_pair
from tiny_models import CharTokenizer, tiny_model

from flashspec import SpeculativeEngine
from flashspec.serve import start_server
from flashspec.serve.text import MAX_STOP_CHARS

MB = 1 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target, _ = save_tiny_chat_pair(tmp_path_factory.mktemp("pair"))
    server = start_server(SpeculativeEngine(str(target), ["ngram"]), slots=2, max_length=200, max_queue=4,
                          model_aliases=("alias",))
    yield server
    server.stop()


def _post(server, body=None, route="completions", **options):
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60, **options)


def _refused(response, status: int = 400, words: str = "", param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error


class Watch:
    """Polls ``/health`` from a thread while something else runs; ``worst`` is its slowest answer."""

    def __init__(self, server):
        self.url, self.times, self.statuses = server.url + "/health", [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                began = time.perf_counter()
                self.statuses.append(client.get(self.url).status_code)
                self.times.append(time.perf_counter() - began)
                time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def worst(self) -> float:
        return max(self.times)


# ----------------------------------------------------------------------------- size and cost
def test_a_20_mb_body_gets_413_before_it_is_read_and_health_answers_within_a_second(served):
    with Watch(served) as watch:
        big = _post(served, {"prompt": "a" * (20 * MB), "max_tokens": 4})
        ignored = _post(served, {"prompt": "hi", "max_tokens": 4, "user": "u" * (20 * MB)})
        chunked = _post(served, content=(b"x" * 65536 for _ in range(40)))  # no Content-Length
    for response in (big, ignored, chunked):
        assert _refused(response, 413, "1,048,576 bytes")["code"] == "request_too_large"
    assert watch.times and watch.worst < 1.0 and set(watch.statuses) == {200}
    assert _post(served, {"prompt": "hi", "max_tokens": 4}).status_code == 200  # and it serves


class SlowTokenizer(CharTokenizer):
    """Two seconds for a long text (time.sleep releases the GIL, as a fast tokenizer does): on
    the event loop it would hold every other client for those two seconds."""

    chat_template = None

    def __call__(self, text):
        if len(text) > 10_000:
            time.sleep(2.0)
        return super().__call__(text)


def test_a_big_prompt_is_tokenized_off_the_event_loop():
    engine = SpeculativeEngine(tiny_model("llama", seed=0), [])
    engine.tokenizer = SlowTokenizer()
    server = start_server(engine, slots=2, max_length=250, max_body_bytes=8 * MB)
    try:
        gaps, result = [], {}

        def stream():
            last = None
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                              json={"prompt": "abc", "max_tokens": 240, "temperature": 0, "stream": True}) as r:
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if last is not None and line:
                        gaps.append(now - last)
                    last = now

        reader = threading.Thread(target=stream)
        with Watch(server) as watch:
            reader.start()
            time.sleep(0.2)
            began = time.perf_counter()
            result["big"] = _post(server, {"prompt": "a" * (4 * MB), "max_tokens": 4})
            result["seconds"] = time.perf_counter() - began
            reader.join()
        _refused(result["big"], 400, "maximum length of 250")
        assert result["seconds"] >= 2.0  # it was tokenized (slowly) ...
        assert watch.worst < 1.0 and len(watch.times) >= 10  # ... while /health kept answering
        assert gaps and max(gaps) < 1.0  # and the other stream kept flowing
    finally:
        server.stop()


@pytest.mark.parametrize("content, words", [
    (b"[" * 10_000 + b"]" * 10_000, "nested too deeply"),
    (b'{"prompt": "hi", "seed": ' + b"9" * 5_000 + b"}", "not valid JSON"),
    (b'{"prompt": "\\ud800 lone", "max_tokens": 2}', "lone surrogate"),
    (b'{"prompt": "hi", "stop": ["\\udfff"]}', "lone surrogate"),
    (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"prompt": "hi", "seed": ' + b"9" * 4_000 + b"}", "'seed' must be an integer"),
    (b'{"prompt": "hi", "max_tokens": 3, "max_completion_tokens": 4}', "disagree"),
    (b'{"prompt": "hi", "stream_options": {"include_usage": "yes"}}', "include_usage"),
    (b'{"prompt": "hi", "stream_options": {"include_obfuscation": false}}', "'include_usage' only"),
])
def test_malformed_bodies_get_400_never_500(served, content, words):
    _refused(_post(served, content=content), 400, words)


def test_a_chat_message_with_a_lone_surrogate_gets_400(served):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    raw = httpx.Request("POST", "/", json=body).content.replace(b'"x"', b'"\\udc00"')
    _refused(_post(served, route="chat/completions", content=raw), 400, "lone surrogate", "messages[0].content")


def test_stop_strings_are_capped_in_number_and_length(served):
    _refused(_post(served, {"prompt": "hi", "stop": ["x" * (MAX_STOP_CHARS + 1)]}), 400, "at most 10,000", "stop")
    _refused(_post(served, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}), 400, "at most 4", "stop")
    plain = _post(served, {"prompt": "hi", "max_tokens": 30, "temperature": 0}).json()["choices"][0]["text"]
    longest = _post(served, {"prompt": "hi", "max_tokens": 30, "temperature": 0,
                             "stop": ["\x01" * MAX_STOP_CHARS] * 4}).json()["choices"][0]
    assert (longest["text"], longest["finish_reason"]) == (plain, "length")  # never matches: the whole text


# ----------------------------------------------------------------------------- fields
@pytest.mark.parametrize("route, field, value", [
    ("completions", "logprobs", 1), ("chat/completions", "logprobs", True), ("chat/completions", "top_logprobs", 2),
    ("completions", "logit_bias", {"5": -100}), ("completions", "presence_penalty", 0.5),
    ("chat/completions", "frequency_penalty", 1), ("completions", "echo", True), ("completions", "suffix", "x"),
    ("completions", "best_of", 2), ("chat/completions", "response_format", {"type": "json_object"}),
    ("chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat/completions", "tool_choice", "required"), ("chat/completions", "reasoning_effort", "low"),
    ("chat/completions", "audio", {"voice": "x"}), ("chat/completions", "modalities", ["text", "audio"]),
])
def test_unsupported_fields_are_refused_naming_the_field(served, route, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat") else {"prompt": "hi"}
    _refused(_post(served, {**body, "max_tokens": 2, field: value}, route), 400, f"'{field}' is not supported", field)


def test_neutral_values_and_unused_fields_are_accepted(served):
    neutral = {"logprobs": False, "top_logprobs": 0, "logit_bias": {}, "presence_penalty": 0,
               "frequency_penalty": 0.0, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
               "modalities": ["text"], "reasoning_effort": None, "audio": None, "user": "u", "metadata": {"k": "v"},
               "store": False, "service_tier": "auto", "parallel_tool_calls": True, "prediction": None}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    assert _post(served, {**body, **neutral}, "chat/completions").json() \
        ["choices"][0]["message"]["content"] == _post(served, body, "chat/completions").json() \
        ["choices"][0]["message"]["content"]
    for field in ("echo", "suffix", "best_of"):
        value = {"echo": False, "suffix": "", "best_of": 1}[field]
        assert _post(served, {"prompt": "hi", "max_tokens": 2, field: value}).status_code == 200
    _refused(_post(served, {"prompt": "hi", "user": 5}), 400, "'user' must be a str", "user")


@pytest.mark.parametrize("message, words", [
    ({"role": "tool", "content": "x"}, "role must be one of"), ({"role": "robot", "content": "x"}, "got 'robot'"),
    ({"role": "user", "content": "x", "name": "bob"}, "does not support: name"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "only hold text parts"),
])
def test_unknown_chat_roles_and_keys_get_400(served, message, words):
    _refused(_post(served, {"messages": [message], "max_tokens": 2}, "chat/completions"), 400, words, "messages")


def test_developer_is_system(served):
    def answer(role):
        body = {"messages": [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}],
                "max_tokens": 8, "temperature": 0}
        return _post(served, body, "chat/completions").json()["choices"][0]["message"]["content"]

    assert answer("developer") == answer("system")


def test_a_chat_template_that_raises_is_a_400():
    from flashspec.serve.app import _prompt_ids
    from flashspec.serve.protocol import BadRequest, Job

    class Strict:
        chat_template = "..."

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("Conversation roles must alternate user/assistant")

    job = Job(chat=True, prompt=[{"role": "user", "content": "a"}], max_tokens=2, do_sample=False, temperature=1.0,
              top_p=1.0, top_k=0, seed=None)
    with pytest.raises(BadRequest, match="chat template refused these messages: Conversation roles must alternate"):
        _prompt_ids(Strict(), job)


def test_the_model_must_be_the_served_name_or_an_alias(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["flashspec"]
    for name in ("flashspec", "alias"):
        assert client.completions.create(model=name, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert _post(served, {"prompt": "hi", "max_tokens": 2}).status_code == 200  # left out: the served model
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found" and "'flashspec', 'alias'" in caught.value.body["message"]


def test_unknown_paths_methods_and_failures_answer_with_openai_error_objects(served, monkeypatch):
    assert _refused(httpx.get(served.url + "/v1/nothing"), 404)["type"] == "not_found_error"
    _refused(httpx.get(served.url + "/v1/completions"), 405, "Method Not Allowed")

    def broken(*args, **kwargs):
        raise KeyError("unexpected")

    monkeypatch.setattr(served.scheduler, "check", broken)
    assert _refused(_post(served, {"prompt": "hi", "max_tokens": 2}), 500, "KeyError")["type"] == "server_error"


# ----------------------------------------------------------------------------- the API key
def test_with_an_api_key_every_route_but_health_needs_it():
    engine = SpeculativeEngine(tiny_model("llama", seed=0), [])
    engine.tokenizer = CharTokenizer()
    server = start_server(engine, slots=1, max_length=64, api_key="sekret")
    try:
        body = {"prompt": "abc", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for method, route in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                  ("GET", "/v1/models"), ("GET", "/metrics")):
                response = httpx.request(method, server.url + route, json=body, headers=headers)
                assert _refused(response, 401, "API key")["code"] == "invalid_api_key"
                assert response.headers["www-authenticate"] == "Bearer"
        assert httpx.get(server.url + "/health").status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        assert client.completions.create(model="flashspec", prompt="abc", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert 'flashspec_requests_total{outcome="unauthorized"} 12.0' in \
            httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer sekret"}).text
    finally:
        server.stop()


def test_the_command_takes_the_key_from_the_environment_and_checks_its_limits(monkeypatch):
    from flashspec.cli import _parser
    from flashspec.cli.serve import _options

    parse = _parser().parse_args
    monkeypatch.setenv("FLASHSPEC_API_KEY", "from-env")
    assert _options(parse(["serve", "--target", "x"]))["api_key"] == "from-env"
    assert _options(parse(["serve", "--target", "x", "--api-key", "flag"]))["api_key"] == "flag"
    monkeypatch.delenv("FLASHSPEC_API_KEY")
    assert _options(parse(["serve", "--target", "x"])) == {"api_key": None, "max_body_bytes": MB}
    for flags, words in ((["--max-body-bytes", "0"], "max-body-bytes"), (["--read-timeout", "0"], "read-timeout"),
                         (["--shutdown-grace", "-1"], "shutdown-grace"), (["--api-key", " "], "empty")):
        with pytest.raises(ValueError, match=words):
            _options(parse(["serve", "--target", "x", *flags]))
