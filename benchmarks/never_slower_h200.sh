#!/usr/bin/env bash
# Issue 23 on the H200: FlashSpec's default configuration (selector "auto": Thompson over every
# drafter and the target-only arm, behind the never-slower guard, SPEC.md §8) against FlashSpec
# target-only and every fixed arm, request by request, on chat-formatted requests of every domain
# (`flashspec bench e2e --systems flashspec,flashspec-fixed,flashspec-auto`), greedy and T = 0.7.
# Every drafter available: the 0.5B model, n-gram, and the committed feature drafters (general
# and the per-domain deltas). BENCHMARKS.md "Never slower than the target alone (issue 23)".
# Expects the pair as bf16 folders in /tmp/hf/{target,draft}: run
#   TRAIN=0 SHALLOW=0 ACCEPTANCE=0 ANATOMY=0 E2E=0 bash benchmarks/selfdraft_h200.sh OUTDIR
# first (it converts the GGUF pair and runs the CUDA tests).
# Usage: bash benchmarks/never_slower_h200.sh OUTDIR   (writes OUTDIR/never_slower_t{0,0.7}/);
# PROMPTS (per domain, default 4) and TEMPERATURES (default "0 0.7") shrink it; AUTO_SLACKS (e.g.
# "default,0.015,0.02") runs the default configuration at each guard δ, side by side; AUTO_SELECTORS
# (e.g. "default,request") with each selector behind the guard, one system per (selector, δ).
# SEED (default 0) picks other held-out prompts (and the selectors' and samplers' seeds).
set -uo pipefail
out=${1:?usage: never_slower_h200.sh OUTDIR}
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
ck=flashspec/checkpoints/qwen2.5-coder-1.5b-instruct
drafters="--draft /tmp/hf/draft --draft ngram"
for d in general code prose chat; do drafters="$drafters --draft feature:$ck/$d"; done
for t in ${TEMPERATURES:-0 0.7}; do
  echo "== $(date -u +%H:%M:%S) never_slower_t$t"
  timeout ${E2E_TIMEOUT:-420} python3 -m flashspec.cli bench e2e --target /tmp/hf/target --corpus device_carry/corpus \
    $drafters --device cuda --dtype bfloat16 --compile --systems flashspec,flashspec-fixed,flashspec-auto \
    --gammas 4 --regimes long --style chat --batch-sizes 1 --prompts-per-domain ${PROMPTS:-4} --temperature $t --seed ${SEED:-0} \
    ${AUTO_SLACKS:+--auto-slacks $AUTO_SLACKS} ${AUTO_SELECTORS:+--auto-selectors $AUTO_SELECTORS} --no-progress --out "$out/never_slower_t$t" > "$out/never_slower_t$t.log" 2>&1
  echo "== $(date -u +%H:%M:%S) never_slower_t$t exit $?"
done
