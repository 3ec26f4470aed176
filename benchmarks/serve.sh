#!/usr/bin/env bash
# `flashspec serve` under load, on loopback (`flashspec bench serve`): 64 concurrent streaming clients
# (the official `openai` client) send 320 requests, greedy and sampled alternating; the same requests one
# at a time; every greedy stream against offline `generate`; the first request of each new prompt length
# against warm repeats (time to first token); a burst past the queue. BENCHMARKS.md, "The server".
# Needs the serve extras (openai, starlette, uvicorn, prometheus_client, httpx).
#
# Usage: benchmarks/serve.sh TARGET DRAFTER... OUT      (writes OUT/serve.{md,json})
# Environment (defaults in brackets; the second default is the CPU's): DEVICE [cuda if present, else cpu],
#   DTYPE [bfloat16; float32], CORPUS [../shared/corpus], MIN_TOKENS [16; 4] and MAX_TOKENS [96; 16] per
#   request, TTFT_LENGTHS [16,64,200,333; 16,64,200], TTFT_REPEATS [8; 3], TTFT_TOKENS [32; 8],
#   BOUND_S [300; 1800] (no request starts later). On CUDA the decode forwards are compiled.
set -euo pipefail
source "$(dirname "$0")/inputs.sh"
if [ "$device" = cpu ]; then
  set -- "${DTYPE:-float32}" "${MIN_TOKENS:-4}" "${MAX_TOKENS:-16}" "${TTFT_LENGTHS:-16,64,200}" \
         "${TTFT_REPEATS:-3}" "${TTFT_TOKENS:-8}" "${BOUND_S:-1800}"
  compile=()
else
  set -- "${DTYPE:-bfloat16}" "${MIN_TOKENS:-16}" "${MAX_TOKENS:-96}" "${TTFT_LENGTHS:-16,64,200,333}" \
         "${TTFT_REPEATS:-8}" "${TTFT_TOKENS:-32}" "${BOUND_S:-300}"
  compile=(--compile)
fi
mkdir -p "$dest"
"$python" -m flashspec bench serve --target "$target" "${draft_args[@]}" --corpus "$corpus" --device "$device" \
    --dtype "$1" "${compile[@]}" --clients 64 --requests 320 --min-tokens "$2" --max-tokens "$3" --sequential 16 \
    --max-queue 8 --burst 48 --ttft-lengths "$4" --ttft-repeats "$5" --ttft-tokens "$6" --reference-batch 16 \
    --timeout-s "$7" --out "$dest"
