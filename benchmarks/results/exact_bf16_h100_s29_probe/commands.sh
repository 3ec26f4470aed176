#!/usr/bin/env bash
# Session 29's probe on an H100 (two device calls, no model files), on the tree of commit 38cec20 with
# tree_38cec20_plus.diff applied (the split-K finishing kernel launched with PDL) and tests/kernels/test_pdl.py's
# bit-exact case; probe29.py imports that tree's split-K code and does not run against later trees.
# Call 1 (the probe failed on a missing PYTHONPATH; the tests ran: exact_tests_split_k.log):
#   timeout 120 python3 -m pytest -q -p no:cacheprovider -n 3 tests/test_gpu.py tests/kernels/test_pdl.py \
#       -k "bit_exact_logits or pdl" --tb=short > $OUT/exact_tests.log
# Call 2:
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 330 python3 benchmarks/results/exact_bf16_h100_s29_probe/probe29.py $OUT/probe.json > $OUT/probe.log 2>&1
