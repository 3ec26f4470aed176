#!/usr/bin/env bash
# Session 27's H200 run (launcher, not kept): conversion + CUDA tests, issue 23's never-slower comparison
# on other held-out prompts (SEED=1) with both default-configuration selectors, then issue 21's serve test.
set -uo pipefail
res=/tmp/res; mkdir -p $res
{
  echo "== $(date -u +%H:%M:%S) start $(git log -1 --format=%h 2>/dev/null)"
  TRAIN=0 SHALLOW=0 ACCEPTANCE=0 ANATOMY=0 E2E=0 bash benchmarks/selfdraft_h200.sh $res/prep
  SEED=1 AUTO_SELECTORS=default,request E2E_TIMEOUT=560 PROMPTS=8 bash benchmarks/never_slower_h200.sh $res
  bash benchmarks/serve_h200.sh $res
  echo "== $(date -u +%H:%M:%S) ALL DONE"
} > $res/run.log 2>&1
