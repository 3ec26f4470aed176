"""The verify-kernel benchmark's own logic (flashspec.bench.kernels), on the CPU: how the table
reports a mismatch or a missing graph timing (how its eager timings are taken:
tests/bench/test_timing.py). The timings themselves need a GPU (benchmarks/kernels.sh)."""

from __future__ import annotations

from flashspec.bench import kernels as bench_kernels


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
