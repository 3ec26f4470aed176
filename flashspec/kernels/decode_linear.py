"""The linear maps of a decode forward, with the element-wise work around them fused in: one
Triton kernel per matrix.

A decode (or verify) forward of :class:`flashspec.models.static.StaticLM` multiplies ``M = B·q ≤ 16``
token rows by each weight matrix: a matrix–vector product whose cost is reading the weights.
cuBLAS runs the small ones of a 1.5B model far below the copy bandwidth (Qwen2.5-1.5B on an
H200: the 4.7 MB output projection took 6.0 µs, 0.8 TB/s), and every element-wise step between
them (two RMSNorms, SiLU·up, two residual adds) is a kernel of its own. :func:`decode_linear`
computes any of

* ``qkv  = linear(rms_norm(x))``                    — ``norm_weight`` given
* ``x    = x + linear(attention)``                  — ``residual`` given
* ``h    = silu(gate) · up`` of ``linear(rms_norm(x))`` with ``[gate; up]`` stacked — ``gated``
* ``x    = x + linear(h)``                          — ``residual`` given

in one launch. :class:`~flashspec.models.static.StaticLM` chooses which maps go through it
(``StaticLM.decode_maps`` for forwards of one token row, ``decode_maps_wide`` for 2 to 16).

Two inner products; on CUDA the autotuner picks a tile of one per matrix and row class:

* **CUDA cores** (one token row) — float32 products of ``BLOCK_N × BLOCK_K`` blocks summed
  element-wise over ``K`` and reduced once; 1 to 8 weight rows per program, so even a 1,536-row
  matrix spreads over hundreds of programs. With the weights cold in L2 (an H200;
  BENCHMARKS.md, "Kernels") it beats cuBLAS's ``F.linear`` on the output projection
  (Qwen2.5-1.5B shape 3.7 against 6.6 µs, Llama-3-8B shape 10.7 against 12.8), the down
  projection (9.5 against 11.2; 31.1 against 32.6) and the 1.5B's q/k/v (4.8 against 5.3),
  norm, SiLU·up and residual add included; it loses on the 8B's gate/up (68.7 against 58.8 µs)
  and q/k/v (19.1 against 16.8).
* **tensor cores** (2 to 16 rows) — the rows as one 16-row tile (padded), ``tl.dot`` per block of
  ``K``; 16 to 64 weight rows per program. At 5 rows it beats cuBLAS on the output projection
  (1.5B 5.0 against 6.0 µs; 8B 11.8 against 12.8) and loses elsewhere (1.5B down 15.4 against
  11.3 µs): too few bytes in flight. The CUDA-core loop run row after row re-reads the weights
  per row and is 1.3-3.5× slower than cuBLAS at 5 rows, so it is not offered for several rows.

Arithmetic (SPEC.md §3)
-----------------------
* RMSNorm exactly as transformers' Llama/Qwen/Mistral norms: ``r = rsqrt(mean(x²) + eps)`` in
  float32, ``n = round(x·r)``, ``h = round(w·n)`` (``round`` = to the input's 16-bit dtype).
* The product accumulates in float32 (tensor cores), bias added in float32, rounded once: what
  cuBLAS's epilogue does, in another summation order.
* ``silu(round(gate))·round(up)`` in float32, rounded once (inductor's fused SiLU·up); the residual
  add in float32, rounded once.

**Batch invariance, within a row class.** Among calls of 2 to 16 rows, row ``m`` of the result
is computed by the same instructions whatever ``M`` is (the tensor-core tile is always 16 rows,
padded, and its configuration is chosen per ``(N, K)`` and row class, never per ``M``), so a
token's outputs are bit-identical whether it is verified with 1 or 15 others. A 1-row call runs
another inner product (the CUDA cores: faster there) and may round differently from the same row
in a wider call, as cuBLAS's kernels for different ``M`` do: 1-token and ``γ+1``-token forwards
can differ in the last bit (SPEC.md §7 says what "exact" means in bf16). Without autotuning (small
matrices, the interpreter) one fixed configuration serves every ``M``, and every row count agrees.

**Bit-exact mode** (``exact=True``, SPEC.md §14). Every call runs the tensor-core inner product,
one or many 16-row tiles (``ceil(M / 16)`` programs per column block, so ``M`` is not capped at
16; they are adjacent in the grid, run together and share the block's weights through L2), with
one K tile (``EXACT_BLOCK_K``) and a column tile and pipeline depth chosen per ``(N, K)`` and
options for every ``M`` (its own autotuning class, 3). Row ``m``'s result is then computed by the
same instructions whatever ``M`` is and wherever ``m`` falls in its tile — ``tl.dot``'s
per-element accumulation does not depend on the tile's other rows, and the RMSNorm of the rows is
a per-row sum over the same ``[16, BLOCK_K]`` tiles — so a token's outputs are bit-identical in a
1-row forward and in a wider one. Neither the column tile nor the pipeline depth changes a bit
(each column's chain of tensor-core steps over ``K`` is the same), so two processes agree too.
Narrow maps keep their whole ``K`` per program: splitting ``K`` into chunks summed by a second
kernel was measured slower on every map of the Qwen2.5-1.5B shape (an H100; CHANGELOG.md),
while a deeper pipeline (5 stages) made the 1,536-column maps up to 1.45× faster.

Grid and traffic: ``ceil(N / BLOCK_N)`` programs (times the row tiles in bit-exact mode); each
reads its ``BLOCK_N`` weight rows once (``2·BLOCK_N`` for ``gated``) and the ``M ≤ 16`` input rows
from L2. Weights are read from memory once per call: ``N·K·b`` bytes (``2·N·K·b`` gated), the floor. No atomics, no
split-K: results are deterministic. On CUDA the tile sizes of matrices of at least 2²⁰ elements
are autotuned once per ``(N, K)``, options and row class (one row, several, bit-exact); smaller
ones (tests) take one fixed tile.
"""

from __future__ import annotations

import torch

from . import pdl, shim
from .shim import tl, triton

__all__ = ["MAX_ROWS", "available", "decode_linear", "decode_linear_reference"]

MAX_ROWS = 16  # token rows per call: one row tile; larger forwards belong to cuBLAS
_TUNED_SIZE = 1 << 20  # weights of at least this many elements get their tiles autotuned on CUDA
# The configuration of smaller matrices and of the interpreter (tests switch USE_DOT to cover both).
_FIXED = {"USE_DOT": False, "BLOCK_N": 4, "BLOCK_K": 32}
_FIXED_EXACT = {"USE_DOT": True, "BLOCK_N": 16, "BLOCK_K": 32}  # bit-exact mode: tensor-core tiles only
EXACT_BLOCK_K = 256  # bit-exact mode's one K tile on CUDA (its autotuning class varies column tiles and stages)
ROW_TILE = 16  # rows per tensor-core tile


def available(x: torch.Tensor) -> bool:
    """Whether the kernel can run on ``x``'s device: CUDA with Triton, or the CPU under Triton's
    interpreter (tests)."""
    return shim.available(x)


def decode_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """What :func:`decode_linear` computes, in PyTorch (float32 accumulation, the roundings of
    the module docstring)."""
    dtype = x.dtype
    h = x
    if norm_weight is not None:
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        h = (norm_weight.float() * h.float()).to(dtype)
    y = h.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(dtype)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
    if residual is not None:
        y = (residual.float() + y.float()).to(dtype)
    return y


def _check(x, weight, bias, norm_weight, residual, gated, exact=False) -> None:
    shim.require("decode_linear", x)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"decode_linear runs 16-bit activations (bfloat16 or float16), got {x.dtype}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} must be [..., K] for a weight [N, K], got weight {tuple(weight.shape)}")
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_ROWS and not exact:
        raise ValueError(f"decode_linear takes at most {MAX_ROWS} token rows per call, got {rows}; "
                         "use torch.nn.functional.linear for larger forwards")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gated needs [gate; up] stacked: an even number of weight rows, got {weight.shape[0]}")
    out = weight.shape[0] // 2 if gated else weight.shape[0]
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")
    if norm_weight is not None and norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} must be [{x.shape[-1]}]")
    if residual is not None and residual.shape != (*x.shape[:-1], out):
        raise ValueError(f"residual {tuple(residual.shape)} must be {(*x.shape[:-1], out)}")
    tensors = [t for t in (x, weight, bias, norm_weight, residual) if t is not None]
    if any(t.dtype != x.dtype for t in tensors):
        raise ValueError(f"every tensor must share x's dtype {x.dtype}, got {[t.dtype for t in tensors]}")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("all tensors must be on one device")
    if weight.stride(1) != 1:
        raise ValueError("weight needs a unit stride along K (a row-major [N, K] matrix or rows of one)")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    gated: bool,
    exact: bool = False,
) -> torch.Tensor:
    _check(x, weight, bias, norm_weight, residual, gated, exact)
    k = x.shape[-1]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    res = residual.reshape(m, n).contiguous() if residual is not None else out
    # The kernel reads bias and norm weights with unit stride: strided views are copied first.
    bias = bias.contiguous() if bias is not None else None
    norm_weight = norm_weight.contiguous() if norm_weight is not None else None
    args = (rows, weight, bias if bias is not None else out, norm_weight if norm_weight is not None else rows,
            res, out, m, n, k, float(eps), rows.stride(0), weight.stride(0), _row_class(m, exact))
    flags = dict(HAS_BIAS=bias is not None, NORM=norm_weight is not None, RESIDUAL=residual is not None,
                 GATED=bool(gated), UPCAST=not x.is_cuda, PDL=pdl.enabled(x.device, exact),
                 **pdl.launch_options(x.device, exact))
    # One program per (column block, row tile), the row tiles of a column block side by side so
    # they run together and read its weights from L2 (bit-exact mode; M ≤ 16 is one tile).
    row_tiles = triton.cdiv(m, ROW_TILE) if exact else 1
    if x.is_cuda and n * k >= _TUNED_SIZE:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]) * row_tiles,)  # noqa: E731
        _tuned[grid](*args, **flags)
    else:  # small matrices (tests) and the interpreter: one fixed configuration
        config = dict(_FIXED_EXACT if exact else _FIXED)
        config["BLOCK_K"] = 256 if x.is_cuda else config["BLOCK_K"]
        _decode_linear_kernel[(triton.cdiv(n, config["BLOCK_N"]) * row_tiles,)](*args, **flags, **config)
    return out.view(*x.shape[:-1], n)


def _row_class(rows: int, exact: bool = False) -> int:
    """The autotuner's row class: 1 for one token row (CUDA-core tiles), 2 for 2 to 16 rows
    (tensor-core tiles), 3 for any number of rows in bit-exact mode (tensor-core tiles, one
    configuration for every row count)."""
    if exact:
        return 3
    return 1 if rows == 1 else 2


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    exact: bool = False,
) -> torch.Tensor:
    """``y = x' @ weight.T + bias`` for ``x [..., K]`` with at most :data:`MAX_ROWS` rows, where
    ``x' = rms_norm(x) · norm_weight`` if ``norm_weight [K]`` is given, else ``x``. With ``gated``
    the weight is ``[gate; up]`` (``[2N, K]``) and the result ``silu(gate) · up`` (``[..., N]``);
    with ``residual [..., N]`` the result is ``residual + y``. 16-bit tensors of one dtype; the
    weight may be a row slice of a larger matrix (unit stride along ``K``). With ``exact`` (any
    number of rows) every row's result is bit-identical whatever the number of rows is
    (bit-exact mode, module docstring).

    Under ``torch.compile`` it is the opaque custom op ``flashspec::decode_linear``."""
    return _OP(x, weight, bias, norm_weight, residual, float(eps), bool(gated), bool(exact))


def _fake(x, weight, bias, norm_weight, residual, eps, gated, exact=False):
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


def _register():
    """The op, registered once per process (even if this module is loaded twice)."""
    if hasattr(torch.ops.flashspec, "decode_linear"):
        return torch.ops.flashspec.decode_linear
    op = torch.library.custom_op("flashspec::decode_linear", _launch, mutates_args=())
    op.register_fake(_fake)
    return op


_OP = _register()


if triton is not None:

    @triton.jit
    def _dot_rows(x_ptr, w_ptr, nw_ptr, rm, rn, rstd, M, N, K, x_sm, w_sn,
                  NORM: tl.constexpr, GATED: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
        """Tensor-core variant: the rows as one 16-row tile (padded), ``tl.dot`` per K block."""
        rk = tl.arange(0, BLOCK_K)
        m_live = rm < M
        n_live = rn < N
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_live = kk < K
            h = tl.load(x_ptr + rm[:, None] * x_sm + kk[None, :], mask=m_live[:, None] & k_live[None, :], other=0.0)
            if NORM:
                h = (h.to(tl.float32) * rstd[:, None]).to(dtype)
                g = tl.load(nw_ptr + kk, mask=k_live, other=0.0).to(tl.float32)
                h = (g[None, :] * h.to(tl.float32)).to(dtype)
            w_mask = n_live[:, None] & k_live[None, :]
            w = tl.load(w_ptr + rn[:, None] * w_sn + kk[None, :], mask=w_mask, other=0.0)
            if UPCAST:  # the interpreter multiplies the raw bits of bf16: exact float32 products instead,
                # summed elementwise: numpy's matrix product rounds a row by its place in the tile (SPEC.md §14)
                h = h.to(tl.float32)
                w = w.to(tl.float32)
                acc += tl.sum(h[:, None, :] * w[None, :, :], axis=2)
            else:
                acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
            if GATED:
                u = tl.load(w_ptr + (rn + N)[:, None] * w_sn + kk[None, :], mask=w_mask, other=0.0)
                if UPCAST:
                    u = u.to(tl.float32)
                    acc_up += tl.sum(h[:, None, :] * u[None, :, :], axis=2)
                else:
                    acc_up = tl.dot(h, tl.trans(u), acc_up, input_precision="ieee")
        return acc, acc_up

    @triton.jit
    def _rms(x_ptr, rm, m_live, K, x_sm, eps, BLOCK_K: tl.constexpr):
        """``rsqrt(mean(x²) + eps)`` of the rows ``rm`` (float32), one pass over them (L2-resident)."""
        rk = tl.arange(0, BLOCK_K)
        squares = tl.zeros(rm.shape, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            xk = tl.load(x_ptr + rm[:, None] * x_sm + kk[None, :], mask=m_live[:, None] & (kk < K)[None, :],
                         other=0.0).to(tl.float32)
            squares += tl.sum(xk * xk, axis=1)
        return tl.rsqrt(squares / K + eps)

    @triton.jit
    def _finish(acc, acc_up, b_ptr, r_ptr, y_ptr, rm, rn, m_live, n_live, N,
                HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr, dtype: tl.constexpr):
        """The epilogue of rows ``rm`` (``acc [R, BLOCK_N]`` float32): bias, SiLU·up, residual, store."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_live, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(b_ptr + N + rn, mask=n_live, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dtype)
        if GATED:
            gate = y.to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate)) * acc_up.to(dtype).to(tl.float32)).to(dtype)
        out_mask = m_live[:, None] & n_live[None, :]
        if RESIDUAL:
            r = tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=out_mask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=out_mask)

    @triton.jit(do_not_specialize=["M", "eps", "row_class"])
    def _decode_linear_kernel(
        x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, y_ptr,
        M, N, K, eps, x_sm, w_sn, row_class,
        HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr,
        USE_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program ``i·T + t`` (``T = ceil(M / 16)`` row tiles): output columns ``i·BLOCK_N ..`` of
        every row (``M ≤ 16``, ``T = 1``), or of the rows ``16·t ..`` (bit-exact mode, tensor-core
        tiles). ``row_class`` (:func:`_row_class`) is read by the autotuner only. With ``PDL``
        (:mod:`flashspec.kernels.pdl`) it waits for the previous kernel before reading or writing anything."""
        row_tiles = (M + 15) // 16
        tile = tl.program_id(0) % row_tiles
        rn = (tl.program_id(0) // row_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_live = rn < N
        dtype = y_ptr.dtype.element_ty
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if USE_DOT:  # a 16-row tile: every row (bit-exact mode: row tile `tile`)
            rm = tile * 16 + tl.arange(0, 16)
            m_live = rm < M
            rstd = tl.zeros([16], dtype=tl.float32)
            if NORM:
                rstd = _rms(x_ptr, rm, m_live, K, x_sm, eps, BLOCK_K)
            acc, acc_up = _dot_rows(x_ptr, w_ptr, nw_ptr, rm, rn, rstd, M, N, K, x_sm, w_sn,
                                    NORM, GATED, UPCAST, BLOCK_N, BLOCK_K, dtype)
            _finish(acc, acc_up, b_ptr, r_ptr, y_ptr, rm, rn, m_live, n_live, N, HAS_BIAS, RESIDUAL, GATED, dtype)
        else:  # one row after another: float32 products summed element-wise, one reduction per row
            rk = tl.arange(0, BLOCK_K)
            m = 0
            while m < M:  # (a while loop: the interpreter cannot range() to a runtime bound)
                rm = m + tl.zeros([1], dtype=tl.int32)
                m_live = rm < M
                if NORM:
                    rstd = _rms(x_ptr, rm, m_live, K, x_sm, eps, BLOCK_K)
                sums = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                sums_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + rk
                    k_live = kk < K
                    h = tl.load(x_ptr + m * x_sm + kk, mask=k_live, other=0.0)
                    if NORM:
                        h = (h.to(tl.float32) * tl.sum(rstd, axis=0)).to(dtype)
                        g = tl.load(nw_ptr + kk, mask=k_live, other=0.0).to(tl.float32)
                        h = (g * h.to(tl.float32)).to(dtype)
                    hf = h.to(tl.float32)[None, :]
                    w_mask = n_live[:, None] & k_live[None, :]
                    w = tl.load(w_ptr + rn[:, None] * w_sn + kk[None, :], mask=w_mask, other=0.0)
                    sums += w.to(tl.float32) * hf
                    if GATED:
                        u = tl.load(w_ptr + (rn + N)[:, None] * w_sn + kk[None, :], mask=w_mask, other=0.0)
                        sums_up += u.to(tl.float32) * hf
                acc = tl.sum(sums, axis=1)[None, :]
                acc_up = tl.sum(sums_up, axis=1)[None, :]
                _finish(acc, acc_up, b_ptr, r_ptr, y_ptr, rm, rn, m_live, n_live, N, HAS_BIAS, RESIDUAL, GATED, dtype)
                m += 1

    def _configs() -> list:
        """CUDA-core tiles for one row (1 to 8 weight rows per program, so small matrices still
        spread over every SM) and tensor-core tiles (16 padded rows) for several: the winners of
        a sweep on an H200 (BENCHMARKS.md, "Kernels"), where 8-warp tensor-core tiles, 16-row
        CUDA-core tiles and loading the next weight block ahead never won. Bit-exact mode (class 3)
        takes the tensor-core tiles of one K block (``EXACT_BLOCK_K``) with 3 or 5 stages: on an
        H100, 5 stages made its 1-row Qwen2.5-1.5B down projection 1.45× and o projection 1.14×
        faster, 3 its output head 1.05× (CHANGELOG.md)."""
        configs = []
        for block_n, block_k, warps in ((1, 2048, 4), (2, 1024, 4), (4, 512, 4), (4, 1024, 4), (4, 1024, 8),
                                        (4, 2048, 4), (8, 512, 4), (8, 512, 8), (8, 1024, 4)):
            configs.append(triton.Config({"USE_DOT": False, "BLOCK_N": block_n, "BLOCK_K": block_k},
                                         num_warps=warps, num_stages=1))
        for block_n, block_k in ((16, 256), (16, 512), (32, 256), (32, 512), (64, 256)):
            configs.append(triton.Config({"USE_DOT": True, "BLOCK_N": block_n, "BLOCK_K": block_k},
                                         num_warps=4, num_stages=3))
        for block_n in (16, 32, 64):  # bit-exact mode only (_prune)
            configs.append(triton.Config({"USE_DOT": True, "BLOCK_N": block_n, "BLOCK_K": EXACT_BLOCK_K},
                                         num_warps=4, num_stages=5))
        return configs

    def _prune(configs, named_args, **kwargs):
        """The inner product of the row class (CUDA cores for one row, tensor cores for several),
        tiles no wider than the matrix (the narrowest one kept for small N). Bit-exact mode: one
        K block, 3 or 5 stages; several rows by default: 3 stages."""
        row_class = named_args["row_class"]
        n = named_args["N"]
        kind = [c for c in configs if c.kwargs["USE_DOT"] == (row_class != 1)]
        if row_class == 3:
            kind = [c for c in kind if c.kwargs["BLOCK_K"] == EXACT_BLOCK_K]
        elif row_class == 2:
            kind = [c for c in kind if c.num_stages == 3]
        kept = [c for c in kind if c.kwargs["BLOCK_N"] <= max(n, 16)]
        return kept or kind[:1]

    # One choice per (N, K, flags, row class), never per M: batch invariance (module docstring,
    # SPEC.md §3). PDL is in the key: a choice timed with it on is not reused with it off (a tile
    # chosen under other launch conditions doubled gate/up's time on an H200; CHANGELOG.md).
    _tuned = triton.autotune(configs=_configs(),
                             key=["N", "K", "HAS_BIAS", "NORM", "RESIDUAL", "GATED", "row_class", "PDL"],
                             prune_configs_by={"early_config_prune": _prune})(_decode_linear_kernel)
