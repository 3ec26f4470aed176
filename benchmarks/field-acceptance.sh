#!/usr/bin/env bash
# Tokens per step (τ) of drafters on the benchmarks the field reports: MT-bench (80 two-turn questions in 8
# categories, both turns, the second after the target's own first answer) and HumanEval (164 problems as chat
# requests), each drafter × γ as a fixed chain arm, answers ending at the target's EOS (BENCHMARKS.md §8, "On
# MT-bench and HumanEval"). τ does not depend on the batch, so requests are decoded in large batches, unwarmed.
#
# Usage: benchmarks/field-acceptance.sh TARGET DRAFTER... OUT
#   writes OUT/{mt-bench,humaneval}-t{T}/acceptance.{md,json,png}
# Environment (defaults in brackets): GAMMAS ["3,5,7"], TEMPERATURES ["0"], MT_PER_CATEGORY [10: all 80
#   questions], PROBLEMS [164], MT_BATCH [80], HE_BATCH [16], NEW_TOKENS [256], ACCEPTANCE [token],
#   MTBENCH / HUMANEVAL [fetched], DEVICE [cuda if present], DTYPE [bfloat16], CORPUS [../shared/corpus].
set -euo pipefail
source "$(dirname "$0")/inputs.sh"
files=(); [ -n "${MTBENCH:-}" ] && files+=(--mtbench-file "$MTBENCH")
[ -n "${HUMANEVAL:-}" ] && files+=(--humaneval-file "$HUMANEVAL")
mkdir -p "$dest"
for t in ${TEMPERATURES:-0}; do
  for workload in mt-bench humaneval; do
    if [ $workload = mt-bench ]; then per=${MT_PER_CATEGORY:-10} batch=${MT_BATCH:-80}
    else per=${PROBLEMS:-164} batch=${HE_BATCH:-16}; fi
    "$python" -m flashspec bench acceptance --target "$target" "${draft_args[@]}" --device "$device" \
        --dtype "${DTYPE:-bfloat16}" --styles chat --gammas "${GAMMAS:-3,5,7}" --acceptance "${ACCEPTANCE:-token}" \
        --temperature "$t" --max-new-tokens "${NEW_TOKENS:-256}" --batch "$batch" --corpus "$corpus" \
        --workload $workload "${files[@]}" --prompts-per-domain "$per" --no-warm-up --no-progress \
        --out "$dest/$workload-t$t"
  done
done
