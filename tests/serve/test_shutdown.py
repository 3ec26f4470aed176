"""How ``flashspec serve`` stops and how long it waits for a client (SPEC.md §12, "The server's
limits, fields, authentication and shutdown"): SIGTERM drains (waiting requests get 503, running
ones finish within the grace), a second signal exits at once, and a client that sends its request
too slowly is cut off."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from chat_tokenizer import save_tiny_chat_pair
from tiny_models import CharTokenizer, tiny_model

from flashspec import SpeculativeEngine
from flashspec.decode.batch import Batch
from flashspec.serve import start_server


def _engine():
    engine = SpeculativeEngine(tiny_model("llama", seed=0), [])
    engine.tokenizer = CharTokenizer()
    return engine


@pytest.fixture
def slow_steps(monkeypatch):
    step = Batch.step
    monkeypatch.setattr(Batch, "step", lambda self: (time.sleep(0.05), step(self))[1])


def _wait_running(server, count: int) -> None:
    deadline = time.time() + 20
    while server.scheduler.running < count and time.time() < deadline:
        time.sleep(0.02)
    assert server.scheduler.running == count


def test_stop_answers_waiting_requests_with_503_and_lets_running_ones_finish(slow_steps):
    server = start_server(_engine(), slots=1, max_length=128, max_queue=4, shutdown_grace=60)
    body = {"prompt": "abc", "max_tokens": 60, "temperature": 0}
    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60)
        _wait_running(server, 1)
        waiting = [pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60) for _ in range(2)]
        while server.scheduler.queued < 2:
            time.sleep(0.01)
        began = time.perf_counter()
        stopping = threading.Thread(target=server.stop)
        stopping.start()
        for future in waiting:
            response = future.result()
            assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
        assert time.perf_counter() - began < 2.0  # at once, not after the running request
        assert running.result().json()["usage"]["completion_tokens"] == 60  # finished within the grace
        stopping.join(timeout=60)
    assert not stopping.is_alive()


def test_past_the_grace_running_requests_are_ended_with_an_error(slow_steps):
    server = start_server(_engine(), slots=2, max_length=250, shutdown_grace=0.5)
    lines, answers = [], {}

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": "abc", "max_tokens": 240, "stream": True}) as response:
            lines.extend(line for line in response.iter_lines() if line)

    def plain():
        answers["plain"] = httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 240},
                                      timeout=60)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for thread in threads:
        thread.start()
    _wait_running(server, 2)
    began = time.perf_counter()
    server.stop()
    for thread in threads:
        thread.join(timeout=30)
    assert time.perf_counter() - began < 10
    assert lines[-1] == "data: [DONE]" and "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
    assert answers["plain"].status_code == 503 and answers["plain"].json()["error"]["code"] == "shutting_down"


def test_slowly_sent_headers_are_cut_off():
    server = start_server(_engine(), slots=1, max_length=64, read_timeout=1.0)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        with socket.create_connection((host, int(port))) as slow:
            began = time.perf_counter()
            closed = None
            for byte in request * 4:  # one byte every 50 ms: 12 s if let through
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed = time.perf_counter() - began
                    break
                slow.settimeout(0.05)
                try:
                    if slow.recv(1) == b"":
                        closed = time.perf_counter() - began
                        break
                except TimeoutError:
                    pass
            assert closed is not None and 0.9 < closed < 3.0
        with socket.create_connection((host, int(port))) as idle:  # a connection that sends nothing
            idle.settimeout(5)
            began = time.perf_counter()
            assert idle.recv(1) == b"" and time.perf_counter() - began < 3.0
        with httpx.Client(timeout=30) as client:  # a prompt client is unaffected, on one connection
            for _ in range(3):
                assert client.post(server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
                time.sleep(0.6)  # idle between requests, within the read timeout each time
    finally:
        server.stop()


SERVE = """
import sys, time
from flashspec.decode.batch import Batch
step = Batch.step
Batch.step = lambda self: (time.sleep(0.2), step(self))[1]  # a slow model: requests run for a while
from flashspec.cli import main
main(["serve", "--target", sys.argv[1], "--port", sys.argv[2], "--max-batch", "1", "--max-length", "250",
      "--shutdown-grace", "60"])
"""


def test_a_second_sigterm_exits_at_once(tmp_path):
    """SIGTERM: the queued request gets 503 and the running one goes on (60 s of grace); a
    second SIGTERM ends the process at once."""
    target, _ = save_tiny_chat_pair(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "FLASHSPEC_CACHE": str(tmp_path / "cache")}
    process = subprocess.Popen([sys.executable, "-c", SERVE, str(target), str(port)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in process.stdout:
            if "ready in" in line:
                break
        url = f"http://127.0.0.1:{port}/v1/completions"
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, url, json={"prompt": "ab", "max_tokens": 200}, timeout=120)
            deadline = time.time() + 30
            while httpx.get(url.replace("/v1/completions", "/health")).json()["running"] != 1:
                assert time.time() < deadline
                time.sleep(0.05)
            queued = pool.submit(httpx.post, url, json={"prompt": "ab", "max_tokens": 5}, timeout=120)
            time.sleep(0.3)
            process.send_signal(signal.SIGTERM)
            assert queued.result().status_code == 503
            time.sleep(1.0)
            assert process.poll() is None  # draining: the running request goes on
            began = time.perf_counter()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=10)
            assert time.perf_counter() - began < 5.0
            with pytest.raises(httpx.HTTPError):
                running.result()  # cut off, never answered
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
