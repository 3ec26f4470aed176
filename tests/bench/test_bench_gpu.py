"""`flashspec bench gpu`'s side-by-side forward timing per set of decode_linear maps: every set the
model accepts is timed in every round, refused sets are left out, the default comes back, and
the report says so. (The timings themselves need a GPU; here the timer is a stand-in that
records which maps were active.)"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flashspec.bench import gpu as bench_gpu
from flashspec.models.static import StaticLM


def _lm(dtype: torch.dtype) -> StaticLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    return StaticLM(LlamaForCausalLM(config).to(dtype).eval())


@pytest.fixture
def timer(monkeypatch):
    calls = []

    def fake(lm, batch, width, context):
        maps = lm.decode_maps if batch * width == 1 else lm.decode_maps_wide
        calls.append((frozenset(maps), width))
        return 1e-3 * (1 + len(maps)) + 1e-5 * width

    monkeypatch.setattr(bench_gpu, "forward_seconds", fake)
    return calls


def test_every_accepted_set_every_round(timer):
    lm = _lm(torch.bfloat16)
    result = bench_gpu.forward_by_decode_maps(lm, (1, 5), context=10, rounds=2)
    assert list(result["seconds"]) == list(bench_gpu.DECODE_MAP_SETS)
    assert all(len(times) == 2 for widths in result["seconds"].values() for times in widths.values())
    assert len(timer) == 2 * len(bench_gpu.DECODE_MAP_SETS) * 2
    assert {maps for maps, _ in timer} == {frozenset(m) for m in bench_gpu.DECODE_MAP_SETS.values()}
    assert lm.decode_maps == {"qkv", "o", "down"} and result["default"] == ["down", "o", "qkv"]
    assert lm.decode_maps_wide == {"o"} and result["default_wide"] == ["o"]
    table = "\n".join(bench_gpu._decode_maps_lines(result))
    assert "| all | 5.010 / 5.010 | 5.050 / 5.050 | +396.0%, +381.0% |" in table


def test_refused_sets_are_left_out(timer):
    lm = _lm(torch.float32)  # float32 keeps cuBLAS: only "none" can be timed
    result = bench_gpu.forward_by_decode_maps(lm, (1,), context=10, rounds=1)
    assert list(result["seconds"]) == ["none"]
    assert lm.decode_maps == lm.decode_maps_wide == frozenset()


def test_defaults_without_pdl_where_pdl_runs(monkeypatch):
    """Where flashspec.kernels.pdl is on, the table adds the default maps with PDL off (switched off for
    those timings only, and back on afterwards)."""
    from flashspec.kernels import pdl

    seen, setting = [], pdl.ENABLED
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    monkeypatch.setattr(bench_gpu, "forward_seconds",
                        lambda lm, batch, width, context: seen.append((frozenset(lm.decode_maps), pdl.ENABLED)) or 1e-3)
    lm = _lm(torch.bfloat16)
    result = bench_gpu.forward_by_decode_maps(lm, (1,), context=10, rounds=1)
    assert list(result["seconds"])[-1] == "defaults, PDL off"
    assert seen[-1] == (lm.decode_maps, False) and all(on == setting for _, on in seen[:-1])
    assert pdl.ENABLED == setting  # put back as it was


def test_the_command_passes_its_options_to_the_run(monkeypatch, tmp_path):
    """``--no-maps`` and ``--no-hf`` reach ``gpu.run`` (the H200 script uses them to keep the step
    anatomy short); without them both tables are on."""
    from flashspec.cli import main

    seen = []
    monkeypatch.setattr(bench_gpu, "run", lambda out, **kw: seen.append(kw))
    assert main(["bench", "gpu", "--shaped=", "--no-maps", "--no-hf", "--out", str(tmp_path)]) == 0
    assert main(["bench", "gpu", "--shaped=", "--out", str(tmp_path)]) == 0
    assert (seen[0]["maps_table"], seen[0]["hf_baseline"], seen[0]["shaped"]) == (False, False, ())
    assert (seen[1]["maps_table"], seen[1]["hf_baseline"]) == (True, True)
