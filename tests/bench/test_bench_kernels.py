"""The verify-kernel benchmark's own logic (flashspec.bench.kernels), on the CPU: how eager
timings are taken and how the table reports a mismatch or a missing graph timing. The timings
themselves need a GPU (benchmarks/gpu_h200.sh)."""

from __future__ import annotations

import torch

from flashspec.bench import kernels as bench_kernels


def test_eager_rounds_of_the_two_backends_alternate(monkeypatch):
    """A slow spell of a shared machine must hit both backends: their timed rounds interleave,
    each round continues the rotation through the input sets, and each gets its own median."""
    order: list[str] = []
    seconds = {"reference": [9.0, 1.0, 1.0, 5.0, 1.0], "triton": [2.0, 2.0, 7.0, 2.0, 2.0]}
    indices: dict[str, list[int]] = {"reference": [], "triton": []}

    def fake_time_rounds(fn, calls_per_round, rounds):
        assert rounds == 1
        for i in range(calls_per_round):
            name = fn(i)
        if calls_per_round == 3:  # the sizing estimate: one second per call
            return 1.0
        order.append(name)
        return seconds[name][sum(1 for o in order if o == name) - 1]

    def backend(name):
        def call(i):
            indices[name].append(i)
            return name
        return call

    monkeypatch.setattr(bench_kernels, "_time_rounds", fake_time_rounds)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    medians = bench_kernels._timed_alternating([backend("reference"), backend("triton")], rounds=5)

    assert order == ["reference", "triton"] * 5
    assert medians == [1.0, 2.0]
    calls = 5  # max(5, 0.02 s / 1 s per call)
    timed = indices["triton"][3 + 3:]  # after 3 warm-up calls and the 3-call estimate
    assert timed == list(range(5 * calls))


def test_table_reports_mismatches_and_missing_graph_timings():
    row = {
        "vocab": 32000, "batch": 4, "gamma": 1, "mode": "temperature", "match": False,
        "mismatched_sequences": 1, "max_mismatch_margin": 2e-7, "reference_us": 300.0, "triton_us": 200.0,
        "speedup": 1.5, "reference_graph_us": None, "triton_graph_us": None, "graph_speedup": None,
        "bytes": 2_000_000, "triton_bytes_per_second": 1e12,
    }
    table = bench_kernels.format_table([row], copy_bw=4e12)
    line = table.splitlines()[2]
    assert "| 1/4 (≤2e-07) |" in line
    assert "| — | — | — |" in line
    assert line.endswith("| 2.00 | 1.00 | 25% |")
