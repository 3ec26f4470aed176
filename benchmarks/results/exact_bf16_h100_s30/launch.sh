#!/usr/bin/env bash
# Session 30's GPU run (launcher): conversion + the bit-exact CUDA tests, issue 22's run (drift and
# cost in both modes), the bit-exact kernel tests natively.
set -uo pipefail
res=/tmp/res; mkdir -p $res
{
  echo "== $(date -u +%H:%M:%S) start; tree: $(cat device_carry/COMMIT 2>/dev/null) (written here before the transfer)"
  GPU_TESTS=bit_exact TRAIN=0 SHALLOW=0 ACCEPTANCE=0 ANATOMY=0 E2E=0 bash benchmarks/selfdraft_h200.sh $res/prep
  tail -5 $res/prep/gpu_tests.log
  echo "== $(date -u +%H:%M:%S) bit-exact kernel tests (stages and column tiles change no bit, natively)"
  PYTHONPATH=/tmp/site:. timeout 90 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_decode_linear.py \
      tests/kernels/test_pdl.py -k "column_tiles or pdl" > $res/kernel_tests.log 2>&1
  echo "== $(date -u +%H:%M:%S) kernel tests exit $?"; tail -3 $res/kernel_tests.log
  CASES=chat_b1 bash benchmarks/exact_bf16_h200.sh $res
  CASES=chat_b8 bash benchmarks/exact_bf16_h200.sh $res
  CASES=shaped_8b bash benchmarks/exact_bf16_h200.sh $res
  CASES=forward bash benchmarks/exact_bf16_h200.sh $res
  CASES=text_b1 bash benchmarks/exact_bf16_h200.sh $res
  echo "== $(date -u +%H:%M:%S) ALL DONE"
} > $res/run.log 2>&1
