"""``flashspec serve`` and the step-level batch API under it (SPEC.md §12), with the official
``openai`` client against a server started on loopback over a tiny random-weight model."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx  # the test extra installs the server's packages, the openai client and httpx: never skipped
import openai
import pytest
import torch
from chat_tokenizer import save_tiny_chat_pair
from tiny_models import noisy_copy, tiny_model

from flashspec import SpeculativeEngine
from flashspec.decode.batch import Batch, BatchFull
from flashspec.serve import build, default_warmup_lengths, start_server

PROMPTS = ["Hello world", "def f(x):", "a", "The quick brown fox jumps", "0123456789" * 3, "zz top"]


# ----------------------------------------------------------------------------- the step API
@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_rows_joining_and_leaving_match_generate(drafter):
    """Requests that join a running batch at different steps each equal their own offline
    ``generate`` (greedy, float32); a lone seeded sampled row equals ``generate(seed=...)``."""
    target = tiny_model("llama", seed=0)
    drafters = {"none": [], "ngram": ["ngram"], "model": [noisy_copy(target, 0.05, seed=1)]}[drafter]
    engine = SpeculativeEngine(target, drafters)
    prompts = [[(7 * i + j) % 128 for j in range(3 + 5 * i)] for i in range(6)]
    budgets = [20 + 3 * i for i in range(6)]
    expected = [engine.generate([p], max_new_tokens=n).sequences[0] for p, n in zip(prompts, budgets)]
    sampled = engine.generate([prompts[1]], max_new_tokens=25, do_sample=True, temperature=0.8, top_k=20,
                              seed=5).sequences[0]
    with engine.batch(slots=3, max_length=200) as batch:
        batch.warmup([1, 4])
        lone = batch.add(prompts[1], max_new_tokens=25, do_sample=True, temperature=0.8, top_k=20, seed=5)
        got = {lone: []}
        while batch.running:
            for u in batch.step():
                got[u.handle] += u.tokens
        assert got[lone] == sampled
        names, pending, step = {}, list(range(6)), 0
        while pending or batch.running:
            if pending and batch.free_slots and step % 2 == 0:  # join every other step
                i = pending.pop(0)
                h = batch.add(prompts[i], max_new_tokens=budgets[i])
                names[h], got[h] = i, []
            for u in batch.step():
                got[u.handle] += u.tokens
                if u.finished:
                    assert u.finish_reason == "length"
            step += 1
    assert all(got[h] == expected[i] for h, i in names.items())
    assert engine.generate([prompts[0]], max_new_tokens=5).sequences[0] == expected[0][:5]  # usable again


def test_after_its_warm_up_a_compiled_batch_compiles_nothing_for_requests_of_new_lengths():
    """compile=True (SPEC.md §3, §12): the warm-up compiles the step's shapes; requests whose
    prompt lengths it never saw (short ones within the compiled widths, and longer ones) then
    compile nothing — prefills run eagerly — and still equal their own ``generate``."""
    from torch._dynamo.utils import counters

    target = tiny_model("llama", seed=0)
    engine = SpeculativeEngine(target, [noisy_copy(target, 0.05, seed=1), "ngram"], compile=True, device="cpu")
    prompts = [[(3 * i + j) % 128 for j in range(n)] for i, n in enumerate((5, 9, 14, 23))]
    expected = [engine.generate([p], max_new_tokens=6).sequences[0] for p in prompts]
    with engine.batch(slots=2, max_length=64) as batch:
        batch.warmup([1])
        graphs = counters["stats"]["unique_graphs"]
        got = {}
        for i, prompt in enumerate(prompts):
            handle = batch.add(prompt, max_new_tokens=6)
            got[handle] = [i, []]
            while batch.running:
                for u in batch.step():
                    got[u.handle][1] += u.tokens
        assert counters["stats"]["unique_graphs"] == graphs
    assert all(tokens == expected[i] for i, tokens in got.values())


def test_flush_hands_out_a_joining_requests_first_token_at_once():
    """``Batch.flush`` after ``add`` hands out the token drawn at the join (no step runs), ends a
    request that finished there, and changes nothing that the following steps hand out."""
    engine = SpeculativeEngine(tiny_model("llama", seed=0), ["ngram"])
    first, second = [5, 6, 7, 8], [9, 1, 2]
    expected = engine.generate([first], max_new_tokens=12).sequences[0]
    alone = engine.generate([second], max_new_tokens=1).sequences[0]
    with engine.batch(slots=2, max_length=64) as batch:
        a = batch.add(first, max_new_tokens=12)
        (update,) = batch.flush()
        assert update.handle == a and update.tokens == expected[:1] and not update.finished
        (again,) = batch.flush()
        assert again.tokens == [] and not again.finished  # nothing new without a step
        got = list(update.tokens)
        for u in batch.step():
            got += u.tokens
        b = batch.add(second, max_new_tokens=1)  # ends at its prefill: flush finishes it
        updates = {u.handle: u for u in batch.flush()}
        assert updates[b].finished and updates[b].finish_reason == "length" and updates[b].tokens == alone
        assert updates[a].tokens == [] and batch.free_slots == 1
        while batch.running:
            for u in batch.step():
                got += u.tokens
    assert got == expected


def test_batch_cancel_frees_the_slot_and_rejects_bad_requests():
    engine = SpeculativeEngine(tiny_model("llama", seed=0), ["ngram"])
    with engine.batch(slots=1, max_length=64) as batch:
        h = batch.add([1, 2, 3], max_new_tokens=40)
        with pytest.raises(BatchFull):
            batch.add([4, 5], max_new_tokens=4)
        batch.step()
        assert batch.cancel(h) and batch.free_slots == 1 and not batch.cancel(h)
        with pytest.raises(ValueError, match="maximum length of 64"):
            batch.add([1] * 60, max_new_tokens=10)
        with pytest.raises(ValueError, match="top_p"):
            batch.add([1], max_new_tokens=3, do_sample=True, top_p=0.0)
        with pytest.raises(ValueError, match="empty"):
            batch.add([], max_new_tokens=3)
        h = batch.add([4, 5], max_new_tokens=1)  # finishes at its prefill
        (update,) = batch.step()
        assert update.finished and len(update.tokens) == 1 and batch.free_slots == 1


# ----------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target, draft = save_tiny_chat_pair(tmp_path_factory.mktemp("pair"))
    # selector="fixed": seeded samples are compared bit for bit, and under the default "auto" which
    # arm runs depends on measured time (SPEC.md §8); the default configuration has its own test below.
    reference = SpeculativeEngine(str(target), [str(draft)], selector="fixed")
    server = start_server(SpeculativeEngine(str(target), [str(draft)], selector="fixed"), slots=4, max_length=200,
                          max_queue=8)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    yield server, client, reference
    server.stop()


@pytest.mark.default_configuration
def test_the_default_configuration_serves_greedy_requests_equal_to_generate(tmp_path):
    """A server over an engine with the default selector ("auto": the target-only arm and the
    never-slower guard over the running batch): concurrent greedy requests equal offline
    ``generate``, and the per-arm selections metric counts the target-only arm."""
    target, draft = save_tiny_chat_pair(tmp_path)
    engine = SpeculativeEngine(str(target), [str(draft), "ngram"])
    assert engine.target_only_arm is not None
    reference = SpeculativeEngine(str(target), [])
    prompts = PROMPTS[:4]
    expected = [reference.generate(p, max_new_tokens=24).text[0] for p in prompts]
    server = start_server(engine, slots=2, max_length=200, max_queue=8)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.completions.create(model="flashspec", prompt=p, max_tokens=24,
                                                                    temperature=0).choices[0].text, prompts))
        assert got == expected
        assert _metric(server, 'flashspec_arm_selections_total{arm="target@0"}') >= 1
    finally:
        server.stop()


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _stream_text(stream, chat: bool = False) -> tuple[str, str | None]:
    parts, reason = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        parts.append((choice.delta.content if chat else choice.text) or "")
        reason = choice.finish_reason or reason
    return "".join(parts), reason


def test_concurrent_greedy_requests_equal_generate(served):
    server, client, reference = served
    budgets = [12, 30, 7, 25, 40, 18]
    expected = [reference.generate(p, max_new_tokens=n).text[0] for p, n in zip(PROMPTS, budgets)]

    def one(i):
        time.sleep(0.03 * i)  # arrive while others are decoding
        if i % 2:
            return _stream_text(client.completions.create(model="flashspec", prompt=PROMPTS[i], max_tokens=budgets[i],
                                                          temperature=0, stream=True))
        r = client.completions.create(model="flashspec", prompt=PROMPTS[i], max_tokens=budgets[i], temperature=0)
        assert r.usage.completion_tokens == budgets[i]
        return r.choices[0].text, r.choices[0].finish_reason

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    assert [t for t, _ in results] == expected
    assert all(reason == "length" for _, reason in results)


def test_chat_uses_the_template(served):
    server, client, reference = served
    messages = [{"role": "user", "content": "hi there"}]
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected = reference.generate([list(ids)], max_new_tokens=15).text[0]
    r = client.chat.completions.create(model="flashspec", messages=messages, max_tokens=15, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="flashspec", messages=messages, max_tokens=15, temperature=0, stream=True)
    assert _stream_text(stream, chat=True) == (expected, "length")


def test_seeded_sampling_is_reproducible(served):
    server, client, reference = served
    kwargs = dict(model="flashspec", prompt="Once upon", max_tokens=30, temperature=0.9, top_p=0.95, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    second = _stream_text(client.completions.create(stream=True, **kwargs))[0]
    assert first == second
    # Alone in the batch, a seeded row draws exactly what generate(seed=...) draws.
    offline = reference.generate("Once upon", max_new_tokens=30, do_sample=True, temperature=0.9, top_p=0.95,
                                 seed=1234).text[0]
    assert first == offline
    other = client.completions.create(**{**kwargs, "seed": 99}).choices[0].text
    assert other != first


def test_stop_strings(served):
    server, client, reference = served
    full = reference.generate("def f(x):", max_new_tokens=30).text[0]
    stop = full[10:12]
    cut = full[: full.find(stop)]
    r = client.completions.create(model="flashspec", prompt="def f(x):", max_tokens=30, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    stream = client.completions.create(model="flashspec", prompt="def f(x):", max_tokens=30, temperature=0, stop=stop,
                                       stream=True)
    assert _stream_text(stream) == (cut, "stop")


def test_usage_and_metrics_count_only_the_tokens_returned_at_a_stop_string(served):
    """At a stop string ``usage.completion_tokens`` (and the generated-token metric) counts the
    tokens of the text returned, as OpenAI does: not the stop string's own tokens, nor those a
    step drafted past it."""
    server, client, reference = served
    out = reference.generate("def f(x):", max_new_tokens=30)
    ids, full = out.sequences[0], out.text[0]
    stop = full[10:12]
    cut = full[: full.find(stop)]
    decoded = [len(reference.tokenizer.decode(ids[:k], skip_special_tokens=True)) for k in range(len(ids) + 1)]
    expected = next(k for k, n in enumerate(decoded) if n >= len(cut))  # the fewest tokens that hold it
    assert expected < next(k for k, n in enumerate(decoded) if n >= len(cut) + len(stop))  # nor the stop's own
    before = _metric(server, "flashspec_generated_tokens_total")
    r = client.completions.create(model="flashspec", prompt="def f(x):", max_tokens=30, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (expected, r.usage.prompt_tokens + expected)
    chunks = list(client.completions.create(model="flashspec", prompt="def f(x):", max_tokens=30, temperature=0,
                                            stop=[stop], stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert chunks[-1].usage.completion_tokens == expected
    assert _metric(server, "flashspec_generated_tokens_total") == before + 2 * expected


@pytest.mark.parametrize("body, words", [
    ({"prompt": "hi", "max_tokens": 4, "bogus": 1}, "Unknown field"),
    ({"prompt": "hi", "n": 2}, "n=1"),
    ({"prompt": ""}, "empty"),
    ({"prompt": [], "max_tokens": 3}, "empty"),
    ({"prompt": "hi", "max_tokens": 500}, "context window"),
    ({"prompt": "hi", "max_tokens": 220}, "maximum length of 200"),
    ({"prompt": "hi", "temperature": 5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
])
def test_bad_requests_get_400(served, body, words):
    server, client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="flashspec", **{k: v for k, v in body.items() if k in ("prompt",)},
                                  extra_body={k: v for k, v in body.items() if k != "prompt"})
    error = caught.value.body
    assert words in error["message"] and error["type"] == "invalid_request_error"
    raw = httpx.post(server.url + "/v1/chat/completions", content=b"{not json")
    assert raw.status_code == 400 and "JSON" in raw.json()["error"]["message"]


def test_disconnect_cancels_and_frees_rows(served, monkeypatch):
    from flashspec.decode.batch import Batch

    server, client, _ = served
    before = _metric(server, 'flashspec_requests_total{outcome="cancelled"}')
    step = Batch.step
    # slow steps, in whichever batch the scheduler runs now: the client leaves mid-request
    # (0.2 s a step: with its drafts accepted the request takes ~36 steps, several seconds)
    monkeypatch.setattr(Batch, "step", lambda self: (time.sleep(0.2), step(self))[1])
    _leave_early(server)
    monkeypatch.undo()
    assert _metric(server, 'flashspec_requests_total{outcome="cancelled"}') == before + 1


def _leave_early(server):
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "Hello", "max_tokens": 180, "temperature": 0, "stream": True}) as response:
        for _ in response.iter_lines():
            break
        deadline = time.time() + 10  # the request may join the batch after its first line (a busy machine)
        while httpx.get(server.url + "/health").json()["running"] != 1 and time.time() < deadline:
            time.sleep(0.02)
        assert httpx.get(server.url + "/health").json()["running"] == 1
    deadline = time.time() + 10
    while httpx.get(server.url + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["running"] == 0


def test_full_queue_gets_429_and_the_server_keeps_serving(tmp_path):
    engine = SpeculativeEngine(tiny_model("llama", seed=0), [])
    engine.tokenizer = __import__("tiny_models").CharTokenizer()
    server = start_server(engine, slots=1, max_length=220, max_queue=1)
    try:
        statuses, headers = [], []
        lock = threading.Lock()

        def one(_):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": "abc", "max_tokens": 200, "temperature": 0})
            with lock:
                statuses.append(r.status_code)
                headers.append(r.headers.get("retry-after"))

        # One request holds the only slot before the others come, so exactly one more can wait
        # (without it, on a busy machine all six could meet the queue before the slot takes one).
        with ThreadPoolExecutor(6) as pool:
            first = pool.submit(one, 0)
            deadline = time.time() + 30
            while httpx.get(server.url + "/health").json()["running"] != 1 and time.time() < deadline:
                time.sleep(0.01)
            list(pool.map(one, range(5)))
            first.result()
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1 and set(statuses) <= {200, 429}
        assert all(h == "1" for s, h in zip(statuses, headers) if s == 429)
        assert _metric(server, 'flashspec_requests_total{outcome="rejected"}') == statuses.count(429)
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3})
        assert ok.status_code == 200
    finally:
        server.stop()


def test_start_up_warms_the_http_path_and_the_metrics_count_no_request_of_it():
    engine = SpeculativeEngine(tiny_model("llama", seed=0), [])
    engine.tokenizer = __import__("tiny_models").CharTokenizer()
    server = start_server(engine, slots=1, max_length=64)
    try:
        assert server.scheduler.batch._next_handle == 3  # Batch.warmup's request, then a completion and a stream
        for name in ("flashspec_requests_total", "flashspec_prompt_tokens_total", "flashspec_generated_tokens_total",
                     "flashspec_time_to_first_token_seconds_count"):
            assert _metric(server, name) == 0, name
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == 3
        assert _metric(server, "flashspec_generated_tokens_total") == 3
        assert _metric(server, 'flashspec_requests_total{outcome="ok"}') == 1
    finally:
        server.stop()


def test_start_up_freezes_the_heap_and_stop_unfreezes_it():
    """SPEC.md §12: once warm, the server moves what start-up left alive out of the collector's
    sight (no oldest-generation pass walks it inside a request); stopping gives it back."""
    import gc

    engine = SpeculativeEngine(tiny_model("llama", seed=0), [])
    engine.tokenizer = __import__("tiny_models").CharTokenizer()
    gc.unfreeze()
    server = start_server(engine, slots=1, max_length=64)
    try:
        assert gc.get_freeze_count() > 10_000  # the models, the engine, the server: all frozen
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == 3  # and it serves
    finally:
        server.stop()
    assert gc.get_freeze_count() == 0


SHORT = tuple(range(1, 17))  # the compiled widths (StaticLM.COMPILED_WIDTHS = 16)
HALVES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072)


@pytest.mark.parametrize("device, compile, max_length, expected", [
    ("cpu", False, 2, (1,)), ("cpu", False, 500, (1,)), ("cpu", False, 4096, (1,)),
    ("cpu", True, 4, (1, 2)), ("cpu", True, 18, SHORT), ("cpu", True, 500, SHORT), ("cpu", True, 4096, SHORT),
    ("cuda", False, 2, (1,)), ("cuda", True, 2, (1,)),
    ("cuda", False, 4, (1, 2)), ("cuda", True, 4, (1, 2)),
    ("cuda", False, 18, (1, 2, 3, 4, 6, 8, 12, 16)), ("cuda", True, 18, SHORT),
    ("cuda", True, 20, SHORT + (18,)),
    ("cuda", True, 130, SHORT + (24, 32, 48, 64, 96, 128)),
    ("cuda", True, 131, SHORT + (24, 32, 48, 64, 96, 128, 129)),
    ("cuda", False, 500, (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 498)),
    ("cuda", True, 500, SHORT + (24, 32, 48, 64, 96, 128, 192, 256, 384, 498)),
    ("cuda", True, 4096, SHORT + HALVES[8:] + (4094,)),
    ("cuda", False, 4096, HALVES + (4094,)),
])
def test_default_warmup_lengths_cover_every_prefill_size_class_on_cuda_and_stay_short_on_a_cpu(
        device, compile, max_length, expected):
    """SPEC.md §12: on CUDA the warm-up also prefills every power of two and midpoint between two,
    clamped to the longest warm-up prompt (``max_length - 2``) and each run once; on a CPU it
    stays at the compiled widths (compile) or one length."""
    got = default_warmup_lengths(device, compile, max_length)
    assert got == expected
    assert list(got) == sorted(set(got)) and all(1 <= n <= max(1, max_length - 2) for n in got)


def test_default_warmup_lengths_refuse_a_max_length_no_batch_has():
    for bad in (1, 0, True, 4.0):
        with pytest.raises(ValueError, match="max_length must be an integer >= 2"):
            default_warmup_lengths("cuda", True, bad)


def _char_engine():
    engine = SpeculativeEngine(tiny_model("llama", seed=0), [], device="cpu")
    engine.tokenizer = __import__("tiny_models").CharTokenizer()
    return engine


def test_build_warms_up_the_default_lengths_unless_it_is_given_its_own(monkeypatch):
    """build() with no ``warmup_lengths`` warms the batch with default_warmup_lengths(target
    device, compile, the batch's max_length) — here forced to the CUDA list, so that long prefills
    really run (on the CPU, tiny model) — also when max_length is left to the model's window
    (256); explicit lengths override it, clamped to ``max_length - 2`` and each run once."""
    from flashspec.serve import server as serve

    calls, warmed = [], []
    real = serve.default_warmup_lengths

    def spy(device_type, compile, max_length):
        calls.append((device_type, compile, max_length))
        return real("cuda", compile, max_length)

    real_warmup = Batch.warmup

    def warmup(self, prompt_lengths=(1,)):
        warmed.append(tuple(prompt_lengths))
        return real_warmup(self, prompt_lengths)

    monkeypatch.setattr(serve, "default_warmup_lengths", spy)
    monkeypatch.setattr(Batch, "warmup", warmup)
    engine = _char_engine()
    for max_length, window in ((64, 64), (None, 256)):
        scheduler, _ = build(engine, slots=1, max_length=max_length)
        try:
            assert scheduler.batch.max_length == window
            expected = real("cuda", False, window)
            assert calls[-1] == ("cpu", False, window) and warmed[-1] == expected == scheduler.warmed_lengths
            assert expected[-1] == window - 2 and {24, 32, 48} <= set(expected)
        finally:
            scheduler.stop()
    calls.clear()
    scheduler, _ = build(engine, slots=1, max_length=64, warmup_lengths=(5, 300, 1, 400, 5))
    try:
        assert calls == [] and warmed[-1] == (5, 62, 1) == scheduler.warmed_lengths
    finally:
        scheduler.stop()


@pytest.mark.parametrize("lengths, words", [((), "is empty"), ([], "is empty"), ((0,), "at least 1 token"),
                                            ((4, -3), "got -3"), ((2.5,), "got 2.5"), ((True,), "got True"),
                                            (7, "must be a list"), ("16", "must be a list")])
def test_build_refuses_empty_or_non_positive_warmup_lengths(lengths, words):
    with pytest.raises(ValueError, match=words):
        build(_char_engine(), slots=1, max_length=64, warmup_lengths=lengths)


def test_models_health_and_metrics_move(served):
    server, client, _ = served
    assert [m.id for m in client.models.list().data] == ["flashspec"]
    ok, generated = (_metric(server, n) for n in ('flashspec_requests_total{outcome="ok"}',
                                                  "flashspec_generated_tokens_total"))
    client.completions.create(model="flashspec", prompt="metrics", max_tokens=9, temperature=0)
    assert _metric(server, 'flashspec_requests_total{outcome="ok"}') == ok + 1
    assert _metric(server, "flashspec_generated_tokens_total") == generated + 9
    text = httpx.get(server.url + "/metrics").text
    for name in ("flashspec_acceptance_rate", "flashspec_mean_accepted_tokens_per_step", "flashspec_arm_selections_total",
                 "flashspec_queue_depth", "flashspec_running_batch_size", "flashspec_time_to_first_token_seconds_bucket",
                 "flashspec_inter_token_latency_seconds_bucket", "flashspec_prompt_tokens_total"):
        assert name in text
    assert _metric(server, "flashspec_time_to_first_token_seconds_count") >= 1
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_serve_is_a_command():
    from flashspec.cli import _parser

    args = _parser().parse_args(["serve", "--target", "x", "--draft", "ngram", "--port", "9"])
    assert args.port == 9 and args.draft == ["ngram"] and callable(args.run)
    assert torch.__version__  # (the engine itself is exercised above)


def test_batch_slots_default_to_eight_on_a_gpu_and_one_elsewhere(capsys):
    """SPEC.md §12: on a CPU every slot costs about what a request does, occupied or not."""
    from flashspec.cli import _parser, main
    from flashspec.serve.server import default_slots

    assert default_slots("cuda") == 8 and default_slots(torch.device("cuda", 0)) == 8
    assert default_slots("cpu") == 1 and default_slots("mps") == 1
    assert _parser().parse_args(["serve", "--target", "x"]).max_batch is None  # chosen once the device is known
    assert _parser().parse_args(["serve", "--target", "x", "--max-batch", "4"]).max_batch == 4
    for bad in ("0", "2000"):  # refused before any model loads
        assert main(["serve", "--target", "/nonexistent", "--max-batch", bad]) == 2
        assert "--max-batch must be an integer from 1 to 1024" in capsys.readouterr().err


def test_the_server_asks_cuda_to_load_its_modules_eagerly_unless_told_otherwise(monkeypatch):
    """SPEC.md §12, "Prefill widths": with lazy loading, prefill widths the warm-up ran still
    paid on their first request on the H200."""
    from flashspec.serve import load_cuda_modules_eagerly

    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    load_cuda_modules_eagerly()
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    load_cuda_modules_eagerly()
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"
