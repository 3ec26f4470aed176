#!/usr/bin/env bash
# The cost of a draft-tree step, part by part (`flashspec bench tree-anatomy`; SPEC.md §7, "The anatomy of a tree
# step"): per γ (every drafter at γ, so the node budget grows with γ) the measured step beside the proposals, the
# score-verify-commit CUDA graph replayed alone, the target's tree forward alone, staging and host work, the
# allocator's time per step, and the share of the step outside the model forwards. Greedy; EOS does not stop a row.
#
# Usage: benchmarks/tree-anatomy.sh TARGET DRAFTER... OUT      (writes OUT/tree-anatomy.{md,json,png})
#   DRAFTER e.g. feature:flashspec/checkpoints/qwen2.5-coder-1.5b-instruct/general ngram
# Environment (defaults in brackets): DEVICE [cuda if present, else cpu], CORPUS [../shared/corpus],
#   GAMMAS [1,2,3,4], EXPAND [none; e.g. "feature-general=4,16 ngram=3,6", space-separated: that drafter's part of
#   each tree is a top-k expansion], BATCH [1], PROMPTS [6 held-out corpus chat requests; a multiple of BATCH],
#   NEW_TOKENS [128], DTYPE [bfloat16], ROUNDS [20].
set -euo pipefail
source "$(dirname "$0")/inputs.sh"
extra=()
for e in ${EXPAND:-}; do extra+=(--expand "$e"); done
mkdir -p "$dest"
"$python" -m flashspec bench tree-anatomy --target "$target" "${draft_args[@]}" --corpus "$corpus" \
    --device "$device" --dtype "${DTYPE:-bfloat16}" --gammas "${GAMMAS:-1,2,3,4}" --batch "${BATCH:-1}" \
    --prompts "${PROMPTS:-6}" --max-new-tokens "${NEW_TOKENS:-128}" --rounds "${ROUNDS:-20}" "${extra[@]}" \
    --out "$dest"
