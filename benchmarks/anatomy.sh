#!/usr/bin/env bash
# The speculative step's anatomy on a CUDA GPU (`flashspec bench gpu` without the kernel grid, the maps
# table, transformers and the random-weight shapes): the target's and the drafter's forwards replayed from
# CUDA graphs against a measured step, at batch 1, greedy and T = 0.7, on held-out corpus prompts.
# BENCHMARKS.md, "Kernels".
#
# Usage: benchmarks/anatomy.sh TARGET DRAFTER OUT      (writes OUT/gpu.{md,json})
#   DRAFTER e.g. feature:flashspec/checkpoints/qwen2.5-coder-1.5b-instruct/general
# Environment: CORPUS [../shared/corpus], PROMPTS per domain [2].
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 TARGET DRAFTER OUT" >&2; exit 2; }
python=${PYTHON:-python3}
target=$1 drafter=$2 dest=$3
corpus=${CORPUS:-../shared/corpus}
case $target in /*|./*|../*|*.gguf) [ -e "$target" ] || { echo "no target at $target" >&2; exit 1; } ;; esac
[ -d "$corpus" ] || { echo "no corpus at $corpus (set CORPUS)" >&2; exit 1; }
mkdir -p "$dest"
"$python" -m flashspec bench gpu --target "$target" --draft "$drafter" --corpus "$corpus" --shaped= \
    --no-kernels --no-maps --no-hf --prompts-per-domain "${PROMPTS:-2}" --out "$dest"
