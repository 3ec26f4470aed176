"""The Triton kernels of :mod:`flashspec.kernels.verify` (its docstring describes the five of
them and what each reads), with their tile constants."""

from __future__ import annotations

from flashspec.kernels.shim import device_fn, jit, tl

CHUNK_MAX = 4096  # logits per row and program of kernels 1 and 4 (8 KiB of bf16)
TILE = 4096  # small vocabularies: rows per program so that a tile holds ~TILE logits
CHUNK_WARPS = 4
SEQ_TILE = 16  # sequences per program of kernel 3 (at least)
SEQ_WARPS = 2
POSITION_BLOCK = 16  # positions per step of kernels 3 and 5 (one step while k < 16)
SCAN_BLOCK = 4096  # logits per step of kernel 5's scan inside one chunk (one step)
DRAW_WARPS = 8
FOLD_ROWS = 4  # rows per program of kernel 2 (4-10 µs faster than ~4096-value tiles; CHANGELOG.md)
FOLD_WARPS = 1
PARTIAL_BLOCK = 64  # partials folded per step (one step while V <= 64 * CHUNK)
if tl is not None:  # (without Triton the module imports; verify_triton then refuses to run)
    _INT_MAX = tl.constexpr(2147483647)
    _NEG_INF = tl.constexpr(float("-inf"))

    _MAX = tl.standard._elementwise_max
    _MIN = tl.standard._elementwise_min
    _SUM = tl.standard._sum_combine

# Runtime arguments that must not make new compilations (Triton would otherwise specialise
# ints equal to 1 and divisibility by 16).
_RUNTIME = ["B", "n_rows", "k1", "stride_b", "stride_i", "num_chunks", "temperature", "d_sb", "d_si",
            "q_sb", "q_si", "u_sb", "u_si"]


_kernel = jit(do_not_specialize=_RUNTIME)


# ----------------------------------------------------------------------------------------------
# Helpers. Every program handles a tile of rows or sequences ([S] vectors, [S, C] tiles); with
# a large vocabulary S is 1 where the work per row is large.
# ----------------------------------------------------------------------------------------------


@device_fn
def _fold_argmax(m_ptr, x_ptr, parts, live, num_chunks, PARTIALS: tl.constexpr):
    """Rows' maximum and first argmax from their chunk partials at ``parts [S]`` (in order)."""
    best = tl.load(m_ptr + parts, mask=live, other=_NEG_INF)
    best_idx = tl.load(x_ptr + parts, mask=live, other=0)
    c0 = num_chunks * 0
    while c0 < num_chunks:
        c = c0 + tl.arange(0, PARTIALS)
        mask = live[:, None] & (c < num_chunks)[None, :]
        m = tl.load(m_ptr + parts[:, None] + c[None, :], mask=mask, other=_NEG_INF)
        x = tl.load(x_ptr + parts[:, None] + c[None, :], mask=mask, other=_INT_MAX)
        block_best = tl.reduce(m, 1, _MAX)
        block_idx = tl.reduce(tl.where(mask & (m == block_best[:, None]), x, _INT_MAX), 1, _MIN)
        better = block_best > best
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.where(better, block_best, best)
        c0 += PARTIALS
    return best, best_idx


@device_fn
def _fold_logsumexp(m_ptr, s_ptr, parts, live, num_chunks, PARTIALS: tl.constexpr):
    """Rows' ``(M, S)``, ``S = Σ exp(z − M)``, from their chunk partials at ``parts [S]``."""
    big_m = tl.load(m_ptr + parts, mask=live, other=0.0)
    big_s = tl.load(s_ptr + parts, mask=live, other=0.0) * 0.0  # (big_m * 0 is NaN at -inf)
    c0 = num_chunks * 0
    while c0 < num_chunks:
        c = c0 + tl.arange(0, PARTIALS)
        mask = live[:, None] & (c < num_chunks)[None, :]
        m = tl.load(m_ptr + parts[:, None] + c[None, :], mask=mask, other=_NEG_INF)
        s = tl.load(s_ptr + parts[:, None] + c[None, :], mask=mask, other=0.0)
        new_m = tl.maximum(big_m, tl.reduce(m, 1, _MAX))
        safe = tl.where(new_m == _NEG_INF, 0.0, new_m)
        big_s = big_s * tl.exp(big_m - safe) + tl.reduce(s * tl.exp(m - safe[:, None]), 1, _SUM)
        big_m = new_m
        c0 += PARTIALS
    return big_m, big_s


@device_fn
def _scale(x, temperature, MATH: tl.constexpr):
    """``float32(x) / T`` as PyTorch computes it: a division on the CPU (MATH 0); on CUDA a
    product with ``temperature = float32(1 / T)``, as ``tensor / python_float`` does there."""
    if MATH == 0:
        return tl.math.div_rn(x.to(tl.float32), temperature)
    else:
        return x.to(tl.float32) * temperature


@device_fn
def _target_prob(x, temperature, big_m, big_s, MATH: tl.constexpr):
    """``p = exp(z − M) / S`` in float32 with ``z`` from :func:`_scale`, as ``softmax``."""
    return tl.math.div_rn(tl.exp(_scale(x, temperature, MATH) - big_m), big_s)


@device_fn
def _row_n(logits_row, q_row, d_n, drafted, temperature, big_m, big_s, idx, limit, HAS_Q: tl.constexpr,
           MATH: tl.constexpr):
    """``(p_n, max(0, p_n − q_n))`` at ``idx [S or 1, C]`` of the rows at ``logits_row [S]``,
    zero at ``idx >= limit [S]`` (not read there); ``q_n`` is zero unless ``drafted``."""
    x = tl.load(logits_row[:, None] + idx, mask=idx < limit[:, None], other=_NEG_INF)
    p = _target_prob(x, temperature, big_m[:, None], big_s[:, None], MATH)
    if HAS_Q:
        q_mask = idx < tl.where(drafted, limit, 0)[:, None]
        q = tl.load(q_row[:, None] + idx, mask=q_mask, other=0.0).to(tl.float32)
    else:
        q = tl.where(idx == d_n[:, None], 1.0, 0.0)  # one-hot of d_n; d_n = -1 when n == k
    return p, tl.maximum(p - q, 0.0)


@device_fn
def _write_tokens(drafts_ptr, b, d_sb, d_si, tok_ptr, live, k1, n, final, KB: tl.constexpr):
    """``tokens[b] = d_0..d_{n-1}, final, -1, ...`` for the sequences ``b [S]``, ``KB``
    positions at a time."""
    p0 = k1 * 0
    while p0 < k1:
        cols = p0 + tl.arange(0, KB)
        is_draft = live[:, None] & (cols < k1 - 1)[None, :]
        d = tl.load(drafts_ptr + (b * d_sb)[:, None] + cols[None, :] * d_si, mask=is_draft, other=-1)
        token = tl.where(cols[None, :] < n[:, None], d, tl.where(cols[None, :] == n[:, None], final[:, None], -1))
        tl.store(tok_ptr + (b * k1)[:, None] + cols[None, :], token, mask=live[:, None] & (cols < k1)[None, :])
        p0 += KB


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@_kernel
def _partials_kernel(
    logits_ptr, part_m_ptr, part_x_ptr, V, n_rows, k1, stride_b, stride_i, num_chunks, temperature,
    GREEDY: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, MATH: tl.constexpr,
):
    """Kernel 1: one slice of ``ROWS`` rows → (max, first argmax) or (max z, Σ exp(z − max))."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    b = rows // k1
    offset = b * stride_b + (rows - b * k1) * stride_i
    if ALIGNED:
        offset = tl.multiple_of(offset, 16)
    chunk = tl.program_id(1)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = live[:, None] & (idx < V)[None, :]
    x = tl.load(logits_ptr + offset[:, None] + idx[None, :], mask=mask, other=_NEG_INF).to(tl.float32)
    out = rows * num_chunks + chunk
    if GREEDY:
        m = tl.reduce(x, 1, _MAX)
        first = tl.reduce(tl.where(x == m[:, None], idx[None, :], _INT_MAX), 1, _MIN)
        tl.store(part_m_ptr + out, m, mask=live)
        tl.store(part_x_ptr + out, first, mask=live)
    else:
        z = _scale(x, temperature, MATH)
        m = tl.reduce(z, 1, _MAX)
        safe = tl.where(m == _NEG_INF, 0.0, m)
        tl.store(part_m_ptr + out, m, mask=live)
        tl.store(part_x_ptr + out, tl.reduce(tl.exp(z - safe[:, None]), 1, _SUM), mask=live)


@_kernel
def _rows_kernel(
    part_m_ptr, part_x_ptr, row_m_ptr, row_x_ptr, n_rows, num_chunks,
    GREEDY: tl.constexpr, ROWS: tl.constexpr, PARTIALS: tl.constexpr,
):
    """Kernel 2: fold each row's chunk partials → its argmax, or its ``(M, S)``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    parts = rows * num_chunks
    if GREEDY:
        _, choice = _fold_argmax(part_m_ptr, part_x_ptr, parts, live, num_chunks, PARTIALS)
        tl.store(row_x_ptr + rows, choice, mask=live)
    else:
        big_m, big_s = _fold_logsumexp(part_m_ptr, part_x_ptr, parts, live, num_chunks, PARTIALS)
        tl.store(row_m_ptr + rows, big_m, mask=live)
        tl.store(row_x_ptr + rows, big_s, mask=live)


@_kernel
def _decide_kernel(
    logits_ptr, row_m_ptr, row_x_ptr, drafts_ptr, q_ptr, u_ptr, n_out_ptr, tok_out_ptr,
    V, B, k1, stride_b, stride_i, temperature, d_sb, d_si, q_sb, q_si, u_sb, u_si,
    GREEDY: tl.constexpr, HAS_Q: tl.constexpr, SEQS: tl.constexpr, KB: tl.constexpr, MATH: tl.constexpr,
):
    """Kernel 3: the accept tests of ``SEQS`` sequences, ``KB`` positions at a time, prefix-only.

    Greedy: accept ``d_i == argmax``, write n and the tokens (the new one is row n's argmax).
    Sampling: accept ``u_i · q_i(d_i) < p_i(d_i)`` in float64; write n.
    """
    b = tl.program_id(0).to(tl.int64) * SEQS + tl.arange(0, SEQS)
    live = b < B
    k1 = k1.to(tl.int64)  # index math in int64 (the interpreter checks int32 overflow)
    n = b * 0
    still = live
    p0 = k1 * 0
    while p0 < k1:
        cols = p0 + tl.arange(0, KB)
        row = (b * k1)[:, None] + cols[None, :]
        at_row = live[:, None] & (cols < k1)[None, :]
        is_draft = live[:, None] & (cols < k1 - 1)[None, :]
        d = tl.load(drafts_ptr + (b * d_sb)[:, None] + cols[None, :] * d_si, mask=is_draft, other=0)
        if GREEDY:
            choice = tl.load(row_x_ptr + row, mask=at_row, other=-1)
            accepted = is_draft & (d == choice)
        else:
            valid = is_draft & (d >= 0) & (d < V)
            d = tl.where(valid, d, 0)
            x = tl.load(logits_ptr + (b * stride_b)[:, None] + cols[None, :] * stride_i + d, mask=valid,
                        other=_NEG_INF)
            big_m = tl.load(row_m_ptr + row, mask=at_row, other=0.0)
            big_s = tl.load(row_x_ptr + row, mask=at_row, other=1.0)
            p_d = _target_prob(x, temperature, big_m, big_s, MATH).to(tl.float64)
            u = tl.load(u_ptr + (b * u_sb)[:, None] + cols[None, :] * u_si, mask=is_draft, other=1.0)
            if HAS_Q:
                q_d = tl.load(q_ptr + (b * q_sb)[:, None] + cols[None, :] * q_si + d, mask=valid, other=0.0)
                accepted = valid & (u * q_d.to(tl.float64) < p_d)
            else:
                accepted = valid & (u < p_d)
        rejected = tl.where(accepted, 0, 1)  # positions past the drafts count as rejections
        prefix = (tl.associative_scan(rejected, 1, _SUM) == 0) & still[:, None]
        n += tl.reduce(prefix.to(tl.int64), 1, _SUM)
        still = still & (tl.reduce(rejected, 1, _SUM) == 0)
        p0 += KB
    tl.store(n_out_ptr + b, n, mask=live)
    if GREEDY:
        final = tl.load(row_x_ptr + b * k1 + n, mask=live, other=0).to(tl.int64)
        _write_tokens(drafts_ptr, b, d_sb, d_si, tok_out_ptr, live, k1, n, final, KB)


@_kernel
def _residual_kernel(
    logits_ptr, q_ptr, drafts_ptr, n_ptr, row_m_ptr, row_s_ptr, mass_ptr, last_ptr,
    V, B, k1, stride_b, stride_i, num_chunks, temperature, d_sb, d_si, q_sb, q_si,
    HAS_Q: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, MATH: tl.constexpr,
):
    """Kernel 4: one slice of row n of ``ROWS`` sequences — the float64 mass of r and its last
    positive index."""
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = b < B
    n = tl.load(n_ptr + b, mask=live, other=0)
    drafted = live & (n < k1 - 1)
    d_n = tl.load(drafts_ptr + b * d_sb + n * d_si, mask=drafted, other=-1)
    offset = b * stride_b + n * stride_i
    q_offset = b * q_sb + n * q_si
    if ALIGNED:
        offset = tl.multiple_of(offset, 16)
        q_offset = tl.multiple_of(q_offset, 16)
    chunk = tl.program_id(1)
    idx = (chunk * CHUNK + tl.arange(0, CHUNK))[None, :]
    big_m = tl.load(row_m_ptr + b * k1 + n, mask=live, other=0.0)
    big_s = tl.load(row_s_ptr + b * k1 + n, mask=live, other=1.0)
    _, r = _row_n(logits_ptr + offset, q_ptr + q_offset, d_n, drafted, temperature, big_m, big_s,
                  idx, tl.where(live, V, 0), HAS_Q, MATH)
    out = b * num_chunks + chunk
    tl.store(mass_ptr + out, tl.reduce(r.to(tl.float64), 1, _SUM), mask=live)
    tl.store(last_ptr + out, tl.reduce(tl.where(r > 0, idx, -1), 1, _MAX), mask=live)


@_kernel
def _draw_kernel(
    logits_ptr, q_ptr, drafts_ptr, u_ptr, n_ptr, row_m_ptr, row_s_ptr, mass_ptr, last_ptr, tok_out_ptr,
    V, B, k1, stride_b, stride_i, num_chunks, temperature, d_sb, d_si, q_sb, q_si, u_sb, u_si,
    HAS_Q: tl.constexpr, SEQS: tl.constexpr, PARTIALS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr, KB: tl.constexpr, MATH: tl.constexpr,
):
    """Kernel 5: the inverse-CDF draw from r (from p_n where r has no mass), scanning one chunk
    per sequence."""
    b = tl.program_id(0).to(tl.int64) * SEQS + tl.arange(0, SEQS)
    live = b < B
    k1 = k1.to(tl.int64)  # scalar index math in int64 (the interpreter checks int32 overflow)
    num_chunks = num_chunks.to(tl.int64)
    start = b * num_chunks
    n = tl.load(n_ptr + b, mask=live, other=0)
    drafted = live & (n < k1 - 1)
    d_n = tl.load(drafts_ptr + b * d_sb + n * d_si, mask=drafted, other=-1)
    logits_row = logits_ptr + b * stride_b + n * stride_i
    q_row = q_ptr + b * q_sb + n * q_si
    big_m = tl.load(row_m_ptr + b * k1 + n, mask=live, other=0.0)
    big_s = tl.load(row_s_ptr + b * k1 + n, mask=live, other=1.0)
    zero = tl.zeros((SEQS,), tl.float64)
    total = zero
    last = b * 0 - 1
    c0 = num_chunks * 0
    while c0 < num_chunks:
        c = c0 + tl.arange(0, PARTIALS)
        mask = live[:, None] & (c < num_chunks)[None, :]
        at = start[:, None] + c[None, :]
        total += tl.reduce(tl.load(mass_ptr + at, mask=mask, other=0.0), 1, _SUM)
        last = tl.maximum(last, tl.reduce(tl.load(last_ptr + at, mask=mask, other=-1), 1, _MAX))
        c0 += PARTIALS

    # No residual mass: draw from p_n. Its chunk masses replace r's (all zero) for those
    # sequences; the loop runs only in a program that has one.
    has_mass = total > 0
    empty = live & (total <= 0)
    trips = tl.where(tl.reduce(empty.to(tl.int32), 0, _MAX) > 0, num_chunks, 0)
    empty_limit = tl.where(empty, V, 0)
    j = num_chunks * 0
    while j < trips:
        mass = zero
        chunk_last = b * 0 - 1
        for j0 in range(0, CHUNK, BLOCK):
            idx = j * CHUNK + (j0 + tl.arange(0, BLOCK))[None, :]
            p, _ = _row_n(logits_row, q_row, d_n, drafted, temperature, big_m, big_s, idx, empty_limit, HAS_Q, MATH)
            mass += tl.reduce(p.to(tl.float64), 1, _SUM)
            chunk_last = tl.maximum(chunk_last, tl.reduce(tl.where(p > 0, idx, -1), 1, _MAX))
        tl.store(mass_ptr + start + j, mass, mask=empty)
        tl.store(last_ptr + start + j, chunk_last, mask=empty)
        total = tl.where(empty, total + mass, total)
        last = tl.where(empty, tl.maximum(last, chunk_last), last)
        j += 1
    tl.debug_barrier()  # the stores above are read back below, by other threads of this program
    u_final = tl.load(u_ptr + b * u_sb + (k1 - 1) * u_si, mask=live, other=0.0)
    threshold = u_final * total

    # c*: the number of chunks whose cumulative mass is <= the threshold; "before" is the mass
    # of the chunks before c*.
    carry = zero
    before = zero
    c_star = b * 0
    c0 = num_chunks * 0
    while c0 < num_chunks:
        c = c0 + tl.arange(0, PARTIALS)
        mask = live[:, None] & (c < num_chunks)[None, :]
        at = start[:, None] + c[None, :]
        cdf = carry[:, None] + tl.associative_scan(tl.load(mass_ptr + at, mask=mask, other=0.0), 1, _SUM)
        below = mask & (cdf <= threshold[:, None])
        c_star += tl.reduce(below.to(tl.int64), 1, _SUM)
        before = tl.maximum(before, tl.reduce(tl.where(below, cdf, 0.0), 1, _MAX))
        carry = tl.reduce(cdf, 1, _MAX)
        c0 += PARTIALS
    found = live & (c_star < num_chunks)

    # Scan chunk c*: count its cumulative weights <= the threshold.
    first = c_star * CHUNK
    carry = before
    count = b * 0
    for j0 in range(0, CHUNK, BLOCK):
        idx = first[:, None] + (j0 + tl.arange(0, BLOCK))[None, :]
        limit = tl.where(found & (carry <= threshold), V, 0)  # past the threshold: stop reading
        p, r = _row_n(logits_row, q_row, d_n, drafted, temperature, big_m, big_s, idx, limit, HAS_Q, MATH)
        cdf = carry[:, None] + tl.associative_scan(tl.where(has_mass[:, None], r, p).to(tl.float64), 1, _SUM)
        count += tl.reduce(((idx < limit[:, None]) & (cdf <= threshold[:, None])).to(tl.int64), 1, _SUM)
        carry = tl.maximum(carry, tl.reduce(cdf, 1, _MAX))
    # Clamp to the last positive index: of chunk c* (chunk and element sums may round apart), or
    # of the whole row when the threshold lies past every chunk (u * total rounded up to total).
    c_last = start + tl.minimum(c_star, num_chunks - 1)
    last_in_chunk = tl.load(last_ptr + c_last, mask=live, other=-1)
    final = tl.where(found, tl.minimum(first + count, last_in_chunk), last)
    _write_tokens(drafts_ptr, b, d_sb, d_si, tok_out_ptr, live, k1, n, final, KB)


KERNELS = (_partials_kernel, _rows_kernel, _decide_kernel, _residual_kernel, _draw_kernel)
