"""Issue 22, session 30: does the row count bit-exact mode's tiles are tuned on matter? (scratch probe, kept
beside its result). One process per variant: the Qwen2.5-1.5B shape with random weights, bit-exact mode, not
compiled; the first forward (which autotunes the class-3 tiles, kept for every row count) has FIRST rows, then
one forward of 1, 5, 8 and 40 rows is timed from a CUDA graph (512 cached positions). Appends a JSON line to OUT.
Usage: python3 probe30.py FIRST OUT"""
import json
import sys

import torch

from flashspec.bench.gpu import shaped_model
from flashspec.bench.timing import forward_seconds
from flashspec.cache import StaticLM
from flashspec.kernels import decode_linear

first, out = int(sys.argv[1]), sys.argv[2]
lm = StaticLM(shaped_model("qwen2.5-1.5b"))
lm.bit_exact = True
batch, width = {1: (1, 1), 5: (1, 5), 8: (8, 1), 16: (8, 2), 40: (8, 5)}[first]
forward_seconds(lm, batch, width, context=512, iters=3)  # tunes the tiles on `first` rows
picked = {str(k): str(v) for k, v in decode_linear._tuned.cache.items()}
row = dict(device=torch.cuda.get_device_name(), tuned_on_rows=first, picked=picked,
           ms={f"{b}x{w}": forward_seconds(lm, b, w, context=512, iters=100) * 1e3
               for b, w in ((1, 1), (1, 5), (8, 1), (8, 5))})
print(row, flush=True)
with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")
