#!/usr/bin/env bash
# The H200 report in one run: `flashspec bench gpu` (issue 3: copy bandwidth, verify kernels,
# roofline, step anatomy, bf16 drift, float32 equality) and `flashspec bench select` (issue 4:
# bandits against every fixed arm on a mixed workload), with the real Qwen2.5-Coder pair.
#
# Expects, on the GPU machine: /tmp/models/target.gguf and /tmp/models/draft.gguf (joined from
# `split -b` pieces (size: BENCHMARKS.md "How the H200 runs were made"), checked here), the gguf wheel in .whl/ and the corpus in
# device_carry/corpus (both ignored by git; see BENCHMARKS.md "How the H200 runs were made").
# Usage: bash benchmarks/h200_session.sh OUTDIR
set -uo pipefail
out=${1:?usage: h200_session.sh OUTDIR}
mkdir -p "$out"
source benchmarks/h200_prepare.sh
python3 -m flashspec.cli bench gpu --target /tmp/models/target.gguf --draft /tmp/models/draft.gguf \
    --corpus device_carry/corpus --out "$out/gpu_h200"
python3 -m flashspec.cli bench select --target /tmp/models/target.gguf \
    --draft /tmp/models/draft.gguf --draft ngram --gammas 2,4 --selectors thompson,sliding-window-ucb \
    --corpus device_carry/corpus --prompts-per-domain 8 --prompt-tokens 256 --max-new-tokens 256 \
    --device cuda --dtype bfloat16 --compile --out "$out/select_h200.json"
