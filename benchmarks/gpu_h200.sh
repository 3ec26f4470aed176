#!/usr/bin/env bash
# Issue 3's H200 report in one run: the GPU tests (native Triton, the no-synchronisation loop),
# then `flashspec bench gpu` (copy bandwidth, the verify-kernel grid, the real Qwen2.5-Coder pair
# and the Llama-3-8B shape end to end: roofline, step anatomy, bf16 drift, float32 equality).
#
# Expects, on the GPU machine: /tmp/models/target.gguf and /tmp/models/draft.gguf (joined from
# `split -b` pieces (size: BENCHMARKS.md "How the H200 runs were made"), checked here), the gguf wheel in .whl/ and the corpus in
# device_carry/corpus (both ignored by git; see BENCHMARKS.md "How the H200 runs were made").
# Usage: bash benchmarks/gpu_h200.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_h200.sh OUTDIR}
mkdir -p "$out"
source benchmarks/h200_prepare.sh
# Tests in 8 processes where pytest-xdist is installed (compiling kernel variants is most of their time).
parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
python3 -m pytest -q -p no:cacheprovider $parallel tests/test_gpu.py tests/test_misuse.py tests/kernels/test_verify_triton.py tests/kernels/test_rope_kv.py tests/kernels/test_decode_linear.py tests/kernels/test_pdl.py 2>&1 | tail -4
python3 -m pytest -q -p no:cacheprovider $parallel tests/test_distribution.py -k cuda 2>&1 | tail -2
python3 -m flashspec.cli bench gpu --target /tmp/models/target.gguf --draft /tmp/models/draft.gguf \
    --corpus device_carry/corpus --out "$out/gpu_h200"
echo "gpu_h200.sh done"
