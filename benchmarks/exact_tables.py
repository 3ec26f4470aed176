"""Issue 22's tables, read off the files its runs wrote (markdown on stdout).

From `flashspec bench e2e` reports (`e2e.md`) that ran both modes
(`--systems flashspec,flashspec-fixed,flashspec-exact,flashspec-fixed-exact`):

* totals of the reports' greedy checks: how many (prompt, arm) pairs differ from target-only,
  per mode (default arms against `flashspec`, bit-exact arms against `flashspec exact`);
* per report, each arm's greedy check in both modes (identical / prompts);
* per report, tokens/s ("all" column: median over the prompts) and the paired ratio to default
  target-only (`× flashspec`) of every system, and each bit-exact system's ratio to its default
  twin (the ratio of their `× flashspec` columns).

From `exact_forward.json` (benchmarks/exact_bf16_h200.sh's forward stage): each forward's time in
both modes (with PDL on and off where measured) over the default's, and the device time of one
eager one-token forward per kernel, and the kernel timelines of one-token graph replays. From
`exact_maps.json` (its maps stage): each linear map alone in both modes by row count. From
`probe.json` (session 29's map probe): each map's one-row time by K split and configuration. From
`tiles.jsonl` (session 30's tile probe): forwards by the row count the mode's tiles were tuned on.

Usage: python3 benchmarks/exact_tables.py FILE...   (e2e.md, exact_forward.json, exact_maps.json, probe.json,
                                                      tiles.jsonl)"""

import json
import re
import sys
from pathlib import Path

GREEDY = re.compile(r"flashspec ([\w\-@. ]+?) (\d+)/(\d+)")


def greedy_checks(text: str) -> dict[str, tuple[int, int]]:
    """``{system: (identical, prompts)}`` from the report's "Greedy outputs identical" line."""
    line = next(l for l in text.splitlines() if l.startswith("Greedy outputs"))
    return {name.strip(): (int(same), int(total)) for name, same, total in GREEDY.findall(line)}


def speeds(text: str) -> dict[str, tuple[str, str]]:
    """``{system: (tokens/s "all" median, "× flashspec")}`` from the report's first tokens/s table."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("| system |") and "× flashspec" in l)
    out = {}
    for line in lines[start + 2:]:
        if not line.startswith("| flashspec"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = (cells[-3].split(" ")[0], cells[-1])
    return out


def reports(paths: list[str]) -> None:
    totals = {"default": [0, 0], "bit-exact": [0, 0]}
    reports = []
    for path in paths:
        text = Path(path).read_text(encoding="utf-8")
        checks = greedy_checks(text)
        for name, (same, total) in checks.items():
            if name == "exact":  # bit-exact target-only against default target-only: another order
                continue
            mode = "bit-exact" if name.startswith("exact") else "default"
            totals[mode][0] += total - same
            totals[mode][1] += total
        reports.append((Path(path).parent.name, checks, speeds(text)))
    for mode, (differ, total) in totals.items():
        print(f"{mode}: {differ} of {total} (prompt, arm) pairs differ from target-only greedy output")
    print("\n| report | arm | default: identical / prompts | bit-exact: identical / prompts |\n|---|---|---|---|")
    for case, checks, _ in reports:
        for name, (same, total) in checks.items():
            if name.startswith("exact"):
                continue
            twin = checks.get(f"exact {name}")
            print(f"| {case} | {name} | {same}/{total} | {f'{twin[0]}/{twin[1]}' if twin else '—'} |")
    print("\n| report | system | default tokens/s (× flashspec) | bit-exact tokens/s (× flashspec) | bit-exact / default |"
          "\n|---|---|---|---|---|")
    for case, _, table in reports:
        for system, (tps, ratio) in table.items():
            if system.startswith("flashspec exact"):
                continue
            twin_name = "flashspec exact" + system[len("flashspec"):]
            twin = table.get(twin_name)
            if twin is None:
                print(f"| {case} | {system} | {tps} ({ratio}) | — | — |")
                continue
            mode_ratio = float(twin[1].rstrip("×")) / float(ratio.rstrip("×"))
            label = system[len("flashspec "):] or "target only"
            print(f"| {case} | {label} | {tps} ({ratio}) | {twin[0]} ({twin[1]}) | {mode_ratio:.2f}× |")


def forward(path: str) -> None:
    """Forward times in both modes and the eager per-kernel profile of ``exact_forward.json``."""
    data = json.loads(Path(path).read_text())
    how = {True: "compiled, ", False: "not compiled, "}.get(data.get("compiled"), "")  # absent: not recorded
    print(f"\n{path}: {data['device']}, {data['context']} cached positions, {how}CUDA-graph replays\n")
    print("| shape | mode | PDL | batch × tokens | ms | / default (PDL on) |\n|---|---|---|---|---|---|")
    for r in data["rows"]:
        mode = "bit-exact" if r["bit_exact"] else "default"
        ratio = r.get("ratio_to_default")
        print(f"| {r['shape']} | {mode} | {'on' if r.get('pdl', True) else 'off'} | {r['batch']} × {r['width']} "
              f"| {r['seconds'] * 1e3:.3f} | {f'{ratio:.2f}×' if ratio else '1.00×'} |")
    profiles = data.get("eager_profiles", [])
    if profiles:
        print("\nOne eager one-token forward: device time per kernel (µs), the four largest\n")
        print("| shape | mode | all kernels | largest kernels |\n|---|---|---|---|")
        for p in profiles:
            top = ", ".join(f"{name.split('<')[0][:40]} {us:.0f}" for name, us in list(p["kernels"].items())[:4])
            print(f"| {p['shape']} | {'bit-exact' if p['bit_exact'] else 'default'} | {p['us']:.0f} | {top} |")


    timelines = data.get("replay_timelines", [])
    if timelines:
        print("\nOne-token graph replays under the profiler, per forward: kernels, span (first start to last end), "
              "busy (the union of kernel intervals) and the kernels' summed durations (µs; with PDL a kernel's "
              "duration includes its wait)\n")
        print("| shape | mode | PDL | kernels | span | busy | summed |\n|---|---|---|---|---|---|---|")
        for t in timelines:
            print(f"| {t['shape']} | {'bit-exact' if t['bit_exact'] else 'default'} | {'on' if t['pdl'] else 'off'} "
                  f"| {t['kernels']:.0f} | {t['span_us']:.0f} | {t['busy_us']:.0f} | {t['kernel_us']:.0f} |")


def probe(path: str) -> None:
    """Session 29's map probe: each map alone, one row, cold weights, by K split and configuration."""
    data = json.loads(Path(path).read_text())
    print(f"\n{path}: {data['device']}\n")
    print("| map | rows | cuBLAS µs | default µs | bit-exact, K split (splits) µs |\n|---|---|---|---|---|")
    for r in data["maps"]:
        default = f"{r['default_us']:.1f}" if "default_us" in r else "—"
        print(f"| {r['map']} | {r['rows']} | {r['cublas_us']:.1f} | {default} | {r['exact_us']:.1f} ({r['splits']}) |")
    print("\nOne row, forced configurations (4 warps): the fastest per K split, and per pipeline depth "
          "without a split\n")
    print("| map | best per split: splits → µs | no split, 3 stages | no split, 5 stages |\n|---|---|---|---|")
    for name in dict.fromkeys(r["map"] for r in data["sweep"]):
        one = [r for r in data["sweep"] if r["map"] == name and r["rows"] == 1 and "note" not in r and r["warps"] == 4]
        best = {}
        for r in one:
            best[r["splits"]] = min(best.get(r["splits"], float("inf")), r["us"])
        by_stage = {st: min((r for r in one if r["splits"] == 1 and r["stages"] == st), key=lambda r: r["us"])
                    for st in (3, 5) if any(r["splits"] == 1 and r["stages"] == st for r in one)}
        cells = [", ".join(f"{k} → {v:.1f}" for k, v in sorted(best.items()))]
        for st in (3, 5):
            r = by_stage.get(st)
            cells.append(f"{r['us']:.1f} ({r['block_n']} columns)" if r else "—")
        print(f"| {name} | " + " | ".join(cells) + " |")
    same = all(r.get("same_bits_as_first_of_split", True) for r in data["sweep"])
    rows = all(b["forced_row_equal"] and b["product_row_equal"] for b in data["bits"])
    print(f"\nWithin a split, every column tile, pipeline depth and warp count gave the same bits: {same}; "
          f"a row of a 40-row call equalled the row alone: {rows}.")
    if data.get("forward"):
        print("\n| forward | batch × tokens | ms |\n|---|---|---|")
        for r in data["forward"]:
            print(f"| {r['mode']} | {r['batch']} × {r['width']} | {r['ms']:.3f} |")
    for mode, p in data.get("profile", {}).items():
        print(f"\nEager one-token forward, {mode}: {p['total_us']:.0f} µs of kernels")


def maps(path: str) -> None:
    """Each linear map alone, both modes, by row count (``exact_maps.json``, the maps stage)."""
    data = json.loads(Path(path).read_text())
    print(f"\n{path}: {data['device']}, each map alone, cold weights, CUDA-graph replays (µs per call)\n")
    counts = sorted({r["rows"] for r in data["rows"]})
    print("| map | " + " | ".join(f"{m} rows: default / bit-exact" for m in counts) + " |")
    print("|---|" + "---|" * len(counts))
    for name in dict.fromkeys(r["map"] for r in data["rows"]):
        by_rows = {r["rows"]: r for r in data["rows"] if r["map"] == name}
        cells = [f"{by_rows[m]['default_us']:.1f} / {by_rows[m]['exact_us']:.1f} ({by_rows[m]['ratio']:.2f}×)"
                 if m in by_rows else "—" for m in counts]
        print(f"| {name} | " + " | ".join(cells) + " |")


def tiles(path: str) -> None:
    """Session 30's tile probe (``tiles.jsonl``, one line per process): forward times by the row
    count bit-exact mode's tiles were tuned on, and the column tile and stages picked per map."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    print(f"\n{path}: {lines[0]['device']}, Qwen2.5-1.5B shape, bit-exact, not compiled, CUDA-graph replays (ms)\n")
    shapes = list(lines[0]["ms"])
    print("| tiles tuned on | " + " | ".join(f"{s.replace('x', ' × ')}" for s in shapes) + " | tiles (columns/stages): "
          "qkv, o, gate/up, down, head |")
    print("|---|" + "---|" * len(shapes) + "---|")
    for line in lines:
        picked = ", ".join(re.search(r"BLOCK_N: (\d+)", v).group(1) + "/" + re.search(r"num_stages: (\d+)", v).group(1)
                           for v in line["picked"].values())
        print(f"| {line['tuned_on_rows']} rows | " + " | ".join(f"{line['ms'][s]:.3f}" for s in shapes)
              + f" | {picked} |")


def main(paths: list[str]) -> None:
    markdown = [p for p in paths if p.endswith(".md")]
    if markdown:
        reports(markdown)
    for path in paths:
        if path.endswith("exact_forward.json"):
            forward(path)
        elif path.endswith("probe.json"):
            probe(path)
        elif path.endswith("exact_maps.json"):
            maps(path)
        elif path.endswith("tiles.jsonl"):
            tiles(path)


if __name__ == "__main__":
    main(sys.argv[1:])
