#!/usr/bin/env bash
# Kernels on a CUDA GPU (`flashspec bench gpu`): copy bandwidth; the verification kernels against the PyTorch
# reference over 135 points (batch, γ, vocabulary, sampling mode), eager and replayed from CUDA graphs; the
# target's decode forward against its HBM roofline and by the linear maps sent through `decode_linear`; the
# speculative step against its forwards; bf16 drift and float32 equality; the same for a Llama-3-8B-shaped
# target with random weights. BENCHMARKS.md, "Kernels".
#
# Usage: benchmarks/kernels.sh TARGET DRAFTER OUT      (writes OUT/gpu.{md,json} and OUT/kernels.md)
# Environment: CORPUS [../shared/corpus], PROMPTS per domain [4].
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 TARGET DRAFTER OUT" >&2; exit 2; }
python=${PYTHON:-python3}
target=$1 drafter=$2 dest=$3
corpus=${CORPUS:-../shared/corpus}
case $target in /*|./*|../*|*.gguf) [ -e "$target" ] || { echo "no target at $target" >&2; exit 1; } ;; esac
[ -d "$corpus" ] || { echo "no corpus at $corpus (set CORPUS)" >&2; exit 1; }
mkdir -p "$dest"
"$python" -m flashspec bench gpu --target "$target" --draft "$drafter" --corpus "$corpus" \
    --prompts-per-domain "${PROMPTS:-4}" --out "$dest"
