"""The Triton kernels of :mod:`flashspec.kernels.attention` (its docstring describes them):
``_split_kernel`` (a split of the keys per program, online softmax) and ``_combine_kernel``
(the splits' partial results folded into each row's output). Defined only where Triton imports."""

from __future__ import annotations

from flashspec.kernels.shim import device_fn, tl, triton

if triton is not None:
    _NEG_INF = tl.constexpr(float("-inf"))
    # Reductions through tl.reduce with Triton's own combine functions: identical to tl.max /
    # tl.sum when compiled, and run natively by the interpreter (tl.max re-patches per call).
    _MAX = tl.standard._elementwise_max
    _SUM = tl.standard._sum_combine

    # Runtime ints that vary between calls and must not make new compilations (Triton would
    # specialise ints equal to 1 and divisibility by 16).
    _SPLIT_RUNTIME = ["M", "W", "G", "C", "m_blocks", "num_splits", "split_keys", "q_sb", "q_sh", "q_st",
                      "p_sb", "p_st", "o_sb", "o_sh", "o_st"]
    _COMBINE_RUNTIME = ["M", "W", "G", "num_splits", "split_keys", "p_sb", "p_st", "o_sb", "o_sh", "o_st"]

    @device_fn
    def _attend_tile(q, k_row, v_row, k_sn, v_sn, n0, end, pos, d, d_live, m_i, l_i, acc, qk_scale,
                     BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERPRET: tl.constexpr):
        """One tile of keys ``n0 .. n0 + BLOCK_N`` (those ``< end`` loaded) folded into the
        online softmax state ``(m_i, l_i, acc)`` of the rows at positions ``pos``. Interpreted (on
        the CPU) the two products are elementwise sums: numpy's matrix product rounds a row
        differently by its place in the tile and by the other rows (a tensor core's does not), which
        bit-exact mode's row invariance cannot allow (SPEC.md §14)."""
        n = n0 + tl.arange(0, BLOCK_N)
        n_live = n < end
        kt = tl.load(k_row + n[None, :] * k_sn + d[:, None], mask=d_live[:, None] & n_live[None, :],
                     other=0.0)  # [BLOCK_D, BLOCK_N]
        if UPCAST:
            kt = kt.to(tl.float32)
        if INTERPRET:
            s = tl.sum(q[:, :, None] * kt[None, :, :], axis=1) * qk_scale
        else:
            s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        s = tl.where(n[None, :] <= pos[:, None], s, _NEG_INF)
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        safe = tl.where(m_new == _NEG_INF, 0.0, m_new)  # rows without a visible key yet
        alpha = tl.exp2(m_i - safe)
        p = tl.exp2(s - safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        v = tl.load(v_row + n[:, None] * v_sn + d[None, :], mask=n_live[:, None] & d_live[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_D]
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        if INTERPRET:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit(do_not_specialize=_SPLIT_RUNTIME)
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, lse_ptr, part_ptr,
        H_kv, M, W, G, C, D, m_blocks, num_splits, split_keys,
        q_sb, q_sh, q_st, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, p_sb, p_st, o_sb, o_sh, o_st,
        qk_scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERPRET: tl.constexpr, NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Kernel 1: one split of the key axis for one block of query rows of one (b, kv)."""
        if PDL:  # flashspec.kernels.pdl: queries, cache and positions come from earlier kernels
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        bh = pid // m_blocks
        mb = pid - bh * m_blocks
        b = bh // H_kv
        kv = bh - b * H_kv
        split = tl.program_id(1)

        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        live = rows < M
        g = rows // W
        j = rows - g * W
        pos = tl.load(pos_ptr + b.to(tl.int64) * p_sb + j.to(tl.int64) * p_st, mask=live, other=-1)
        pos = tl.minimum(pos, C - 1).to(tl.int32)
        start = split * split_keys
        end = tl.minimum(start + split_keys, tl.reduce(pos, 0, _MAX) + 1)  # keys start .. end - 1 matter
        part_row = (bh.to(tl.int64) * M + rows) * num_splits + split  # [BLOCK_M]

        if SPLIT:
            if end <= start:  # every key of the split lies beyond every row's position
                tl.store(lse_ptr + part_row, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=live)
                return

        d = tl.arange(0, BLOCK_D)
        d_live = d < D
        head = kv * G + g
        q_off = b.to(tl.int64) * q_sb + head.to(tl.int64) * q_sh + j.to(tl.int64) * q_st
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=live[:, None] & d_live[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_row = k_ptr + b.to(tl.int64) * k_sb + kv.to(tl.int64) * k_sh
        v_row = v_ptr + b.to(tl.int64) * v_sb + kv.to(tl.int64) * v_sh

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if INTERPRET:
            n0 = start
            while n0 < end:
                m_i, l_i, acc = _attend_tile(q, k_row, v_row, k_sn, v_sn, n0, end, pos, d, d_live, m_i, l_i, acc,
                                             qk_scale, BLOCK_N, PRECISION, UPCAST, INTERPRET)
                n0 += BLOCK_N
        else:
            for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
                m_i, l_i, acc = _attend_tile(q, k_row, v_row, k_sn, v_sn, n0, end, pos, d, d_live, m_i, l_i, acc,
                                             qk_scale, BLOCK_N, PRECISION, UPCAST, INTERPRET)

        seen = l_i > 0.0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        if SPLIT:
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + part_row, lse, mask=live)
            tl.store(part_ptr + part_row[:, None] * D + d[None, :], o, mask=live[:, None] & d_live[None, :])
        else:
            o_off = b.to(tl.int64) * o_sb + head.to(tl.int64) * o_sh + j.to(tl.int64) * o_st
            tl.store(out_ptr + o_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=live[:, None] & d_live[None, :])

    @triton.jit(do_not_specialize=_COMBINE_RUNTIME)
    def _combine_kernel(
        lse_ptr, part_ptr, pos_ptr, out_ptr,
        H_kv, M, W, G, D, num_splits, split_keys,
        p_sb, p_st, o_sb, o_sh, o_st,
        ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    ):
        """Kernel 2: ``ROWS`` query rows' split partials → their output rows."""
        if PDL:  # flashspec.kernels.pdl
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bh = tl.program_id(0)
        b = bh // H_kv
        kv = bh - b * H_kv
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        live = rows < M
        g = rows // W
        j = rows - g * W
        pos = tl.load(pos_ptr + b.to(tl.int64) * p_sb + j.to(tl.int64) * p_st, mask=live, other=0).to(tl.int32)
        # Splits starting at or before the row's position: exactly those that hold its keys.
        n_valid = tl.where(live, tl.minimum(pos // split_keys + 1, num_splits), 0)
        d = tl.arange(0, BLOCK_D)
        d_live = d < D
        base = (bh.to(tl.int64) * M + rows) * num_splits  # [ROWS]

        big_m = tl.full([ROWS], float("-inf"), tl.float32)
        big_l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        s_end = tl.reduce(n_valid, 0, _MAX)
        s0 = s_end * 0
        while s0 < s_end:
            s = s0 + tl.arange(0, BLOCK_S)
            valid = s[None, :] < n_valid[:, None]  # [ROWS, BLOCK_S]
            idx = base[:, None] + s[None, :]
            lse = tl.load(lse_ptr + idx, mask=valid, other=float("-inf"))
            o = tl.load(part_ptr + idx[:, :, None] * D + d[None, None, :],
                        mask=valid[:, :, None] & d_live[None, None, :], other=0.0)  # [ROWS, BLOCK_S, BLOCK_D]
            new_m = tl.maximum(big_m, tl.reduce(lse, 1, _MAX))
            safe = tl.where(new_m == _NEG_INF, 0.0, new_m)  # only dead rows: split 0 holds key 0
            alpha = tl.exp2(big_m - safe)
            w = tl.exp2(lse - safe[:, None])
            big_l = big_l * alpha + tl.reduce(w, 1, _SUM)
            acc = acc * alpha[:, None] + tl.reduce(w[:, :, None] * o, 1, _SUM)
            big_m = new_m
            s0 += BLOCK_S
        out = acc / tl.where(big_l > 0.0, big_l, 1.0)[:, None]
        o_off = b.to(tl.int64) * o_sb + (kv * G + g).to(tl.int64) * o_sh + j.to(tl.int64) * o_st
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & d_live[None, :])
