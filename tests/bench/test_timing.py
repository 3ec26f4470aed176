"""The benchmarks' shared timers (flashspec.tuning.timing), on the CPU: how alternating rounds
of several candidates are taken. CUDA events and graph replays themselves need a GPU
(benchmarks/kernels.sh)."""

from __future__ import annotations

import torch

from flashspec.tuning import timing


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

    monkeypatch.setattr(timing, "event_seconds", fake_time_rounds)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    medians = timing.alternating([backend("reference"), backend("triton")], rounds=5)

    assert order == ["reference", "triton"] * 5
    assert medians == [1.0, 2.0]
    calls = 5  # max(5, 0.02 s / 1 s per call)
    timed = indices["triton"][3 + 3:]  # after 3 warm-up calls and the 3-call estimate
    assert timed == list(range(5 * calls))


def test_best_seconds_is_the_fastest_timed_call_after_an_untimed_one(monkeypatch):
    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 23.0])  # timed calls of 5, 2 and 3 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    calls = []
    assert timing.best_seconds(lambda: calls.append(1), torch.device("cpu"), repeats=3) == 2.0
    assert len(calls) == 4


def test_measured_gives_wall_time_and_no_peak_memory_on_the_cpu():
    with timing.measured(torch.device("cpu")) as m:
        pass
    assert m["seconds"] >= 0 and m["start"] > 0 and m["peak"] is None and m["growth"] is None


def test_results_are_written_as_json_and_markdown_beside_it(tmp_path):
    import json

    from flashspec.bench.results import write_results

    files = write_results(tmp_path / "new" / "x.json", {"a": [1, 2]}, "| t |")
    assert files == [tmp_path / "new" / "x.json", tmp_path / "new" / "x.md"]
    assert files[0].read_text() == json.dumps({"a": [1, 2]}, indent=1)
    assert files[1].read_text() == "| t |\n"
    assert write_results(tmp_path / "y.md", markdown="text") == [tmp_path / "y.md"]
