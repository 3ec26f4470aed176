#!/usr/bin/env bash
# Session 28's GPU run (launcher): conversion + the bit-exact CUDA tests, issue 22's run (drift and
# cost in both modes), then every other CUDA test and the kernels' tests natively.
set -uo pipefail
res=/tmp/res; mkdir -p $res
{
  echo "== $(date -u +%H:%M:%S) start $(git log -1 --format=%h 2>/dev/null)"
  GPU_TESTS=bit_exact TRAIN=0 SHALLOW=0 ACCEPTANCE=0 ANATOMY=0 E2E=0 bash benchmarks/selfdraft_h200.sh $res/prep
  tail -5 $res/prep/gpu_tests.log
  CASES=chat_b1,chat_b8,forward,shaped_8b bash benchmarks/exact_bf16_h200.sh $res
  CASES=text_b1 bash benchmarks/exact_bf16_h200.sh $res
  echo "== $(date -u +%H:%M:%S) other CUDA tests"
  PYTHONPATH=/tmp/site:. timeout 420 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_gpu.py tests/kernels \
      tests/test_shallow_reuse.py -k "not bit_exact" > $res/gpu_tests_rest.log 2>&1
  echo "== $(date -u +%H:%M:%S) other CUDA tests exit $?"; tail -5 $res/gpu_tests_rest.log
  echo "== $(date -u +%H:%M:%S) ALL DONE"
} > $res/run.log 2>&1
