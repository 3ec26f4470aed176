"""Issue 22's tables from `flashspec bench e2e` reports that ran both modes
(`--systems flashspec,flashspec-fixed,flashspec-exact,flashspec-fixed-exact`):

* totals of the reports' greedy checks: how many (prompt, arm) pairs differ from target-only,
  per mode (default arms against `flashspec`, bit-exact arms against `flashspec exact`);
* per report, each arm's greedy check in both modes (identical / prompts);
* per report, tokens/s ("all" column: median over the prompts) and the paired ratio to default
  target-only (`× flashspec`) of every system, and each bit-exact system's ratio to its default
  twin (the ratio of their `× flashspec` columns).

Usage: python3 benchmarks/greedy_totals.py RESULTS_DIR/*/e2e.md"""

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


def main(paths: list[str]) -> None:
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


if __name__ == "__main__":
    main(sys.argv[1:])
