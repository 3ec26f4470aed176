#!/usr/bin/env bash
# Issue 21 on the H200: `flashspec bench serve` with the demo pair (Qwen2.5-Coder-1.5B-Instruct
# target, its 0.5B drafter), compiled, bf16: the load test, the first request of each new prompt
# length against warm repeats, and a burst past the queue (BENCHMARKS.md "flashspec serve under load").
# Expects the pair as bf16 folders in /tmp/hf/{target,draft} (benchmarks/selfdraft_h200.sh converts
# them first) and the corpus in device_carry/corpus.
# Usage: bash benchmarks/serve_h200.sh OUTDIR   (writes OUTDIR/serve_h200/serve.{json,md})
set -uo pipefail
out=${1:?usage: serve_h200.sh OUTDIR}
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
echo "== $(date -u +%H:%M:%S) serve_h200"
timeout ${SERVE_TIMEOUT:-420} python3 -m flashspec.cli bench serve --target /tmp/hf/target --draft /tmp/hf/draft \
  --corpus device_carry/corpus --device cuda --dtype bfloat16 --compile \
  --clients 64 --requests 320 --min-tokens 16 --max-tokens 96 --sequential 16 --max-queue 8 --burst 48 \
  --ttft-lengths 16,64,200,333 --ttft-repeats 3 --ttft-tokens 32 --reference-batch 16 --timeout-s 300 \
  --out "$out/serve_h200" > "$out/serve_h200.log" 2>&1
echo "== $(date -u +%H:%M:%S) serve_h200 exit $?"
