"""``flashspec bench serve`` end to end on a tiny random-weight model (loopback, a few clients)."""

from __future__ import annotations

import json

import pytest
from chat_tokenizer import save_tiny_chat_pair

from flashspec import SpeculativeEngine
from flashspec.bench import serve


def test_bench_serve_runs_and_checks_everything(tmp_path):
    target, _ = save_tiny_chat_pair(tmp_path / "pair")
    engine = SpeculativeEngine(str(target), ["ngram"])
    results = serve.run(engine, corpus=None, clients=6, requests=24, sequential=6, min_tokens=4, max_tokens=12,
                        prompt_lengths=(8, 16, 32), slots=2, max_length=128, max_queue=2, burst=16,
                        ttft_lengths=(8, 24), ttft_repeats=2, ttft_tokens=6, timeout_s=120, progress=False,
                        config={"target": "tiny", "drafts": ["ngram"]})
    serve.write(results, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert (tmp_path / "out" / "serve.md").read_text().startswith("# `flashspec bench serve`")
    assert saved["prompt_source"].startswith("fixed word list")
    assert saved["load"]["failures"] == 0 and saved["load"]["ok"] == 24 and saved["sequential"]["failures"] == 0
    assert saved["load"]["by_kind"]["chat"] > 0 and saved["load"]["by_kind"]["completions"] > 0
    assert saved["greedy_check"]["checked"] >= 12 and saved["checks"]["greedy_streams_equal_generate"]
    burst = saved["burst"]
    assert burst["rejected_429_503"] > 0 and burst["other_errors"] == 0 and burst["health_after"]
    assert burst["peak_rss_mb"] > 0
    assert [row["prompt_tokens"] for row in saved["ttft"]] == [8, 24]
    assert all(row["first_ttft_s"] > 0 and row["warm_ttft_s"] > 0 for row in saved["ttft"])
    # the server's share of each TTFT, from its /metrics: positive and never above the client's
    assert all(0 < row["server_first_ttft_s"] <= row["first_ttft_s"] for row in saved["ttft"])
    assert all(0 < row["server_warm_ttft_s"] <= max(row["warm_ttft_all_s"]) for row in saved["ttft"])
    assert saved["load"]["ttft_p50_s"] > 0 and saved["load"]["throughput_tok_s"] > 0


def test_the_clients_streaming_path_is_warmed_without_any_server(monkeypatch):
    """The TTFT phase's client warm-up parses a completion and a chat stream from an in-memory
    transport: it sends nothing over the network (a socket connect would fail the test)."""
    import asyncio
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("the client warm-up opened a connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    asyncio.run(serve._warm_client_offline())


def test_bench_serve_is_a_command_and_checks_options():
    from flashspec.cli.bench import bench_serve
    from flashspec.cli import _parser

    args = _parser().parse_args(["bench", "serve", "--target", "x.gguf", "--clients", "4", "--burst", "8",
                                 "--max-queue", "2"])
    assert args.run is bench_serve and args.clients == 4 and args.out == "bench-results/serve"
    with pytest.raises(ValueError, match="burst"):  # checked before any model is loaded
        bench_serve(_parser().parse_args(["bench", "serve", "--target", "missing", "--burst", "8"]))
    with pytest.raises(ValueError, match="prompt-lengths"):
        bench_serve(_parser().parse_args(["bench", "serve", "--target", "missing", "--prompt-lengths", "a"]))
