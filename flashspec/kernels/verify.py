"""The Triton backend of :func:`flashspec.verify.verify`: the rule of SPEC.md §2, fused.

Design
------
Rows are the ``B·(k+1)`` target positions, ``V`` the vocabulary, ``CHUNK = 4096`` (smaller only
when ``V`` is). Greedy runs kernels 1–3, sampling 1–5; every kernel handles a tile of rows or
sequences, so nothing loops over positions or sequences one by one on the host.

1. ``_partials_kernel``, grid ``(rows, cdiv(V, CHUNK))``: each program reads one ``CHUNK`` slice
   of a logits row, once, in the logits' own dtype, and writes one partial: greedy, the slice's
   maximum and the first index reaching it; sampling, the maximum ``m`` of ``z = logit / T`` (in
   float32) and ``s = Σ exp(z − m)`` (an all ``-inf`` slice gives ``m = -inf, s = 0``, no NaN).
2. ``_rows_kernel``, ``FOLD_ROWS`` rows per program: folds each row's partials into the row's
   argmax (first index of the maximum, as ``torch.argmax``) or its log-sum-exp pair ``(M, S)``.
3. ``_decide_kernel``: per sequence, all positions at once (16 per step): greedy accepts
   ``d_i == argmax_i``; sampling loads the one logit at each draft and accepts
   ``u_i · q_i(d_i) < p_i(d_i)`` in float64 (``p = exp(z − M) / S`` in float32, as ``softmax``;
   ``q = 1`` without draft probabilities). A prefix sum of the rejections gives ``n`` (prefix
   only) without a branch. Greedy then writes the tokens; the new one is row ``n``'s argmax.
4. ``_residual_kernel``, grid ``(B, cdiv(V, CHUNK))``: one slice of row ``n`` and of ``q_n``
   (one-hot of ``d_n`` without draft probabilities; zero when ``n = k``): the float64 mass of
   ``r = max(0, p_n − q_n)`` and its last positive index.
5. ``_draw_kernel``: the inverse-CDF draw with ``u_k`` from ``r``: the chunk masses locate the
   chunk holding ``u_k · total``, only that chunk is scanned (a float64 prefix sum), and the token
   is clamped to the last positive index, as :func:`flashspec.sampling.sample` does. When ``r``
   has no mass (``p_n ≤ q_n`` everywhere, which needs ``p_n == q_n`` up to rounding) the draw is
   from ``p_n``, whose chunk masses this kernel then computes itself, for those sequences only:
   one more pass over their row, in a case that practically never occurs. It writes the tokens.

top-k and top-p need a sort of every row, which does not stream; for them the logits first go
through :func:`flashspec.sampling.process_logits` in PyTorch (float32, ``-inf`` for removed
tokens) and the same kernels run on that with ``T = 1``. Exact, but slower.

Memory traffic
--------------
* The logits are read **once** (kernel 1): ``B·(k+1)·V`` elements. That is the floor of any exact
  method, and it is not O(1) in ``V``.
* Sampling reads row ``n`` of the logits (and of ``q``) once more per sequence (kernel 4) plus
  one ``CHUNK`` of it (kernel 5): ``≈ B·(V + CHUNK)·(logit + q bytes)``, a ``1/(k+1)`` fraction
  of the logits on top (and row ``n`` once more where ``r`` has no mass). Greedy reads no logits
  again.
* Per-row state is O(1) in ``V``; the partial buffers are ``O(V / CHUNK)`` per row (8 bytes per
  4096 logits, 12 per sequence for the residual); drafts, uniforms, ``q`` at the drafts and the
  outputs are O(k) per sequence.
* top-k/top-p preprocessing in PyTorch (topk, sort, softmax, cumsum, scatter) materialises
  float32 logits and makes several full passes over ``B·(k+1)·V``; it dominates that mode.

Properties
----------
* Same law as the reference; given the same uniforms the same tokens and accept lengths, except
  where a decision lies within float rounding of its boundary (SPEC.md §2, "Exactness"): ``exp``
  (on CUDA the hardware approximation, where PyTorch uses libdevice's ``expf``) and the order of
  the float32 sums differ from PyTorch's by a few ulps. With a large vocabulary an inverse-CDF
  draw has ``~V`` boundaries, so such flips become measurable: 1–2 sequences in 1,000 at
  ``V = 128256`` (γ = 4, T = 0.7), each within ~2e-7 (relative) of its boundary
  (:func:`flashspec.bench.kernels.parity_stress`); any two float32 softmax implementations that
  sum in different orders can disagree so. Greedy compares raw logits exactly: identical.
* No host synchronisation: outputs and buffers are ``torch.empty`` on the logits' device and no
  value is read back, so a call can be captured in a CUDA graph.
* No recompilation per batch size or ``k``: ``B``, ``k``, strides, ``T`` and the chunk count are
  runtime arguments excluded from specialisation, and tile sizes depend on ``V`` only.
  Compilations depend on the dtypes, the mode, whether ``q`` is given, the 16-alignment of the
  strides and ``V``'s divisibility class (and ``CHUNK``/tiles for ``V < 4096``).
  :func:`compiled_variants` counts them.
* Draft ids outside ``[0, V)`` are rejected rather than read (the reference raises instead).

Interpreter notes: the kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors (that is how
CI tests them; ``T`` is then applied by division, as PyTorch does on the CPU, while on CUDA it is
a product with ``float32(1/T)``, as PyTorch does there). To keep that fast, reductions call
``tl.reduce``/``tl.associative_scan`` with Triton's own combine functions (compiled, identical to
``tl.max``/``tl.sum``/``tl.cumsum``), helpers are plain functions under the interpreter, and index
math is int64; loops over runtime bounds are ``while`` loops (the 3.6 interpreter cannot
``range`` to a runtime int with numpy >= 2.4) and masks never combine a block with a scalar bool
(the interpreter mistypes that).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..sampling import SamplingParams, process_logits
from . import shim
from . import verify_kernels as kernels
from .shim import interpreted, next_pow2, triton
from .verify_kernels import (
    CHUNK_MAX,
    CHUNK_WARPS,
    DRAW_WARPS,
    FOLD_ROWS,
    FOLD_WARPS,
    PARTIAL_BLOCK,
    POSITION_BLOCK,
    SCAN_BLOCK,
    SEQ_TILE,
    SEQ_WARPS,
    TILE,
)

__all__ = ["compiled_variants", "verify_triton"]

# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _tiles(vocab: int) -> dict[str, int]:
    """Tile sizes, a function of ``V`` only (so ``B`` and ``k`` never change a compilation).

    Large vocabularies get one row per program in kernels 1 and 4 and one sequence per program in
    kernel 5; small ones pack rows/sequences so that a program still covers ~``TILE`` logits.
    """
    chunk = min(CHUNK_MAX, max(16, next_pow2(vocab)))
    num_chunks = -(-vocab // chunk)
    scan = min(chunk, SCAN_BLOCK)
    partials = min(PARTIAL_BLOCK, next_pow2(num_chunks))
    return {
        "chunk": chunk,
        "num_chunks": num_chunks,
        "partials": partials,
        "rows": max(1, TILE // chunk),
        "seqs": max(SEQ_TILE, min(TILE // chunk, 256)),
        "scan": scan,
        "draw_seqs": max(1, SCAN_BLOCK // scan),
    }


def _math_mode(device: torch.device) -> int:
    """0: CPU math (the interpreter); 1: CUDA math (``T`` as a product, the hardware ``exp``)."""
    return 0 if device.type != "cuda" or interpreted() else 1


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def verify_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    uniforms: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_accepted [B] long, tokens [B, k+1] long)`` by the rule of SPEC.md §2.

    Inputs as for :func:`flashspec.verify.verify`, which validates shapes before calling this.
    Every tensor must be on the logits' device. No host synchronisation.
    """
    shim.require("verify_triton", target_logits)
    batch, k1, vocab = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    for name, t in (("draft_tokens", draft_tokens), ("draft_probs", draft_probs), ("uniforms", uniforms)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but target_logits is on {device}.")

    greedy = not params.do_sample
    logits, temperature = target_logits, 1.0
    if not greedy:
        if 0 < params.top_k < vocab or params.top_p < 1.0:
            logits = process_logits(target_logits, params)  # float32, T applied, -inf removed
        else:
            temperature = float(params.temperature)
    math_mode = _math_mode(device)
    if math_mode != 0:
        temperature = float(np.float32(1.0) / np.float32(temperature))  # as torch's CUDA division
    logits = _last_contiguous(logits)
    stride_b, stride_i = logits.stride(0), logits.stride(1)

    tiles = _tiles(vocab)
    chunk, num_chunks = tiles["chunk"], tiles["num_chunks"]
    rows = batch * k1
    part_m = torch.empty((rows, num_chunks), dtype=torch.float32, device=device)
    part_x = torch.empty((rows, num_chunks), dtype=torch.int32 if greedy else torch.float32, device=device)
    num_accepted = torch.empty((batch,), dtype=torch.long, device=device)
    tokens = torch.empty((batch, k1), dtype=torch.long, device=device)
    # k = 0: a placeholder that is never read (every draft load is masked).
    drafts = draft_tokens.long() if k > 0 else torch.empty((batch, 1), dtype=torch.long, device=device)
    d_strides = (drafts.stride(0), drafts.stride(1))
    aligned = stride_b % 16 == 0 and stride_i % 16 == 0
    has_q = not greedy and draft_probs is not None and k > 0
    q = _last_contiguous(draft_probs) if has_q else part_m  # part_m: a placeholder, never read
    q_strides = (q.stride(0), q.stride(1))
    aligned_q = aligned and (not has_q or all(s % 16 == 0 for s in q_strides))
    u = part_m if greedy else uniforms if uniforms.dtype == torch.float64 else uniforms.double()
    u_strides = (u.stride(0), u.stride(1))
    row_m = torch.empty((rows,), dtype=torch.float32, device=device)
    row_x = torch.empty((rows,), dtype=torch.int32 if greedy else torch.float32, device=device)
    seqs, kb = tiles["seqs"], POSITION_BLOCK

    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        kernels._partials_kernel[(triton.cdiv(rows, tiles["rows"]), num_chunks)](
            logits, part_m, part_x, vocab, rows, k1, stride_b, stride_i, num_chunks, temperature,
            GREEDY=greedy, ALIGNED=aligned, ROWS=tiles["rows"], CHUNK=chunk, MATH=math_mode, num_warps=CHUNK_WARPS,
        )
        kernels._rows_kernel[(triton.cdiv(rows, FOLD_ROWS),)](
            part_m, part_x, row_m, row_x, rows, num_chunks,
            GREEDY=greedy, ROWS=FOLD_ROWS, PARTIALS=tiles["partials"], num_warps=FOLD_WARPS,
        )
        kernels._decide_kernel[(triton.cdiv(batch, seqs),)](
            logits, row_m, row_x, drafts, q, u, num_accepted, tokens,
            vocab, batch, k1, stride_b, stride_i, temperature, *d_strides, *q_strides, *u_strides,
            GREEDY=greedy, HAS_Q=has_q, SEQS=seqs, KB=kb, MATH=math_mode, num_warps=SEQ_WARPS,
        )
        if greedy:
            return num_accepted, tokens

        mass = torch.empty((batch, num_chunks), dtype=torch.float64, device=device)  # of r per chunk
        last = torch.empty((batch, num_chunks), dtype=torch.int32, device=device)  # last index r > 0
        shape_args = (vocab, batch, k1, stride_b, stride_i, num_chunks, temperature, *d_strides, *q_strides)
        kernels._residual_kernel[(triton.cdiv(batch, tiles["rows"]), num_chunks)](
            logits, q, drafts, num_accepted, row_m, row_x, mass, last, *shape_args,
            HAS_Q=has_q, ALIGNED=aligned_q, ROWS=tiles["rows"], CHUNK=chunk, MATH=math_mode, num_warps=CHUNK_WARPS,
        )
        kernels._draw_kernel[(triton.cdiv(batch, tiles["draw_seqs"]),)](
            logits, q, drafts, u, num_accepted, row_m, row_x, mass, last, tokens,
            *shape_args, *u_strides, HAS_Q=has_q, SEQS=tiles["draw_seqs"], PARTIALS=tiles["partials"], CHUNK=chunk,
            BLOCK=tiles["scan"], KB=kb, MATH=math_mode, num_warps=DRAW_WARPS,
        )
    return num_accepted, tokens


def compiled_variants() -> int:
    """Number of compiled kernel variants cached in this process (0 under the interpreter).

    Calls that differ only in batch size, ``k``, strides or temperature must not raise it.
    """
    total = 0
    for kernel in kernels.KERNELS:
        for cache in getattr(kernel, "device_caches", {}).values():
            total += len(cache[0])
    return total
