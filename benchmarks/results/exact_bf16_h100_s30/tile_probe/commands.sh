# Session 30's fourth device call (tree: the commit adding this file): bit-exact tiles tuned on 1, 5, 16 or 40 rows
export PYTHONPATH=.
for first in 1 40 5 16; do
  timeout 100 python3 benchmarks/results/exact_bf16_h100_s30/tile_probe/probe30.py $first $OUT/tiles.jsonl
done
