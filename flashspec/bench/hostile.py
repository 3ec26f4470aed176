"""``flashspec bench hostile``: hostile and malformed requests against ``flashspec serve``
(SPEC.md §12, "The server's limits, fields, authentication and shutdown").

``flashspec serve`` runs as its own process (with its default limits), on loopback; this
process sends each case and, during the heavy ones, polls ``/health`` and reads a concurrent
stream, so that each row says what the case was answered and whether the server stayed
responsive meanwhile: ``/health``'s slowest answer and the longest gap between two chunks of
the other stream. Two servers run: the first takes every request case and then a SIGTERM; the
second has an API key (``FLASHSPEC_API_KEY``) and takes two SIGTERMs. The target is by default a
random-weight Qwen2 of 2 layers over the tokenizer's vocabulary: what is measured is the server,
not the model.
"""

from __future__ import annotations

import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .results import write_results

__all__ = ["add_parser", "command", "run", "summarize", "write", "write_tiny_target"]

MB = 1 << 20
UNSUPPORTED = {"logprobs": True, "top_logprobs": 2, "logit_bias": {"100": -100}, "presence_penalty": 0.5,
               "frequency_penalty": 0.5, "echo": True, "suffix": "x", "best_of": 2,
               "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
               "tool_choice": "required"}


def write_tiny_target(tokenizer: str, folder: Path) -> Path:
    """A random-weight Qwen2 (2 layers, hidden size 64, context 4,096) over ``tokenizer``'s
    vocabulary, with the tokenizer beside it, saved in ``folder``; no EOS, so every request runs
    to its ``max_tokens``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class _Process:
    """``flashspec serve`` in a child process; ``url`` once it is ready."""

    def __init__(self, target: str, log: Path, api_key: str | None = None, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "FLASHSPEC_API_KEY"}
        if api_key is not None:
            env["FLASHSPEC_API_KEY"] = api_key
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flashspec", "serve", "--target", target, "--port", str(self.port),
             "--max-batch", "4", "--max-queue", "4", *flags], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(600):
            self.process.kill()
            raise RuntimeError(f"flashspec serve did not start; see {log}.")
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.process.stdout:
            self.log.write(line)
            self.log.flush()
            if "ready in" in line:
                self.ready.set()

    def rss_mb(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()


class _Watch:
    """While a case runs: ``/health`` polled every 50 ms, and a long stream read; their worst times."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url, self.headers = url, headers
        self.health: list[float] = []
        self.gaps: list[float] = []
        self.done = threading.Event()
        self.streaming = threading.Event()

    def _poll(self) -> None:
        import httpx

        with httpx.Client(timeout=120, headers=self.headers) as client:
            while not self.done.is_set():
                began = time.perf_counter()
                client.get(self.url + "/health")
                self.health.append(time.perf_counter() - began)
                time.sleep(0.05)

    def _stream(self) -> None:
        import httpx

        body = {"prompt": "Hello", "max_tokens": 4000, "temperature": 0, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120, headers=self.headers) as r:
            last = None
            for line in r.iter_lines():
                now = time.perf_counter()
                if last is not None and line:
                    self.gaps.append(now - last)
                if line:
                    last = now
                    self.streaming.set()
                if self.done.is_set():
                    return

    def __enter__(self) -> _Watch:
        self.threads = [threading.Thread(target=self._stream, daemon=True), threading.Thread(target=self._poll, daemon=True)]
        for thread in self.threads:
            thread.start()
        self.streaming.wait(60)
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(timeout=120)


def _words(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ("server", "token", "request", "stream", "prompt", "model", "the", "a", "of", "def", "return")
    text = " ".join(rng.choice(words) for _ in range(chars // 4))
    return text[:chars]


def _request_cases() -> list[tuple[bool, list[tuple[str, str, dict[str, Any]]]]]:
    """Groups of (case, route, body or {"raw": bytes}), each group sent at once; ``True``: watched.
    The three requests of 1,000 tokens run side by side, so they share every decode step (and any
    load on the machine): what differs between them is the cost of their stop strings alone."""
    greedy = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0}
    return [
        (True, []),  # the watch alone: the baseline
        (True, [("20 MB text prompt", "completions", {"prompt": "a" * (20 * MB), "max_tokens": 16})]),
        (True, [("20 MB in the unused `user` field", "completions",
                 {"prompt": "hi", "max_tokens": 16, "user": "u" * (20 * MB)})]),
        (True, [("text prompt just under the 1 MiB body limit", "completions",
                 {"prompt": _words(MB - 100), "max_tokens": 16})]),
        (True, [("1,000 new tokens, no stop string (the three side by side)", "completions", greedy),
                ("1,000 new tokens, a 10,000-character stop string", "completions",
                 {**greedy, "stop": ["\x01" * 10_000]}),
                ("1,000 new tokens, four 10,000-character stop strings", "completions",
                 {**greedy, "stop": [c * 10_000 for c in "\x01\x02\x03\x04"]})]),
        (False, [("a 10,001-character stop string", "completions", {"prompt": "hi", "stop": ["\x01" * 10_001]})]),
        (False, [("JSON nested 10,000 levels deep", "completions", {"raw": b"[" * 10_000 + b"]" * 10_000})]),
        (False, [("a lone surrogate in the prompt", "completions",
                  {"raw": b'{"prompt": "\\ud800", "max_tokens": 4}'})]),
        (False, [("a 5,000-digit seed", "completions", {"raw": b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}"})]),
        (False, [("a chat message of role `tool`", "chat/completions",
                  {"messages": [{"role": "tool", "content": "x"}], "max_tokens": 4})]),
        (False, [("`model` not served (`gpt-4o`)", "completions",
                  {"model": "gpt-4o", "prompt": "hi", "max_tokens": 4})]),
    ]


def _encoded(body: dict[str, Any]) -> bytes:
    return body["raw"] if "raw" in body else json.dumps(body).encode()


def _send(client: Any, url: str, route: str, content: bytes) -> tuple[int, dict[str, Any]]:
    """POST ``content`` (encoded beforehand: a 20 MB ``json.dumps`` would hold this process's GIL,
    and the watch's threads with it); the status and the JSON answer."""
    response = client.post(f"{url}/v1/{route}", content=content, headers={"Content-Type": "application/json"})
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {}


def _row(case: str, status: str, seconds: float | None, watch: _Watch | None = None, rss: float | None = None,
         **extra: Any) -> dict[str, Any]:
    return {"case": case, "status": status, "seconds": seconds,
            "health_worst_s": max(watch.health) if watch and watch.health else None,
            "health_polls": len(watch.health) if watch else None,
            "stream_gap_worst_s": max(watch.gaps) if watch and watch.gaps else None, "server_rss_mb": rss, **extra}


def _slow_headers(url: str) -> tuple[str, float]:
    """Send a request's headers one byte a second; when does the server close the connection?"""
    host, port = url.removeprefix("http://").split(":")
    began = time.perf_counter()
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(1.0)
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" * 10:
            try:
                sock.sendall(bytes([byte]))
                if sock.recv(1) == b"":
                    return "closed", time.perf_counter() - began
            except TimeoutError:
                continue
            except OSError:
                return "closed", time.perf_counter() - began
    return "still open", time.perf_counter() - began


def _sigterm(server: _Process, key: str | None, twice: bool) -> dict[str, Any]:
    """SIGTERM while four requests run (``--max-batch 4``) and two wait; with ``twice``, a second
    SIGTERM a second later. What each request got, and how long the process took to exit."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = server.url + "/v1/completions"
    result: dict[str, Any] = {}
    with ThreadPoolExecutor(6) as pool:
        long = {"prompt": "Hello", "max_tokens": 3000 if twice else 50, "temperature": 0}
        running = [pool.submit(httpx.post, url, json=long, headers=headers, timeout=300) for _ in range(4)]
        time.sleep(1.0)
        waiting = [pool.submit(httpx.post, url, json={"prompt": "hi", "max_tokens": 4}, headers=headers, timeout=300)
                   for _ in range(2)]
        time.sleep(0.5)
        began = time.perf_counter()
        server.process.send_signal(signal.SIGTERM)
        if twice:
            time.sleep(1.0)
            server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=120)
        result["exit_s"] = time.perf_counter() - began
        result["exit_code"] = server.process.returncode

        def outcome(future: Any) -> str:
            try:
                return str(future.result().status_code)
            except Exception as error:  # noqa: BLE001 — a request cut off by the exit
                return f"cut ({type(error).__name__})"

        result["waiting"] = [outcome(f) for f in waiting]
        result["running"] = [outcome(f) for f in running]
    return result


def run(target: str | None, tokenizer: str, workdir: Path, progress: bool = True) -> dict[str, Any]:
    """Every case (see the module docstring); returns the results dict."""
    import httpx

    say = print if progress else (lambda *a, **k: None)
    made = target is None
    if made:
        target = str(write_tiny_target(tokenizer, workdir / "tiny-qwen2"))
    rows: list[dict[str, Any]] = []
    began, load_before = time.perf_counter(), os.getloadavg()
    server = _Process(target, workdir / "serve.log")
    try:
        say(f"server ready on {server.url} (RSS {server.rss_mb():.0f} MB)")
        rss_ready = server.rss_mb()
        with httpx.Client(timeout=900) as client, ThreadPoolExecutor(4) as pool:
            for watched, group in _request_cases():
                say("  " + (", ".join(case for case, _, _ in group) or "baseline"))
                contents = [_encoded(body) for _, _, body in group]
                watch = _Watch(server.url, {}) if watched else None
                if watch:
                    watch.__enter__()
                if not group:
                    time.sleep(5.0)
                t0 = time.perf_counter()

                def timed(route: str, content: bytes, began: float) -> tuple[int, dict[str, Any], float]:
                    return (*_send(client, server.url, route, content), time.perf_counter() - began)

                sent = [pool.submit(timed, route, content, t0) for (_, route, _), content in zip(group, contents)]
                answers = [f.result() for f in sent]
                if watch:
                    watch.__exit__()
                if not group:
                    rows.append(_row("baseline: nothing but the watch, 5 s", "—", None, watch, server.rss_mb()))
                for (case, _, _), (status, answer, seconds) in zip(group, answers):
                    rows.append(_row(case, str(status), seconds, watch, server.rss_mb(),
                                     completion_tokens=answer.get("usage", {}).get("completion_tokens"),
                                     error=answer.get("error", {}).get("message", "")[:200]))
            statuses = [_send(client, server.url, "completions",
                              _encoded({"prompt": "hi", "max_tokens": 4, field: value}))[0]
                        for field, value in UNSUPPORTED.items()]
            rows.append(_row(f"unsupported fields ({', '.join(f'`{f}`' for f in UNSUPPORTED)}), one request each",
                             " ".join(f"{s} × {statuses.count(s)}" for s in sorted(set(statuses))), None))
        say("  slow headers")
        state, seconds = _slow_headers(server.url)
        rows.append(_row("headers sent one byte a second", state, seconds))
        say("  SIGTERM")
        term = _sigterm(server, None, twice=False)
        rows.append(_row("SIGTERM with 4 running and 2 waiting requests",
                         f"waiting: {', '.join(term['waiting'])}; running: {', '.join(term['running'])}; "
                         f"exit code {term['exit_code']}", term["exit_s"]))
    finally:
        server.close()
    key = "hostile-bench-key"
    server = _Process(target, workdir / "serve-key.log", key)
    try:
        say("  API key")
        for route in ("/v1/completions", "/v1/models", "/metrics", "/health"):
            method = "POST" if route == "/v1/completions" else "GET"
            response = httpx.request(method, server.url + route, json={"prompt": "hi", "max_tokens": 4}, timeout=60)
            rows.append(_row(f"no API key: {method} `{route}`", str(response.status_code), None))
        say("  two SIGTERMs")
        term = _sigterm(server, key, twice=True)
        rows.append(_row("SIGTERM, then a second one 1 s later, with 4 running and 2 waiting",
                         f"waiting: {', '.join(term['waiting'])}; running: {', '.join(term['running'])}; "
                         f"exit code {term['exit_code']}", term["exit_s"]))
    finally:
        server.close()
    import torch

    return {"machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch.__version__},
            "config": {"target": "random-weight Qwen2, 2 layers, hidden 64 (write_tiny_target)" if made else target,
                       "tokenizer": tokenizer, "server_flags": "--max-batch 4 --max-queue 4, every limit at its default",
                       "watch": "/health polled every 50 ms; a concurrent greedy stream of up to 4,000 tokens"},
            "server_rss_ready_mb": rss_ready, "rows": rows, "total_seconds": time.perf_counter() - began,
            "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]}}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:,.0f}"


def summarize(results: dict[str, Any]) -> str:
    """The markdown table."""
    m, c = results["machine"], results["config"]
    lines = [f"# `flashspec bench hostile` — {m['cpu']}, {m['cores']} threads", "",
             f"Target: {c['target']}; tokenizer `{Path(c['tokenizer']).name}`; server {c['server_flags']}; "
             f"watch: {c['watch']}. Server RSS when ready: {results['server_rss_ready_mb']:.0f} MB. Load average "
             f"(1 min) before / after the run: {results['load_average_1min']['before']:.2f} / "
             f"{results['load_average_1min']['after']:.2f}.", "",
             "| case | status | answered in (s) | `/health` slowest (ms) | stream's longest gap (ms) | server RSS after (MB) |",
             "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        seconds = "—" if r["seconds"] is None else f"{r['seconds']:.2f}"
        rss = "—" if r["server_rss_mb"] is None else f"{r['server_rss_mb']:.0f}"
        status = r["status"] + (f" ({r['completion_tokens']} tokens)" if r.get("completion_tokens") else "")
        lines.append(f"| {r['case']} | {status} | {seconds} | {_ms(r['health_worst_s'])} | "
                     f"{_ms(r['stream_gap_worst_s'])} | {rss} |")
    return "\n".join(lines)


def write(results: dict[str, Any], out: str | Path) -> list[Path]:
    """``out/hostile.json`` and ``out/hostile.md``."""
    return write_results(Path(out) / "hostile.json", results, summarize(results))


def add_parser(sub: Any) -> None:
    """``flashspec bench hostile``'s parser, under ``flashspec bench``'s sub-parsers ``sub``."""
    p = sub.add_parser("hostile", help="hostile and malformed requests against flashspec serve: statuses, and "
                                       "/health and a stream's latency meanwhile (SPEC.md §12)")
    p.add_argument("--target", default=None,
                   help="default: a random-weight Qwen2 of 2 layers over --tokenizer's vocabulary (the server is "
                        "measured, not the model)")
    p.add_argument("--tokenizer", default="../shared/tokenizers/qwen2.5", help="its vocabulary and chat template")
    p.add_argument("--out", default="bench-results/hostile", help="folder for hostile.json and hostile.md")
    p.set_defaults(run=command)


def command(args: Any) -> None:
    """``flashspec bench hostile``: check the options, run every case, write and print the table."""
    import tempfile

    if args.target is None and not Path(args.tokenizer, "tokenizer_config.json").is_file():
        raise ValueError(f"No tokenizer at {args.tokenizer!r}: give --tokenizer (a tokenizer folder) or --target.")
    with tempfile.TemporaryDirectory(prefix="flashspec-hostile-") as workdir:
        results = run(args.target, args.tokenizer, Path(workdir))
    write(results, args.out)
    print(summarize(results))
