#!/usr/bin/env bash
# Issue 21 on the H200: `flashspec bench serve` with the demo pair (Qwen2.5-Coder-1.5B-Instruct
# target, its 0.5B drafter), compiled, bf16: the load test, the first request of each new prompt
# length against warm repeats, and a burst past the queue (BENCHMARKS.md "flashspec serve under load").
# Expects the pair as bf16 folders in /tmp/hf/{target,draft} (benchmarks/selfdraft_h200.sh converts
# them first), the corpus in device_carry/corpus, and in .whl/ the wheels of the clients and the
# server for the device's Python (3.12; the H200 image has none of them):
#   pip download openai starlette uvicorn prometheus_client httpx -d .whl --only-binary :all: \
#       --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
# Usage: bash benchmarks/serve_h200.sh OUTDIR   (writes OUTDIR/serve_h200/serve.{json,md});
# DTYPE=float32 runs the same test in float32 (OUTDIR/serve_h200_float32), BOUND_S bounds it (default 300 s),
# TTFT_REPEATS sets the warm repeats per TTFT length (default 8), NAME the output folder's name.
set -uo pipefail
out=${1:?usage: serve_h200.sh OUTDIR}
dtype=${DTYPE:-bfloat16}
name=serve_h200; [ "$dtype" = bfloat16 ] || name=serve_h200_$dtype; name=${NAME:-$name}
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site2 openai starlette uvicorn prometheus_client \
  httpx > /dev/null 2>&1 || { echo "FAILED: the client and server wheels are not in .whl/"; exit 1; }
export PYTHONPATH=/tmp/site:/tmp/site2:. PYTHONUNBUFFERED=1
echo "== $(date -u +%H:%M:%S) $name"
timeout ${SERVE_TIMEOUT:-420} python3 -m flashspec.cli bench serve --target /tmp/hf/target --draft /tmp/hf/draft \
  --corpus device_carry/corpus --device cuda --dtype $dtype --compile \
  --clients 64 --requests 320 --min-tokens 16 --max-tokens 96 --sequential 16 --max-queue 8 --burst 48 \
  --ttft-lengths 16,64,200,333 --ttft-repeats ${TTFT_REPEATS:-8} --ttft-tokens 32 --reference-batch 16 --timeout-s ${BOUND_S:-300} \
  --out "$out/$name" > "$out/$name.log" 2>&1
echo "== $(date -u +%H:%M:%S) $name exit $?"
