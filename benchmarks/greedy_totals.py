"""Totals of `flashspec bench e2e` reports' greedy checks: how many (prompt, arm) pairs differ
from target-only, per mode (default arms against `flashspec`, bit-exact arms against
`flashspec exact`). Usage: python3 benchmarks/greedy_totals.py RESULTS_DIR/*/e2e.md"""

import re
import sys

totals = {"default": [0, 0], "bit-exact": [0, 0]}
for path in sys.argv[1:]:
    line = next(l for l in open(path, encoding="utf-8") if l.startswith("Greedy outputs"))
    for name, same, total in re.findall(r"flashspec ([\w\-@. ]+?) (\d+)/(\d+)", line):
        if name.strip() == "exact":  # bit-exact target-only against default target-only: another order
            continue
        mode = "bit-exact" if name.startswith("exact") else "default"
        totals[mode][0] += int(total) - int(same)
        totals[mode][1] += int(total)
for mode, (differ, total) in totals.items():
    print(f"{mode}: {differ} of {total} (prompt, arm) pairs differ from target-only greedy output")
