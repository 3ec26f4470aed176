"""benchmarks/exact_tables.py: issue 22's tables read off the committed reports (BENCHMARKS.md quotes them)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _tables(*paths: Path) -> str:
    return subprocess.run([sys.executable, "benchmarks/exact_tables.py", *map(str, paths)], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


def test_reports_give_greedy_totals_and_each_mode_s_ratio():
    out = _tables(*sorted((RESULTS / "exact_bf16_h100_s28").glob("exact_*/e2e.md")))
    assert "default: 131 of 222 (prompt, arm) pairs differ" in out
    assert "bit-exact: 0 of 222 (prompt, arm) pairs differ" in out
    assert "| exact_chat_b1 | target only | 584.62 (1.00×) | 406.03 (0.69×) | 0.69× |" in out
    assert "| exact_text_b1 | ngram@4 | 12/24 | 24/24 |" in out
    assert "| exact_shaped_8b | llama3-1b@4 | 0/3 | 3/3 |" in out


def test_forward_and_probe_files():
    s29 = RESULTS / "exact_bf16_h200_s29" / "exact_forward.json"
    probe = RESULTS / "exact_bf16_h100_s29_probe" / "probe.json"
    out = _tables(s29, probe)
    assert "| qwen2.5-1.5b | bit-exact | on | 1 × 1 | 2.354 | 1.41× |" in out
    assert "| qwen2.5-1.5b | bit-exact | 1779 |" in out
    assert "| down | 1 → 13.8, 2 → 36.9, 3 → 28.9, 4 → 23.8, 6 → 22.7 | 20.0 (16 columns) | 13.8 (16 columns) |" in out
    assert "gave the same bits: True; a row of a 40-row call equalled the row alone: True" in out


def test_session_30_run_and_replay_timelines():
    s30 = RESULTS / "exact_bf16_h100_s30"
    out = _tables(*sorted(s30.glob("exact_*/e2e.md")), s30 / "forward_compiled" / "exact_forward.json",
                  s30 / "pdl_probe" / "exact_forward.json", s30 / "pdl_probe" / "exact_maps.json",
                  s30 / "tile_probe" / "tiles.jsonl")
    assert "bit-exact: 0 of 222 (prompt, arm) pairs differ" in out
    assert "| exact_chat_b1 | target only | 585.95 (1.00×) | 481.36 (0.82×) | 0.82× |" in out
    assert "512 cached positions, compiled, CUDA-graph replays" in out  # the recorded flag is printed
    assert "| qwen2.5-1.5b | bit-exact | on | 1 × 1 | 2.067 | 1.31× |" in out
    assert "| qwen2.5-1.5b | bit-exact | on | 203 | 2401 | 2398 | 3992 |" in out  # the PDL probe's timeline
    assert "| down | 11.7 / 13.9 (1.19×) | 15.3 / 13.6 (0.89×) | 15.1 / 13.5 (0.90×) | 14.7 / 31.7 (2.16×) |" in out
    assert "| 40 rows | 2.175 | 2.220 | 2.271 | 2.907 | 64/3, 64/5, 32/3, 64/5, 64/3 |" in out  # the tile probe
