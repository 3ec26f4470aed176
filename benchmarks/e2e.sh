#!/usr/bin/env bash
# Speed against the target alone: FlashSpec's target-only decoding beside one fixed (drafter, γ) arm per
# drafter, prompt by prompt in one process (`flashspec bench e2e --systems flashspec,flashspec-fixed`).
# BENCHMARKS.md, "Speed at batch 1" and "Batched decoding".
#
# Usage: benchmarks/e2e.sh TARGET DRAFTER... OUT
#   TARGET   a model folder, hub id or .gguf file
#   DRAFTER  a model, ngram, early-exit:N, feature:DIR or shallow:DIR (repeat for several)
#   OUT      writes OUT/b{BATCH}_t{T}/e2e.{md,json} for each temperature T
# Environment (defaults in brackets): DEVICE [cuda if present, else cpu], DTYPE [bfloat16],
#   CORPUS [../shared/corpus], BATCH [1], TEMPERATURES ["0 0.7"], PROMPTS per domain [8],
#   STYLE [chat: chat-formatted requests; text: held-out corpus text], REGIME [long: 256 new tokens;
#   short: 20], GAMMAS [4], SEED [0]. On CUDA the decode forwards are compiled (--compile).
set -euo pipefail
source "$(dirname "$0")/inputs.sh"
compile=(); [ "$device" = cpu ] || compile=(--compile)
batch=${BATCH:-1}
mkdir -p "$dest"
for t in ${TEMPERATURES:-0 0.7}; do
  "$python" -m flashspec bench e2e --target "$target" "${draft_args[@]}" --corpus "$corpus" \
      --device "$device" --dtype "${DTYPE:-bfloat16}" "${compile[@]}" --systems flashspec,flashspec-fixed \
      --gammas "${GAMMAS:-4}" --regimes "${REGIME:-long}" --style "${STYLE:-chat}" --batch-sizes "$batch" \
      --prompts-per-domain "${PROMPTS:-8}" --temperature "$t" --seed "${SEED:-0}" --no-progress \
      --out "$dest/b${batch}_t$t"
done
