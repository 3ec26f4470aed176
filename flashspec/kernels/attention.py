"""Decode attention over :class:`flashspec.models.static.StaticLM`'s static KV cache: a flash-decoding
Triton kernel, and the ``scaled_dot_product_attention`` formulation it replaces.

The problem
-----------
A decode (or verify) forward feeds ``q`` tokens per sequence (1 to ``k + 1``); with ``G = H / H_kv``
query heads per key head there are ``M = G·q`` query rows per ``(sequence, key head)`` and each
row ``m`` attends to cache positions ``0..pos[m]`` of a cache whose capacity ``C`` is far larger
than the positions in use. SDPA with a boolean ``[B, 1, M, C]`` mask reads all ``C`` keys and
values, materialises the mask, and launches for a ``[M, C]`` problem with ``M`` tiny — its cost
is fixed overhead, not data.

Design: flash decoding, split-K
-------------------------------
Tiles: ``BLOCK_N = 64`` keys and ``BLOCK_M`` ∈ {16, 32, 64} query rows (the next power of two
≥ ``M``, at least 16 as ``tl.dot`` needs; padded rows masked) for 16-bit caches; 32 keys and 16
rows for float32 (exact IEEE dots on FMA units need the registers). For ``R = B·H_kv·ceil(M /
BLOCK_M)`` row blocks the key axis is cut into ``S`` splits of ``split_keys`` keys (whole tiles),
``S`` chosen on the host from shapes only (``B``, ``H_kv``, ``M``, ``C`` and the SM count) so
that ``R·S ≈ 2 × SMs`` programs run; ``S ≤ C / BLOCK_N``.

1. ``_split_kernel``, grid ``(R, S)``: a program loads the positions of its ``BLOCK_M`` rows
   and their maximum ``P`` (on the device: no host synchronisation, so calls can be captured in
   CUDA graphs). If its split starts beyond ``P`` it writes the neutral partial ``lse = -inf``
   and exits: a few bytes. Otherwise it loads its query rows once and walks its keys up to
   ``min(split end, P + 1)`` — never a key beyond the largest position — in tiles: scores
   ``Q·Kᵀ`` with ``tl.dot`` (float32 accumulation; exact IEEE float32 for float32 inputs, no
   TF32), key ``n`` masked out of row ``m`` unless ``n ≤ pos[m]``, online softmax in base 2
   (``scale·log2 e`` folded into the scores), ``P·V`` with ``tl.dot`` (``P`` rounded to the
   value dtype, as flash attention does). It writes per ``(row, split)`` the float32 pair
   ``lse = max + log2(Σ)`` and ``o = Σ p·v / Σ p`` (``lse = -inf, o = 0`` for a row that sees no
   key of the split).
2. ``_combine_kernel``, grid ``(B·H_kv, M)`` (one row per program on CUDA; 16 under the
   interpreter, where programs are slow): per row, the splits that can hold its keys
   (``split_start ≤ pos[m]``, derived from the position, so stale partials are never read)
   are folded: ``out = Σ 2^(lse_s − max) o_s / Σ 2^(lse_s − max)``, cast to the query dtype and
   written straight into the output layout.

When one split suffices (``S = 1``: large batches, or ``C ≤ BLOCK_N``) kernel 1 normalises and writes
the output itself and kernel 2 is not launched.

Bit-exact mode (``exact=True``, SPEC.md §14): ``BLOCK_M = 16`` and ``S`` (so the split size) chosen
from ``C`` and the SM count alone, as for one row block, never from ``B`` or ``M``. A query row
then meets the same key tiles, the same splits and the same fold whatever else the call
computes: ``tl.dot`` gives each row the same accumulation whichever rows share its tile, and a
key tile past a row's position (walked because another row of the block needs it) adds exact
zeros (``p = 2^(−∞) = 0``, rescale ``2^0 = 1``). So a token's attention output is bit-identical in
a 1-token forward, in a ``γ+1``-token one and beside other sequences (more programs than needed
for large batches: the price).

Memory traffic (per layer; ``L = max pos + 1`` of each sequence, ``b`` bytes per element)
--------------------------------------------------------------------------------------------
* Keys and values: ``2·B·H_kv·L·D·b`` — each needed key and value is read exactly **once** per
  row block (one block while ``M ≤ 64``, 16-bit), rounded up to whole tiles, nothing past ``L``:
  the floor for exact attention. SDPA reads ``2·B·H_kv·C·D·b`` plus the ``B·M·C`` mask.
  (Qwen2.5-1.5B, bf16, ``B = 1``, ``C = 768``: SDPA reads 786 KB per layer whatever ``L``; this
  kernel 205 KB at ``L = 200``.)
* Queries: ``B·H·q·D·b``, read once per split that has work (tiny: 6 rows × 128 × 2 bytes).
* Partials: ``B·H_kv·M·S·(D + 1)·4`` bytes written by kernel 1 and read once by kernel 2 (only
  splits with keys for the row). ``S`` is at most ``2·SMs / (B·H_kv)`` (12 for the example:
  74 KB), so for small batches, where splitting matters, they are a fraction of the cache read,
  and for large batches ``S → 1`` and they vanish.
* Output: ``B·H·q·D·b`` written once.

Why two kernels rather than one: a single-pass kernel over ``B·H_kv`` programs (2 for
Qwen2.5-1.5B at batch 1) would leave >98 % of an H200 idle and serialise the whole cache read
through two SMs; a split-K kernel that folds its own partials needs a cross-program semaphore
(atomics, memory fences, a counter reset inside the captured graph). The second launch should
cost a couple of µs in a CUDA graph (an estimate: not measured) and reads only the partials; it
disappears when ``S = 1``.

Compilations
------------
``B``, ``M``, ``q``, ``G``, ``C``, ``S``, the split size and the query/output/position strides
are runtime arguments excluded from specialisation. Compiled variants depend on the dtype,
``BLOCK_D`` (head_dim rounded up to a power of two, ≥ 16), ``BLOCK_M`` (from ``M``),
whether ``S = 1``, and for kernel 2 ``BLOCK_S`` (from ``C`` and the SM count only, never the
batch). Cache strides (fixed by ``D`` and ``C``, a multiple of 256) keep their usual 16-divisibility
specialisation.

Every variant was compiled for sm_90 with Triton 3.6's ptxas (``triton.compile`` with a
``GPUTarget``, no GPU): no register spills for 16-bit caches (≤ 16 bytes of stack for float32).

Interpreter notes: under ``TRITON_INTERPRET=1`` (CPU tests) key loops are ``while`` loops (the
3.6 interpreter cannot ``range`` to a runtime bound with numpy ≥ 2.4) and bf16/fp16 tiles are
converted to float32 before ``tl.dot`` (the interpreter multiplies the raw bits of bf16). Products
of bf16 values are exact in float32, so this is the same arithmetic. Compiled, key loops are
``tl.range`` loops that Triton software-pipelines.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

# (absolute imports: tests load this file on its own as well)
from flashspec.kernels import attention_kernels as kernels
from flashspec.kernels import pdl, shim
from flashspec.kernels.shim import next_pow2, triton  # noqa: F401 (triton: None where it does not import)

__all__ = [
    "available",
    "decode_attention",
    "decode_attention_heads",
    "decode_attention_reference",
    "plan_splits",
]

# Tiles of kernel 1 (checked with ptxas for sm_90: no register spills). 16-bit caches: 64 keys,
# up to 64 query rows, 4 warps (8 for 64 rows). float32 (exact IEEE dots): 32 keys, 16 rows, 8 warps.
BLOCK_N = 64
MAX_BLOCK_M = 64
BLOCK_N_FP32 = 32
MAX_BLOCK_M_FP32 = 16
COMBINE_WARPS = 4
MAX_BLOCK_S = 64  # splits folded per step of kernel 2
COMBINE_ROWS: int | None = None  # query rows per program of kernel 2 (None: 1 on CUDA, 16 interpreted)
PROGRAMS_PER_SM = 2  # target of kernel 1's grid size
NUM_STAGES = 2  # software pipelining of the compiled key loop


def available(query: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` can run on ``query``: Triton importable and ``query`` on a
    CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, tests)."""
    return shim.available(query)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``query [B, H_kv, M, D]`` attending, row ``m`` to key positions ``0..query_positions[b, m]``
    of ``keys/values [B, H_kv, C, D]``: SDPA with a boolean mask, as StaticLM does today."""
    capacity = keys.shape[2]
    visible = torch.arange(capacity, device=keys.device) <= query_positions[:, None, :, None]  # [B, 1, M, C]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return PROGRAMS_PER_SM * _sm_count(index)
    return 8  # interpreter: few programs keep CPU tests fast; any value is correct


def _tiles(rows: int, dtype: torch.dtype, exact: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of kernel 1 for ``rows = M`` query rows (bit-exact mode:
    16 rows whatever ``M`` is)."""
    if dtype == torch.float32:
        return MAX_BLOCK_M_FP32, BLOCK_N_FP32, 8
    block_m = 16 if exact else max(16, min(MAX_BLOCK_M, next_pow2(rows)))
    return block_m, BLOCK_N, 8 if block_m >= 64 else 4


def plan_splits(
    row_blocks: int, capacity: int, device: torch.device, num_splits: int | None = None, block_n: int = BLOCK_N
) -> tuple[int, int]:
    """``(num_splits, split_keys)`` for ``row_blocks`` programs' worth of rows over ``capacity``
    keys: whole ``block_n`` tiles per split, about ``2 × SMs`` programs in all (``num_splits``
    forces a count, clamped to ``[1, tiles]``). Shapes only: no device value is read."""
    tiles = -(-capacity // block_n)
    if num_splits is None:
        target = _target_programs(device)
        num_splits = -(-target // max(1, row_blocks))
    num_splits = max(1, min(int(num_splits), tiles))
    tiles_per_split = -(-tiles // num_splits)
    num_splits = -(-tiles // tiles_per_split)
    return num_splits, tiles_per_split * block_n


def _block_s(capacity: int, device: torch.device, block_n: int) -> int:
    """Kernel 2's splits per step: from the largest split count this capacity can get (never
    from the batch, so the batch size does not recompile it)."""
    tiles = -(-capacity // block_n)
    return max(2, min(MAX_BLOCK_S, next_pow2(min(tiles, _target_programs(device)))))


def _check(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    if keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be [B, H_kv, C, D]")
    if query.dim() != 4 or query.shape[0] != keys.shape[0] or query.shape[-1] != keys.shape[-1]:
        raise ValueError(f"query {tuple(query.shape)} does not match keys {tuple(keys.shape)}")
    if query.dtype != keys.dtype or keys.dtype != values.dtype:
        raise ValueError(f"dtypes differ: query {query.dtype}, keys {keys.dtype}, values {values.dtype}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys and values need a unit stride along head_dim")
    if query.device != keys.device or keys.device != values.device:
        raise ValueError("query, keys and values must be on one device")


def _launch(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    groups: int,
    width: int,
    q_strides: tuple[int, int, int],
    o_strides: tuple[int, int, int],
    num_splits: int | None,
    exact: bool = False,
) -> torch.Tensor:
    """Shared launcher. Query row ``m`` of key head ``kv`` is query head ``kv·groups + m // width``
    at token ``j = m % width``; its address is ``b·q_sb + head·q_sh + j·q_st`` (the output's
    likewise with ``o_strides``) and its position ``positions[b, j]``. ``exact``: bit-exact mode
    (module docstring), the tiles and the key-axis splits chosen from the capacity alone."""
    batch, kv_heads, capacity, dim = keys.shape
    rows = groups * width
    if batch == 0 or rows == 0:
        return out
    if positions.dtype != torch.int64:
        positions = positions.to(torch.int64)
    block_m, block_n, warps = _tiles(rows, query.dtype, exact)
    m_blocks = -(-rows // block_m)
    block_d = max(16, next_pow2(dim))
    row_blocks = 1 if exact else batch * kv_heads * m_blocks  # bit-exact: splits from the capacity alone
    splits, split_keys = plan_splits(row_blocks, capacity, keys.device, num_splits, block_n)
    split = splits > 1
    interpreted = not query.is_cuda
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    if split:
        lse = torch.empty(batch * kv_heads * rows * splits, dtype=torch.float32, device=query.device)
        part = torch.empty(batch * kv_heads * rows * splits * dim, dtype=torch.float32, device=query.device)
    else:
        lse = part = out  # unused
    qk_scale = float(scale) * math.log2(math.e)
    use_pdl = pdl.enabled(query.device, exact)  # never in bit-exact mode (pdl.enabled)
    kernels._split_kernel[(batch * kv_heads * m_blocks, splits)](
        query, keys, values, positions, out, lse, part,
        kv_heads, rows, width, groups, capacity, dim, m_blocks, splits, split_keys,
        q_strides[0], q_strides[1], q_strides[2],
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1),
        o_strides[0], o_strides[1], o_strides[2],
        qk_scale,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=split, PRECISION=precision,
        UPCAST=interpreted and query.dtype != torch.float32, INTERPRET=interpreted,
        NUM_STAGES=NUM_STAGES, PDL=use_pdl, num_warps=warps, **pdl.launch_options(query.device, exact),
    )
    if split:
        combine_rows = COMBINE_ROWS if COMBINE_ROWS is not None else (1 if query.is_cuda else 16)
        kernels._combine_kernel[(batch * kv_heads, -(-rows // combine_rows))](
            lse, part, positions, out,
            kv_heads, rows, width, groups, dim, splits, split_keys,
            positions.stride(0), positions.stride(1),
            o_strides[0], o_strides[1], o_strides[2],
            ROWS=combine_rows, BLOCK_S=_block_s(capacity, keys.device, block_n), BLOCK_D=block_d,
            PDL=use_pdl, num_warps=COMBINE_WARPS, **pdl.launch_options(query.device, exact),
        )
    return out


def _folded(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor, scale: float,
    num_splits: int | None = None, exact: bool = False,
) -> torch.Tensor:
    _check(query, keys, values)
    batch, kv_heads, rows, dim = query.shape
    if query.shape[1] != keys.shape[1]:
        raise ValueError(f"query {tuple(query.shape)} must have H_kv = {keys.shape[1]} heads")
    if tuple(query_positions.shape) != (batch, rows):
        raise ValueError(f"query_positions {tuple(query_positions.shape)} must be [B, M] = {(batch, rows)}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    return _launch(
        query, keys, values, query_positions, scale, out, 1, rows,
        (query.stride(0), query.stride(1), query.stride(2)),
        (out.stride(0), out.stride(1), out.stride(2)),
        num_splits, exact,
    )


def _heads(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float,
    num_splits: int | None = None, exact: bool = False,
) -> torch.Tensor:
    _check(query, keys, values)
    batch, heads, width, dim = query.shape
    kv_heads = keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key heads")
    if tuple(positions.shape) != (batch, width):
        raise ValueError(f"positions {tuple(positions.shape)} must be [B, q] = {(batch, width)}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty((batch, width, heads, dim), dtype=query.dtype, device=query.device)
    return _launch(
        query, keys, values, positions, scale, out, heads // kv_heads, width,
        (query.stride(0), query.stride(1), query.stride(2)),
        (out.stride(0), out.stride(2), out.stride(1)),
        num_splits, exact,
    )


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """Attention of ``query [B, H_kv, M, D]`` (any strides, unit stride along ``D``) over
    ``keys/values [B, H_kv, C, D]``: row ``m`` of sequence ``b`` sees key positions
    ``0..query_positions[b, m]`` (``[B, M]`` integers in ``[0, C)``). Returns a new contiguous
    ``[B, H_kv, M, D]`` tensor in ``query``'s dtype, equal to :func:`decode_attention_reference`
    up to float rounding. ``num_splits`` forces the key-axis split count (tests). ``exact``: each
    row's output bit-identical whatever the other rows and sequences of the call are (bit-exact
    mode, module docstring).

    Under ``torch.compile`` it goes through the opaque custom op
    ``torch.ops.flashspec.decode_attention`` (no graph break)."""
    if num_splits is None and _compiling() and _OPS:
        return torch.ops.flashspec.decode_attention(query, keys, values, query_positions, float(scale), bool(exact))
    return _folded(query, keys, values, query_positions, scale, num_splits, exact)


def decode_attention_heads(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """The same attention with the query heads unfolded, as StaticLM holds them: ``query [B, H,
    q, D]`` — any strides with a unit one along ``D``, e.g. the ``transpose(1, 2)`` of a ``[B, q, H,
    D]`` tensor, no copy — where head ``h`` uses key head ``h // (H / H_kv)``, and ``positions [B,
    q]`` (token ``j`` sees ``0..positions[b, j]``). Returns a new contiguous ``[B, q, H, D]``
    tensor, so ``out.view(B, q, H·D)`` feeds ``o_proj`` without a transpose copy. ``exact`` as for
    :func:`decode_attention`: token ``j``'s output is the same whatever ``q`` and ``B`` are.

    Under ``torch.compile`` it goes through the opaque custom op
    ``torch.ops.flashspec.decode_attention_heads`` (no graph break)."""
    if num_splits is None and _compiling() and _OPS:
        return torch.ops.flashspec.decode_attention_heads(query, keys, values, positions, float(scale), bool(exact))
    return _heads(query, keys, values, positions, scale, num_splits, exact)


def _register_ops() -> bool:
    """Register the two custom ops (once per process, even if this module is loaded twice)."""
    if not hasattr(torch.library, "custom_op"):  # pragma: no cover - torch < 2.4
        return False
    schema = "(Tensor query, Tensor keys, Tensor values, Tensor positions, float scale, bool exact=False) -> Tensor"
    namespace = torch.ops.flashspec

    def fake_folded(query, keys, values, positions, scale, exact=False):
        return query.new_empty(query.shape)

    def fake_heads(query, keys, values, positions, scale, exact=False):
        batch, heads, width, dim = query.shape
        return query.new_empty((batch, width, heads, dim))

    ops = (("decode_attention", _folded, fake_folded), ("decode_attention_heads", _heads, fake_heads))
    for name, impl, fake in ops:
        if hasattr(namespace, name):
            continue

        def run(query, keys, values, positions, scale, exact=False, _impl=impl):
            return _impl(query, keys, values, positions, scale, exact=exact)

        op = torch.library.custom_op(f"flashspec::{name}", run, mutates_args=(), schema=schema)
        op.register_fake(fake)
    return True


_OPS = _register_ops()
