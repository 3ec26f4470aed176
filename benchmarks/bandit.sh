#!/usr/bin/env bash
# The drafter selectors' regret on simulated Bernoulli arms (`flashspec bench bandit`; SPEC.md §8,
# "Simulation"): T = 10,000 steps, K = 3 arms, 20 seeds, one CPU core.
#
# Usage: benchmarks/bandit.sh OUT      (writes OUT/bandit.json and OUT/bandit.png)
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT" >&2; exit 2; }
mkdir -p "$1"
"${PYTHON:-python3}" -m flashspec bench bandit --steps 10000 --arms 3 --seeds 20 --no-progress \
    --json "$1/bandit.json" --plot "$1/bandit.png"
