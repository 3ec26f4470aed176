"""``flashspec bench serve``: a bounded load test of ``flashspec serve`` on loopback (SPEC.md §12).

The server runs in this process (:func:`flashspec.serve.start_server`, a free port) and the
official ``openai`` client (``AsyncOpenAI``) talks to it over HTTP. Phases, in this order:

1. **TTFT** on the fresh server: for each of a few prompt lengths, the first request of that
   length after start-up against warm repeats of the same request (goal: within 10 %), timed by
   the client and by the server's own metrics; the client's streaming path is run once first
   against an in-memory transport, so that its one-time costs are not counted as the server's.
2. **Load**: ``clients`` concurrent streaming clients send ``requests`` requests of mixed prompt
   lengths, ``max_tokens`` and sampling (half greedy, half ``temperature=0.7, top_p=0.9`` with
   a seed), completions and chat; client-side TTFT / inter-token latency, throughput.
3. **Sequential**: the first ``sequential`` of the same requests one at a time (throughput ratio).
4. **Burst**: a second server with a small queue gets ``burst`` non-streaming requests at once:
   429/503 count, other errors, ``/health`` afterwards, peak RSS (of this process: server,
   clients and engine share it).
5. **Offline check**: with the servers stopped, ``engine.generate`` of every greedy prompt (same
   engine, same settings); each greedy stream must equal it — text and token count.

Prompts come from the corpus' held-out text (:func:`~flashspec.data.corpus.heldout_text`) or,
when the corpus is missing, from a fixed word list (the results say which).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..data.corpus import CHAT_INSTRUCTIONS, DOMAINS, _chat_ids, heldout_text
from .results import write_results

__all__ = ["WORDS", "check_options", "make_workload", "run", "summarize", "write"]

WORDS = ("the", "model", "server", "token", "request", "batch", "stream", "client", "latency", "queue", "cache",
         "draft", "verify", "accept", "reject", "prompt", "length", "sample", "greedy", "seed", "python", "def",
         "return", "for", "while", "if", "else", "value", "list", "dict", "river", "mountain", "city", "story",
         "reader", "author", "question", "answer", "because", "when", "after", "before", "small", "large")


def _positive_int(name: str, value: Any, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}.")


def check_options(*, clients: int, requests: int, sequential: int, min_tokens: int, max_tokens: int,
                  prompt_lengths: tuple[int, ...], slots: int, max_length: int, max_queue: int, burst: int,
                  ttft_lengths: tuple[int, ...], ttft_repeats: int, ttft_tokens: int, timeout_s: float) -> None:
    """Raise a ValueError for anything that would fail later (before the model is loaded)."""
    for name, value, low in (("clients", clients, 1), ("requests", requests, 1), ("sequential", sequential, 0),
                             ("min_tokens", min_tokens, 1), ("max_tokens", max_tokens, 1), ("slots", slots, 1),
                             ("max_length", max_length, 2), ("max_queue", max_queue, 0), ("burst", burst, 1),
                             ("ttft_repeats", ttft_repeats, 1), ("ttft_tokens", ttft_tokens, 2)):
        _positive_int(name, value, low)
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).")
    if sequential > requests:
        raise ValueError(f"sequential ({sequential}) must not exceed requests ({requests}).")
    if burst <= max_queue + slots:
        raise ValueError(f"The burst ({burst}) must exceed max_queue + slots ({max_queue} + {slots}) "
                         "so that some requests find the queue full.")
    if not prompt_lengths or not ttft_lengths:
        raise ValueError("Give at least one prompt length (--prompt-lengths) and one TTFT length (--ttft-lengths).")
    for name, lengths, extra in (("prompt_lengths", prompt_lengths, max_tokens + 64),
                                 ("ttft_lengths", ttft_lengths, ttft_tokens)):
        for n in lengths:
            _positive_int(name, n)
            if n + extra > max_length:
                raise ValueError(f"A prompt of {n} tokens plus {extra} (new tokens, and chat template room) "
                                 f"exceeds max_length {max_length}; raise --max-length or shorten {name}.")
    if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a number > 0; got {timeout_s!r}.")


# ----------------------------------------------------------------------------- workload
def _texts(corpus: Path | None) -> tuple[dict[str, str], str]:
    """Held-out text per domain, or a fixed word list when the corpus is missing."""
    if corpus is not None and all((Path(corpus) / f).is_file() for f in DOMAINS.values()):
        return {d: heldout_text(Path(corpus), d) for d in DOMAINS}, "corpus held-out text"
    rng = random.Random(0)
    words = " ".join(rng.choice(WORDS) for _ in range(20_000))
    return {d: words for d in DOMAINS}, "fixed word list (corpus not found)"


def _cut(tokenizer: Any, text: str, rng: random.Random, tokens: int) -> list[int]:
    """``tokens`` token ids from a random line (or word) start of ``text``."""
    for _ in range(1000):
        start = rng.randrange(0, max(1, len(text) - 16 * tokens))
        if start:
            newline, space = text.find("\n", start), text.find(" ", start)
            start = (newline if 0 <= newline < start + 200 else space) + 1
        ids = tokenizer(text[start : start + 8 * tokens])["input_ids"][:tokens]
        if len(ids) == tokens:
            return ids
    raise ValueError(f"Could not cut a prompt of {tokens} tokens from the prompt text.")


def make_workload(tokenizer: Any, corpus: Path | None, *, requests: int, prompt_lengths: tuple[int, ...],
                  min_tokens: int, max_tokens: int, seed: int = 0) -> tuple[list[dict[str, Any]], str]:
    """``requests`` request specs: even ones greedy, odd ones sampled (``temperature=0.7,
    top_p=0.9``, a seed); completions and chat alternate in pairs; prompt length, domain and
    ``max_tokens`` drawn with a fixed seed. Each spec holds the prompt ids the server will see
    (``ids``) for the offline check. Returns (specs, prompt source)."""
    texts, source = _texts(corpus)
    rng = random.Random(f"serve-{seed}")
    chat_ok = getattr(tokenizer, "chat_template", None) is not None
    specs = []
    for i in range(requests):
        domain = list(DOMAINS)[i % len(DOMAINS)]
        length = rng.choice(prompt_lengths)
        n = rng.randint(min_tokens, max_tokens)
        snippet = tokenizer.decode(_cut(tokenizer, texts[domain], rng, length), skip_special_tokens=True)
        spec: dict[str, Any] = {"index": i, "domain": domain, "length": length, "max_tokens": n,
                                "greedy": i % 2 == 0}
        spec["sampling"] = ({"temperature": 0.0} if spec["greedy"]
                            else {"temperature": 0.7, "top_p": 0.9, "seed": 1000 + i})
        if chat_ok and (i // 2) % 2 == 1:
            content = rng.choice(CHAT_INSTRUCTIONS[domain]).format(s=snippet)
            spec.update(kind="chat", messages=[{"role": "user", "content": content}],
                        ids=_chat_ids(tokenizer, content))
        else:
            spec.update(kind="completions", prompt=snippet, ids=list(tokenizer(snippet)["input_ids"]))
        specs.append(spec)
    return specs, source


# ----------------------------------------------------------------------------- client side
async def _one(client: Any, spec: dict[str, Any], *, stream: bool = True) -> dict[str, Any]:
    """Send ``spec``; the record: text, finish reason, usage, client-side timings, error."""
    import openai

    rec: dict[str, Any] = {"index": spec.get("index"), "kind": spec["kind"], "greedy": spec.get("greedy", True),
                           "ok": False, "status": None, "error": None, "text": "", "completion_tokens": None,
                           "prompt_tokens": None, "finish_reason": None, "ttft_s": None, "chunk_times": []}
    common = dict(model="flashspec", max_tokens=spec["max_tokens"], **spec.get("sampling", {"temperature": 0.0}))
    if stream:
        common.update(stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    try:
        if spec["kind"] == "chat":
            response = await client.chat.completions.create(messages=spec["messages"], **common)
        else:
            response = await client.completions.create(prompt=spec["prompt"], **common)
        if stream:
            parts, times = [], []
            async for chunk in response:
                if chunk.usage is not None:
                    rec["completion_tokens"], rec["prompt_tokens"] = (chunk.usage.completion_tokens,
                                                                      chunk.usage.prompt_tokens)
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                delta = (choice.delta.content if spec["kind"] == "chat" else choice.text) or ""
                if delta:
                    parts.append(delta)
                    times.append(time.perf_counter() - start)
                rec["finish_reason"] = choice.finish_reason or rec["finish_reason"]
            rec["text"], rec["chunk_times"] = "".join(parts), times
            rec["ttft_s"] = times[0] if times else None
        else:
            choice = response.choices[0]
            rec["text"] = choice.message.content if spec["kind"] == "chat" else choice.text
            rec["finish_reason"] = choice.finish_reason
            rec["completion_tokens"], rec["prompt_tokens"] = (response.usage.completion_tokens,
                                                              response.usage.prompt_tokens)
        rec["ok"] = rec["finish_reason"] in ("stop", "length") and rec["completion_tokens"] is not None
        if not rec["ok"]:
            rec["error"] = f"incomplete answer (finish_reason {rec['finish_reason']!r})"
    except openai.APIStatusError as error:
        rec["status"], rec["error"] = error.status_code, f"{type(error).__name__}: {error.message}"
    except Exception as error:  # noqa: BLE001 — every failure is counted, none stops the bench
        rec["error"] = f"{type(error).__name__}: {error}"
    rec["latency_s"] = time.perf_counter() - start
    return rec


def _client(url: str, timeout_s: float) -> Any:
    import httpx
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout_s,
                              http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=1024,
                                                                                max_keepalive_connections=256),
                                                            timeout=timeout_s))


async def _load(url: str, specs: list[dict[str, Any]], clients: int, timeout_s: float,
                progress: bool) -> tuple[list[dict[str, Any]], float, int]:
    """``clients`` workers stream ``specs``; none is started after ``timeout_s``. Returns
    (records, wall seconds, requests not sent)."""
    client = _client(url, timeout_s)
    queue: asyncio.Queue = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    records: list[dict[str, Any]] = []
    bar = tqdm(total=len(specs), desc="load", disable=not progress)
    start = time.perf_counter()

    async def worker() -> None:
        while not queue.empty() and time.perf_counter() - start < timeout_s:
            spec = queue.get_nowait()
            remaining = timeout_s - (time.perf_counter() - start)
            try:
                rec = await asyncio.wait_for(_one(client, spec), timeout=max(remaining, 1.0))
            except asyncio.TimeoutError:
                rec = {"index": spec["index"], "kind": spec["kind"], "greedy": spec["greedy"], "ok": False,
                       "error": "timed out (--timeout-s)", "status": None}
            records.append(rec)
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(min(clients, len(specs)))))
    wall = time.perf_counter() - start
    bar.close()
    await client.close()
    return sorted(records, key=lambda r: r["index"]), wall, queue.qsize()


async def _sequential(url: str, specs: list[dict[str, Any]], timeout_s: float,
                      progress: bool) -> tuple[list[dict[str, Any]], float]:
    client = _client(url, timeout_s)
    records = []
    start = time.perf_counter()
    for spec in tqdm(specs, desc="one at a time", disable=not progress):
        records.append(await _one(client, spec))
    wall = time.perf_counter() - start
    await client.close()
    return records, wall


async def _warm_client_offline() -> None:
    """Run the ``openai`` client's streaming path once in this process against an in-memory
    transport (``httpx.MockTransport``), never the server: the first stream a process parses pays
    the client library's own one-time costs (lazy imports, response models), which on this
    machine's CPU put about 10 ms on the first request's measured time to first token (median
    of 8 trials on an H200; BENCHMARKS.md, "The server") — a cost of the client, not of the server's first
    request."""
    import json

    import httpx
    import openai

    chunks = {"/v1/completions": {"id": "w", "object": "text_completion", "created": 0, "model": "w",
                                  "choices": [{"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}]},
              "/v1/chat/completions": {"id": "w", "object": "chat.completion.chunk", "created": 0, "model": "w",
                                       "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "length"}]}}

    def answer(request: httpx.Request) -> httpx.Response:
        body = f"data: {json.dumps(chunks[request.url.path])}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    client = openai.AsyncOpenAI(base_url="http://warm-up.invalid/v1", api_key="none", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    async for _ in await client.completions.create(model="w", prompt=[1], max_tokens=1, stream=True):
        pass
    async for _ in await client.chat.completions.create(model="w", messages=[{"role": "user", "content": "a"}],
                                                        max_tokens=1, stream=True):
        pass
    await client.close()


def _server_ttft_sum(url: str) -> float:
    """The server's own time-to-first-token total so far (``/metrics``: arrival at the handler to
    the first token handed out), for one request's server-side share of its measured TTFT."""
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("flashspec_time_to_first_token_seconds_sum"):
            return float(line.split()[-1])
    raise RuntimeError("The server's /metrics has no flashspec_time_to_first_token_seconds_sum.")


async def _ttft(url: str, prompts: dict[int, list[int]], tokens: int, repeats: int,
                timeout_s: float) -> list[dict[str, Any]]:
    """Per length: the first request of that length, then ``repeats`` identical ones; each timed by
    the client (to its first streamed token) and by the server (``/metrics``, read between requests)."""
    await _warm_client_offline()
    client = _client(url, timeout_s)
    await client.models.list()  # the client's connection, opened before the first timed request
    await asyncio.to_thread(_server_ttft_sum, url)  # /metrics' own first use, before any timed request
    rows = []
    for length, ids in prompts.items():
        spec = {"kind": "completions", "prompt": ids, "max_tokens": tokens, "sampling": {"temperature": 0.0}}
        runs = []
        for _ in range(1 + repeats):
            before = await asyncio.to_thread(_server_ttft_sum, url)
            r = await _one(client, spec)
            r["server_ttft_s"] = await asyncio.to_thread(_server_ttft_sum, url) - before
            runs.append(r)
        for r in runs:
            if not r["ok"]:
                raise RuntimeError(f"A TTFT request of {length} tokens failed: {r['error']}")

        def decode_rate(r: dict[str, Any]) -> float | None:
            times, n = r["chunk_times"], r["completion_tokens"] or 0
            return (n - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None

        first, warm = runs[0], runs[1:]
        warm_ttft = statistics.median(r["ttft_s"] for r in warm)
        rates = [x for x in (decode_rate(r) for r in warm) if x is not None]
        rows.append({"prompt_tokens": length, "first_ttft_s": first["ttft_s"], "warm_ttft_s": warm_ttft,
                     "warm_ttft_all_s": [r["ttft_s"] for r in warm], "ratio": first["ttft_s"] / warm_ttft,
                     "server_first_ttft_s": first["server_ttft_s"],
                     "server_warm_ttft_s": statistics.median(r["server_ttft_s"] for r in warm),
                     "within_10pct": first["ttft_s"] <= 1.10 * warm_ttft,
                     "first_decode_tok_s": decode_rate(first),
                     "warm_decode_tok_s": statistics.median(rates) if rates else None})
    await client.close()
    return rows


async def _burst(url: str, spec: dict[str, Any], count: int, timeout_s: float) -> list[dict[str, Any]]:
    client = _client(url, timeout_s)
    records = await asyncio.gather(*(_one(client, spec, stream=False) for _ in range(count)))
    await client.close()
    return list(records)


# ----------------------------------------------------------------------------- statistics
def _pct(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``; None when empty."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def _latencies(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    itl = []  # per request: (last chunk - first chunk) / (tokens - 1), client-side
    gaps = []  # every gap between two text chunks, client-side
    for r in ok:
        times = r.get("chunk_times") or []
        if len(times) > 1 and r["completion_tokens"] > 1:
            itl.append((times[-1] - times[0]) / (r["completion_tokens"] - 1))
        gaps += [b - a for a, b in itertools.pairwise(times)]
    ttft = [r["ttft_s"] for r in ok]
    return {"requests": len(records), "ok": len(ok), "wall_s": wall, "generated_tokens": tokens,
            "throughput_tok_s": tokens / wall if wall > 0 else None,
            "requests_per_s": len(ok) / wall if wall > 0 else None,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
            "chunk_gap_p50_s": _pct(gaps, 50), "chunk_gap_p99_s": _pct(gaps, 99),
            "latency_p50_s": _pct([r["latency_s"] for r in ok], 50),
            "latency_p99_s": _pct([r["latency_s"] for r in ok], 99)}


def _rss_mb() -> dict[str, float | None]:
    try:
        import resource  # Unix only: no peak RSS on Windows

        peak: float | None = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    except ImportError:
        peak = None
    try:
        import psutil

        now = psutil.Process().memory_info().rss / 2**20
    except ImportError:
        now = None
    return {"rss_mb": now, "peak_rss_mb": peak}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- the bench
def run(engine: Any, *, corpus: Path | None, clients: int = 64, requests: int = 256, sequential: int = 32,
        min_tokens: int = 8, max_tokens: int = 32, prompt_lengths: tuple[int, ...] = (16, 32, 64, 128, 200),
        slots: int = 8, max_length: int = 512, max_queue: int = 16, burst: int = 64, burst_tokens: int = 8,
        ttft_lengths: tuple[int, ...] = (16, 64, 200), ttft_repeats: int = 3, ttft_tokens: int = 16,
        num_draft_tokens: int = 4, reference_batch: int = 8, timeout_s: float = 600.0, seed: int = 0, progress: bool = True,
        config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole load test over ``engine`` (see the module docstring); returns the results dict."""
    from ..serve import start_server

    check_options(clients=clients, requests=requests, sequential=sequential, min_tokens=min_tokens,
                  max_tokens=max_tokens, prompt_lengths=tuple(prompt_lengths), slots=slots, max_length=max_length,
                  max_queue=max_queue, burst=burst, ttft_lengths=tuple(ttft_lengths), ttft_repeats=ttft_repeats,
                  ttft_tokens=ttft_tokens, timeout_s=timeout_s)
    try:
        import httpx  # noqa: F401
        import openai  # noqa: F401
    except ImportError as error:
        raise ValueError(f"bench serve's clients are the official openai client over httpx: pip install openai httpx "
                         f"({error}).") from None
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("bench serve needs a tokenizer: the target has none; pass --tokenizer.")
    began = time.perf_counter()
    specs, source = make_workload(tokenizer, corpus, requests=requests, prompt_lengths=tuple(prompt_lengths),
                                  min_tokens=min_tokens, max_tokens=max_tokens, seed=seed)
    too_long = [s["index"] for s in specs if len(s["ids"]) + s["max_tokens"] > max_length]
    if too_long:
        raise ValueError(f"{len(too_long)} requests exceed max_length {max_length} (chat template included); "
                         "raise --max-length.")
    texts, _ = _texts(corpus)
    rng = random.Random(f"ttft-{seed}")
    ttft_prompts = {n: _cut(tokenizer, texts["code"], rng, n) for n in ttft_lengths}
    options = dict(slots=slots, max_length=max_length, num_draft_tokens=num_draft_tokens)
    deadline = began + timeout_s

    def left() -> float:
        return max(deadline - time.perf_counter(), 1.0)

    # 1-3: TTFT on the fresh server, then the load, then one at a time (queue: every client fits).
    server = start_server(engine, max_queue=max(clients, 1), **options)
    startup = {"seconds": server.startup_seconds, "warmup_seconds": server.scheduler.warmup_seconds}
    try:
        ttft = asyncio.run(_ttft(server.url, ttft_prompts, ttft_tokens, ttft_repeats, left()))
        load_records, load_wall, not_sent = asyncio.run(_load(server.url, specs, clients, left(), progress))
        seq_records, seq_wall = asyncio.run(_sequential(server.url, specs[:sequential], left(), progress))
        rss_after_load = _rss_mb()
    finally:
        server.stop()

    # 4: the burst, on a server with a small queue.
    burst_spec = {"kind": "completions", "prompt": tokenizer.decode(ttft_prompts[min(ttft_lengths)]),
                  "max_tokens": burst_tokens, "sampling": {"temperature": 0.0}}
    server = start_server(engine, max_queue=max_queue, **options)
    try:
        import httpx

        rss_before_burst = _rss_mb()
        burst_records = asyncio.run(_burst(server.url, burst_spec, burst, left()))
        health = httpx.get(server.url + "/health", timeout=30)
        health_ok = health.status_code == 200 and health.json().get("status") == "ok"
        after = asyncio.run(_burst(server.url, burst_spec, 1, left()))[0]
        rss_after_burst = _rss_mb()
    finally:
        server.stop()

    # 5: offline references for every greedy request, same engine, same settings.
    greedy = sorted({r["index"] for r in load_records + seq_records if r.get("greedy") and r["ok"]})
    references = {}
    greedy.sort(key=lambda i: len(specs[i]["ids"]))  # similar lengths share a ragged batch
    groups = [greedy[k : k + reference_batch] for k in range(0, len(greedy), reference_batch)]
    for group in tqdm(groups, desc="offline generate", disable=not progress):
        out = engine.generate([specs[i]["ids"] for i in group], max_new_tokens=max(specs[i]["max_tokens"] for i in group),
                              num_draft_tokens=num_draft_tokens)
        for i, sequence in zip(group, out.sequences):
            sequence = list(sequence)[: specs[i]["max_tokens"]]  # greedy: a longer budget only extends it
            references[i] = (tokenizer.decode(sequence, skip_special_tokens=True), len(sequence))
    mismatches = []
    checked = 0
    for phase, records in (("load", load_records), ("sequential", seq_records)):
        for r in records:
            if not (r.get("greedy") and r["ok"]):
                continue
            checked += 1
            text, count = references[r["index"]]
            if r["text"] != text or r["completion_tokens"] != count:
                at = next((k for k, (a, b) in enumerate(zip(r["text"], text)) if a != b), min(len(r["text"]), len(text)))
                mismatches.append({"phase": phase, "index": r["index"], "kind": r["kind"], "first_diff_char": at,
                                   "stream_tokens": r["completion_tokens"], "offline_tokens": count,
                                   "stream": r["text"][max(0, at - 20): at + 40], "offline": text[max(0, at - 20): at + 40]})

    failures = [r for r in load_records if not r["ok"]]
    seq_failures = [r for r in seq_records if not r["ok"]]
    load = _latencies(load_records, load_wall)
    load.update(not_sent=not_sent, failures=len(failures) + not_sent,
                errors=[{"index": r["index"], "status": r.get("status"), "error": r["error"]} for r in failures[:10]],
                by_kind={k: sum(1 for s in specs if s["kind"] == k) for k in ("completions", "chat")},
                greedy_requests=sum(1 for s in specs if s["greedy"]),
                prompt_tokens_p50=_pct([len(s["ids"]) for s in specs], 50),
                prompt_tokens_max=max(len(s["ids"]) for s in specs),
                finish_reasons={k: sum(1 for r in load_records if r.get("finish_reason") == k) for k in ("stop", "length")})
    seq = _latencies(seq_records, seq_wall)
    seq["failures"] = len(seq_failures)
    same = [r for r in load_records if r["index"] < sequential and r["ok"]]
    statuses = [r["status"] for r in burst_records]
    rejected = sum(1 for s in statuses if s in (429, 503))
    burst_result = {"max_queue": max_queue, "slots": slots, "sent": burst, "max_tokens": burst_tokens,
                    "ok": sum(1 for r in burst_records if r["ok"]), "rejected_429_503": rejected,
                    "other_errors": sum(1 for r in burst_records if not r["ok"] and r["status"] not in (429, 503)),
                    "other_error_messages": sorted({r["error"] for r in burst_records
                                                    if not r["ok"] and r["status"] not in (429, 503)})[:5],
                    "health_after": health_ok, "request_after_ok": after["ok"],
                    "rss_before_mb": rss_before_burst["rss_mb"], "rss_after_mb": rss_after_burst["rss_mb"],
                    "rss_after_load_mb": rss_after_load["rss_mb"], "peak_rss_mb": rss_after_burst["peak_rss_mb"],
                    "rss_scope": "in-process: server, clients and engine share one process (ru_maxrss of the process)"}
    checks = {"zero_failures": load["failures"] == 0 and seq["failures"] == 0,
              "greedy_streams_equal_generate": checked > 0 and not mismatches,
              "burst_rejections": rejected > 0, "burst_other_errors_zero": burst_result["other_errors"] == 0,
              "health_after_burst": health_ok and after["ok"],
              "ttft_first_within_10pct": all(row["within_10pct"] for row in ttft)}
    device = next(engine.target.parameters()).device
    return {
        "machine": {"cpu": _cpu_model(), "cores": __import__("os").cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "torch": torch.__version__, "device": str(device),
                    "dtype": str(engine.target.dtype).replace("torch.", "")},
        "config": {**(config or {}), "clients": clients, "requests": requests, "sequential": sequential,
                   "min_tokens": min_tokens, "max_tokens": max_tokens, "prompt_lengths": list(prompt_lengths),
                   "slots": slots, "max_length": max_length, "load_max_queue": max(clients, 1),
                   "burst_max_queue": max_queue, "burst": burst, "ttft_lengths": list(ttft_lengths),
                   "ttft_repeats": ttft_repeats, "ttft_tokens": ttft_tokens, "num_draft_tokens": num_draft_tokens,
                   "reference_batch": reference_batch, "timeout_s": timeout_s, "seed": seed, "sampling": "even requests greedy (temperature 0); odd: "
                   "temperature 0.7, top_p 0.9, seed 1000+i; completions and chat alternate in pairs",
                   "client": "openai.AsyncOpenAI, streaming with include_usage, in-process loopback"},
        "prompt_source": source,
        "startup": startup,
        "ttft": ttft,
        "load": load,
        "sequential": seq,
        "concurrent_over_sequential_throughput": (load["throughput_tok_s"] / seq["throughput_tok_s"]
                                                  if seq["throughput_tok_s"] else None),
        "same_requests_in_load": {"requests": len(same), "latency_p50_s": _pct([r["latency_s"] for r in same], 50)},
        "greedy_check": {"checked": checked, "equal": checked - len(mismatches), "mismatches": mismatches[:20],
                         "reference": "engine.generate of the same prompt ids (ragged batches of up to "
                                      f"{reference_batch}, cut at each request's max_tokens), same engine, after the servers stopped"},
        "burst": burst_result,
        "checks": checks,
        "total_seconds": time.perf_counter() - began,
    }


def _f(value: Any, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def summarize(results: dict[str, Any]) -> str:
    """The markdown report."""
    m, c, load, seq, b = (results[k] for k in ("machine", "config", "load", "sequential", "burst"))
    g = results["greedy_check"]
    lines = [f"# `flashspec bench serve` — {m['cpu']}, {m['cores']} cores, {m['device']} {m['dtype']}", "",
             (f"Target `{c.get('target')}`, drafters {c.get('drafts')}, compile {c.get('compile', False)}; "
              f"{c['slots']} slots, max_length "
              f"{c['max_length']}; prompts: {results['prompt_source']}; start-up {_f(results['startup']['seconds'], 2)} s "
              f"(warm-up {_f(results['startup']['warmup_seconds'], 2)} s)."), "",
             "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else '**no**'} |" for k, v in results["checks"].items()]
    lines += ["", "| phase | requests | ok | failures | tokens | wall s | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, r in ((f"load, {c['clients']} clients", load), ("one at a time", seq)):
        lines.append(f"| {name} | {r['requests']} | {r['ok']} | {r['failures']} | {r['generated_tokens']} | "
                     f"{_f(r['wall_s'], 1)} | {_f(r['throughput_tok_s'], 1)} | "
                     f"{_f(r['ttft_p50_s'] and r['ttft_p50_s'] * 1e3, 0)} / {_f(r['ttft_p99_s'] and r['ttft_p99_s'] * 1e3, 0)} | "
                     f"{_f(r['itl_p50_s'] and r['itl_p50_s'] * 1e3, 1)} / {_f(r['itl_p99_s'] and r['itl_p99_s'] * 1e3, 1)} |")
    lines += ["", (f"Concurrent / one-at-a-time throughput: **{_f(results['concurrent_over_sequential_throughput'], 2)}×**. "
                   f"Greedy streams equal to offline `generate`: {g['equal']} / {g['checked']}."), "",
              "| prompt tokens | first TTFT ms | warm TTFT ms | ratio | within 10 % | server: first / warm ms | "
              "first decode tok/s | warm decode tok/s |",
              "|---|---|---|---|---|---|---|---|"]
    for row in results["ttft"]:
        server = row.get("server_first_ttft_s"), row.get("server_warm_ttft_s")
        server_ms = " / ".join(_f(v and v * 1e3, 1) for v in server)
        lines.append(f"| {row['prompt_tokens']} | {_f(row['first_ttft_s'] * 1e3, 1)} | {_f(row['warm_ttft_s'] * 1e3, 1)} | "
                     f"{_f(row['ratio'], 3)} | {'yes' if row['within_10pct'] else '**no**'} | {server_ms} | "
                     f"{_f(row['first_decode_tok_s'], 1)} | {_f(row['warm_decode_tok_s'], 1)} |")
    lines += ["", (f"Burst: {b['sent']} requests at once against max_queue {b['max_queue']} + {b['slots']} slots: "
              f"{b['ok']} ok, {b['rejected_429_503']} got 429/503, {b['other_errors']} other errors; /health after: "
              f"{'ok' if b['health_after'] else 'FAILED'}; RSS {_f(b['rss_before_mb'], 0)} → {_f(b['rss_after_mb'], 0)} MiB, "
              f"peak {_f(b['peak_rss_mb'], 0)} MiB ({b['rss_scope']}).")]
    return "\n".join(lines)


def write(results: dict[str, Any], out: str | Path) -> list[Path]:
    """``out/serve.json`` and ``out/serve.md``."""
    return write_results(Path(out) / "serve.json", results, summarize(results))
