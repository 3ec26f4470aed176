#!/usr/bin/env bash
# Issue 5 on the H200: `flashspec bench e2e` with the real Qwen2.5-Coder pair (long regime at
# batch 1 and 8) and the Llama-3-8B / 3.2-1B shapes (step costs), each a separate run so that one
# failure loses one report, not all. The batch-8 and shaped runs are smaller (fewer prompts, γ = 4
# only) so that all three fit one session's 30 minutes of device time with the model transfer.
#
# Expects, on the GPU machine: /tmp/models/target.gguf and /tmp/models/draft.gguf (joined from
# `split -b` pieces (size: BENCHMARKS.md "How the H200 runs were made"), checked here), the gguf wheel in .whl/ and the corpus in
# device_carry/corpus (both ignored by git; see BENCHMARKS.md "How the H200 runs were made").
# transformers' systems run on the first 3 prompts of each domain at batch 1 (at 20-50 tokens/s they
# would take most of the session's GPU time); FlashSpec's on all 20; ratios are paired per prompt.
# Usage: bash benchmarks/e2e_h200.sh OUTDIR
set -uo pipefail
out=${1:?usage: e2e_h200.sh OUTDIR}
mkdir -p "$out"
source benchmarks/h200_prepare.sh
pair=(--target /tmp/models/target.gguf --draft /tmp/models/draft.gguf --draft ngram
      --corpus device_carry/corpus --device cuda --dtype bfloat16 --compile)
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }

stamp "real pair, long regime, batch 1"
python3 -m flashspec.cli bench e2e "${pair[@]}" --gammas 2,4 --regimes long --batch-sizes 1 --prompts-per-domain 20 \
    --hf-prompts-per-domain 3 --out "$out/long_b1" > "$out/long_b1.log" 2>&1
stamp "exit $?"
stamp "Llama-3-8B / 3.2-1B shapes, long regime, batch 1"
python3 -m flashspec.cli bench e2e --shaped --device cuda --dtype bfloat16 --compile --gammas 4 --no-progress \
    --regimes long --batch-sizes 1 --prompts-per-domain 3 --hf-prompts-per-domain 1 \
    --systems hf,flashspec,flashspec-fixed --out "$out/shaped_8b" > "$out/shaped_8b.log" 2>&1
stamp "exit $?"
stamp "real pair, long regime, batch 8"
python3 -m flashspec.cli bench e2e "${pair[@]}" --gammas 4 --regimes long --batch-sizes 8 --prompts-per-domain 8 \
    --systems hf,flashspec,flashspec-fixed,flashspec-bandit --out "$out/long_b8" > "$out/long_b8.log" 2>&1
stamp "exit $?"
stamp "done"
