"""Design C's chunk kernels (training, prefill, every chunked-prefill step of more than one row): math in
`incremental.py`, the row-tile routines and their invariant in `incremental_tiles_triton.py`.

Four launches over the chunks (`incremental_cache.ChunkMap`: anchored at multiples of CHUNK) of rows
[BOS[n], EOS[n]) of each sequence and of the rows its cache slot holds before BOS[n] (a chunked prefill
that continues a partial chunk: those rows' inputs come from the slot, their outputs were given before;
launcher: `incremental_triton.chunk_forward`):
1. normalise (chunk row tile, k head): q_hat, k_hat (dt), g, beta, x = dt(beta v) to scratch (a held
   row's k_hat, x, g, beta from its slot);
2. prepare (chunk, v head): G; A over the chunk, the inverse L of its blocks within the row tiles at
   once; per row tile in order, its rows of T from L, A and the rows before it (through the T scratch,
   which ends holding T); then W and U of the chunk; every chunk at once (no state);
3. state (v tile, sequence x v head): the chunks in order: h = dt(S) kept for 4, the chunk's V', the
   state after a full chunk; the state after the last full chunk to HT[WRITE[n]];
4. output (chunk, v head, v tile): the chunk's o from h, q, k, G, V' (the rows of BOS[n] .. EOS[n] - 1).
A held row's values recomputed here are the ones its slot holds (a row's values depend on its operands
alone), so the slot's rows are never written again.
Every product but T's chains takes the whole chunk's rows at once (a 64-row MMA: its elements are those
of the decode step's 16-row products, `incremental_tiles_triton.py`).
A sequence's last, partial chunk leaves its new rows (k, x, g, beta, T, V') in cache slot CACHE_SLOT[n]
(-1: none), for the decode step or a later launch to continue from.
"""

import triton
import triton.language as tl

from .incremental_tiles_triton import (
    a_rows,
    computed,
    decayed_keys,
    delta_rows,
    diagonal_blocks,
    gate_cumsum,
    gate_rows,
    normalized_rows,
    output_product,
    output_weights,
    rounded,
    solve_blocks,
    solved_product,
    state_after,
    state_tile,
    tile_rows,
)


@triton.jit(do_not_specialize=["n_chunks"])
def normalize_kernel(
    Q, K, V, A, B, A_LOG, DT_BIAS, QH, KH, X, GR, BETA, BOS, EOS, CHUNK_SEQ, CHUNK_ROW, CHUNK_SRC, CACHE_SLOT,
    CK, CX, CG, CB, SK, SX, SG, SB, n_chunks, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, HK, HV, RATIO, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, PACKED: tl.constexpr = False,
):  # fmt: skip
    """Program (row tile of a chunk, k head): the row tile's inputs to its scratch rows, a new row's (packed
    row src) computed, a held row's (row `place` of the chunk) copied from slot CACHE_SLOT[n] (strides SK ..).
    PACKED: a decode step's rows instead, each a sequence's (its values do not depend on its place): rows
    ROWS * program .. of 0 .. n_chunks - 1 (BOS .. SB unread)."""
    hk = tl.program_id(1)
    if PACKED:
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        src, new, slot = rows, rows < n_chunks, 0
        held = rows < 0
    else:
        c = tl.program_id(0) // (CHUNK // ROWS)
        n = tl.load(CHUNK_SEQ + c)
        place = (tl.program_id(0) % (CHUNK // ROWS)) * ROWS + tl.arange(0, ROWS)
        rows = tl.load(CHUNK_ROW + c) + place
        src = tl.load(CHUNK_SRC + c) + place
        bos = tl.load(BOS + n)
        new = (src >= bos) & (src < tl.load(EOS + n))
        held = src < bos
        slot = tl.load(CACHE_SLOT + n).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    mk = (ok < DK)[None, :]
    dt = QH.dtype.element_ty
    q = normalized_rows(Q, src, new, hk, stride_qt, stride_qh, ok, eps, scale, DK)
    k = normalized_rows(K, src, new, hk, stride_kt, stride_kh, ok, eps, 1.0, DK).to(dt)
    if not PACKED:
        k = tl.where(held[:, None], tl.load(CK + slot * SK + (place[:, None] * HK + hk) * DK + ok[None, :],
                                            mask=held[:, None] & mk, other=0.0), k)  # fmt: skip
    tl.store(QH + (rows[:, None] * HK + hk) * DK + ok[None, :], q.to(dt), mask=new[:, None] & mk)
    tl.store(KH + (rows[:, None] * HK + hk) * DK + ok[None, :], k, mask=(new | held)[:, None] & mk)
    ov = tl.arange(0, BLOCK_DV)
    mv = (ov < DV)[None, :]
    for j in range(RATIO):
        hv = hk * RATIO + j
        decay = tl.exp(tl.load(A_LOG + hv).to(tl.float32))
        g, beta = gate_rows(A, B, src, new, hv, stride_at, stride_bt, decay, tl.load(DT_BIAS + hv).to(tl.float32),
                            SOFTPLUS_MAX)  # fmt: skip
        v = tl.load(V + src[:, None] * stride_vt + hv * stride_vh + ov[None, :], mask=new[:, None] & mv, other=0.0)
        x = (v.to(tl.float32) * beta[:, None]).to(dt)
        if not PACKED:
            g = tl.where(held, tl.load(CG + slot * SG + place * HV + hv, mask=held, other=0.0), g)
            beta = tl.where(held, tl.load(CB + slot * SB + place * HV + hv, mask=held, other=0.0), beta)
            x = tl.where(held[:, None], tl.load(CX + slot * SX + (place[:, None] * HV + hv) * DV + ov[None, :],
                                                mask=held[:, None] & mv, other=0.0), x)  # fmt: skip
        tl.store(GR + rows * HV + hv, g, mask=new | held)
        tl.store(BETA + rows * HV + hv, beta, mask=new | held)
        tl.store(X + (rows[:, None] * HV + hv) * DV + ov[None, :], x, mask=(new | held)[:, None] & mv)


@triton.jit(do_not_specialize=["n_chunks"])
def prepare_kernel(
    KH, X, GR, BETA, GC, W, U, TS, BOS, EOS, CHUNK_SEQ, CHUNK_ROW, CHUNK_SRC, CACHE_SLOT, CK, CX, CG, CB, CT,
    SK, SX, SG, SB, ST, n_chunks, HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (chunk, v head): 1. G, A over the chunk, every row tile's L; 2. per row tile in order, its T rows
    (in TS, the chunk's rows of T at the end); 3. W, U of the chunk; 4. a partial chunk's new rows to the cache."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    n = tl.load(CHUNK_SEQ + c)
    eos = tl.load(EOS + n)
    first = tl.load(CHUNK_ROW + c)
    src = tl.load(CHUNK_SRC + c)
    rc = tl.arange(0, CHUNK)
    rr = tl.arange(0, ROWS)
    rows_c = first + rc
    valid_c = src + rc < eos
    ok = tl.arange(0, BLOCK_K)
    mk = ok < DK
    k_c = tl.load(KH + (rows_c[:, None] * HK + hk) * DK + ok[None, :], mask=valid_c[:, None] & mk[None, :], other=0.0)
    g_c = tl.load(GR + rows_c * HV + hv, mask=valid_c, other=0.0)
    beta_c = tl.load(BETA + rows_c * HV + hv, mask=valid_c, other=0.0)
    G_c = gate_cumsum(g_c, rc)
    tl.store(GC + rows_c * HV + hv, G_c, mask=valid_c)
    y_c = decayed_keys(k_c, beta_c, G_c, KH.dtype.element_ty)
    a_c = a_rows(computed(k_c, valid_c), k_c, beta_c, G_c, G_c, rc, rc, PRECISION, DOT_FP32)  # A, [CHUNK, CHUNK]
    l3 = solve_blocks(diagonal_blocks(a_c, ROWS), rr)  # every tile's L at once
    # TS's chunk rows: A with each tile's L in its diagonal block; a tile's rows of T replace its rows in order
    ts = TS + (rows_c[:, None] * HV + hv) * CHUNK + rc[None, :]
    tl.store(ts, a_c, mask=valid_c[:, None] & (rc[:, None] // ROWS != rc[None, :] // ROWS))
    nb = tl.arange(0, CHUNK // ROWS)
    d_row = nb[:, None, None] * ROWS + rr[None, :, None]
    d_col = nb[:, None, None] * ROWS + rr[None, None, :]
    tl.store(TS + ((first + d_row) * HV + hv) * CHUNK + d_col, l3, mask=src + d_row < eos)
    for tile in range(CHUNK // ROWS):  # the tiles' rows of T in order, each from the rows before it
        tl.debug_barrier()  # the rows before the tile are written
        at = tile * ROWS + rr
        ts_t = TS + ((first + at)[:, None] * HV + hv) * CHUNK
        live = (src + at < eos)[:, None]
        a_t = tl.load(ts_t + rc[None, :], mask=live & (rc < tile * ROWS)[None, :], other=0.0)
        l_t = tl.load(ts_t + at[None, :], mask=live, other=0.0)
        t_before = tl.load(ts, mask=(valid_c & (rc < tile * ROWS))[:, None], other=0.0)
        t_r = tile_rows(l_t, a_t, t_before, tile * ROWS, rc, ROWS)
        tl.debug_barrier()  # every thread has read the tile's rows before any is replaced
        tl.store(ts_t + rc[None, :], t_r, mask=live)
    tl.debug_barrier()
    t_c = tl.load(ts, mask=valid_c[:, None], other=0.0)
    w = solved_product(t_c, y_c, PRECISION, DOT_FP32)
    tl.store(W + (rows_c[:, None] * HV + hv) * DK + ok[None, :], w, mask=valid_c[:, None] & mk[None, :])
    for iv in range((DV + BLOCK_V - 1) // BLOCK_V):
        ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
        mv = valid_c[:, None] & (ov < DV)[None, :]
        x_c = tl.load(X + (rows_c[:, None] * HV + hv) * DV + ov[None, :], mask=mv, other=0.0)
        u = solved_product(t_c, x_c, PRECISION, DOT_FP32)
        tl.store(U + (rows_c[:, None] * HV + hv) * DV + ov[None, :], u, mask=mv)
    slot = tl.load(CACHE_SLOT + n).to(tl.int64)
    length = eos - src
    if (slot >= 0) & (length < CHUNK):  # the sequence's partial last chunk: its new rows to the cache
        keep = valid_c & (src + rc >= tl.load(BOS + n))  # row i of the chunk to the slot's row i (strides SK .. ST)
        tl.store(CG + slot * SG + rc * HV + hv, g_c, mask=keep)
        tl.store(CB + slot * SB + rc * HV + hv, beta_c, mask=keep)
        tl.store(CT + slot * ST + (rc[:, None] * HV + hv) * CHUNK + rc[None, :], t_c, mask=keep[:, None])
        if hv % RATIO == 0:
            tl.store(CK + slot * SK + (rc[:, None] * HK + hk) * DK + ok[None, :], k_c, mask=keep[:, None] & mk[None, :])
        for iv in range((DV + BLOCK_V - 1) // BLOCK_V):
            ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
            mv = keep[:, None] & (ov < DV)[None, :]
            x_c = tl.load(X + (rows_c[:, None] * HV + hv) * DV + ov[None, :], mask=mv, other=0.0)
            tl.store(CX + slot * SX + (rc[:, None] * HV + hv) * DV + ov[None, :], x_c, mask=mv)


@triton.jit(do_not_specialize=["n_seqs"])
def state_kernel(
    W, U, KH, GC, VN, H, H0, HT, HT_DT, BOS, EOS, HELD, CHUNK_ROW, CHUNK_START, READ, WRITE, CACHE_SLOT, CVN, S_H0,
    S_HT, S_HT_DT, SVN, n_seqs, HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, WRITE_DT: tl.constexpr,
):  # fmt: skip
    """Program (v tile, sequence x v head): the chunks in order (from the HELD[n] rows before BOS[n] on): h =
    dt(S) to H, the chunk's V', the state after a full chunk; a partial chunk's new V' rows to the cache; the
    state after the last full chunk (or the zero state of a sequence that starts here) to HT[WRITE[n]] and,
    WRITE_DT, rounded to HT_DT[WRITE[n]]."""
    iv = tl.program_id(0)
    n = tl.program_id(1) // HV
    hv = tl.program_id(1) % HV
    hk = hv // RATIO
    bos = tl.load(BOS + n).to(tl.int64)
    eos = tl.load(EOS + n).to(tl.int64)
    anchor = bos - tl.load(HELD + n).to(tl.int64)  # the packed row of the first chunk's row 0
    n_chunks = tl.where(eos > bos, (eos - anchor + CHUNK - 1) // CHUNK, 0)
    ok = tl.arange(0, BLOCK_K)
    ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = ok < DK, ov < DV
    tile = (hv * DV + ov[:, None]).to(tl.int64) * DK + ok[None, :]  # [BV, BK] in one state
    live = mv[:, None] & mk[None, :]
    read = tl.load(READ + n).to(tl.int64)
    s = state_tile(H0, read, S_H0, tile, live, ok)
    full = tl.where(eos > bos, (eos - anchor) // CHUNK, 0)
    first_chunk = tl.load(CHUNK_START + n).to(tl.int64)
    slot = tl.load(CACHE_SLOT + n).to(tl.int64)
    rc = tl.arange(0, CHUNK)
    for c in range(n_chunks):
        rows_c = tl.load(CHUNK_ROW + first_chunk + c) + rc  # scratch rows
        src_c = anchor + c * CHUNK + rc  # packed rows
        valid_c = src_c < eos
        tl.store(H + (first_chunk + c) * HV * DV * DK + tile, s.to(H.dtype.element_ty), mask=live)
        w = tl.load(W + (rows_c[:, None] * HV + hv) * DK + ok[None, :], mask=valid_c[:, None] & mk[None, :], other=0.0)
        mvc = valid_c[:, None] & mv[None, :]
        u = tl.load(U + (rows_c[:, None] * HV + hv) * DV + ov[None, :], mask=mvc, other=0.0)
        vn_c = delta_rows(u, computed(w, valid_c), s, PRECISION, DOT_FP32)  # the chunk's V' rows
        tl.store(VN + (rows_c[:, None] * HV + hv) * DV + ov[None, :], vn_c, mask=mvc)
        if (slot >= 0) & (c == full):  # the partial last chunk: its new V' rows to the cache (row i to cache row i)
            tl.store(CVN + slot * SVN + (rc[:, None] * HV + hv) * DV + ov[None, :], vn_c, mask=mvc & (src_c >= bos)[:, None])
        if c < full:
            k_c = tl.load(KH + (rows_c[:, None] * HK + hk) * DK + ok[None, :], mask=mk[None, :], other=0.0)
            G_c = tl.load(GC + rows_c * HV + hv)
            s = state_after(s, k_c, G_c, vn_c, rc, CHUNK, PRECISION, DOT_FP32)
    write = tl.load(WRITE + n).to(tl.int64)
    if (write >= 0) & ((full > 0) | (read < 0)):
        tl.debug_barrier()  # every thread has read its tile of the slot before any writes it
        tl.store(HT + write * S_HT + tile, s, mask=live)
        if WRITE_DT:
            tl.store(HT_DT + write * S_HT_DT + tile, rounded(s, HT_DT.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["n_chunks"])
def output_kernel(
    QH, KH, GC, VN, H, OUT, BOS, EOS, CHUNK_SEQ, CHUNK_ROW, CHUNK_SRC, n_chunks, stride_ot, stride_oh, HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (chunk, v head, v tile): o of the chunk's new rows from its start state h, q, k, G and V'."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    n = tl.load(CHUNK_SEQ + c)
    eos = tl.load(EOS + n)
    rc = tl.arange(0, CHUNK)
    rows_c = tl.load(CHUNK_ROW + c) + rc
    src_c = tl.load(CHUNK_SRC + c) + rc
    valid_c = src_c < eos
    new_c = valid_c & (src_c >= tl.load(BOS + n))
    ok = tl.arange(0, BLOCK_K)
    ov = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = ok < DK, ov < DV
    h = tl.load(H + c.to(tl.int64) * HV * DV * DK + (hv * DV + ov[:, None]) * DK + ok[None, :],
                mask=mv[:, None] & mk[None, :], other=0.0)  # fmt: skip
    k_c = tl.load(KH + (rows_c[:, None] * HK + hk) * DK + ok[None, :], mask=valid_c[:, None] & mk[None, :], other=0.0)
    G_c = tl.load(GC + rows_c * HV + hv, mask=valid_c, other=0.0)
    vn_c = tl.load(VN + (rows_c[:, None] * HV + hv) * DV + ov[None, :], mask=valid_c[:, None] & mv[None, :], other=0.0)
    q_c = tl.load(QH + (rows_c[:, None] * HK + hk) * DK + ok[None, :], mask=new_c[:, None] & mk[None, :], other=0.0)
    p, qg = output_weights(computed(q_c, new_c), G_c, rc, k_c, G_c, rc, PRECISION, DOT_FP32)
    o = output_product(p, qg, vn_c, tl.trans(h), PRECISION, DOT_FP32)
    tl.store(OUT + src_c[:, None] * stride_ot + hv * stride_oh + ov[None, :], o.to(OUT.dtype.element_ty),
             mask=new_c[:, None] & mv[None, :])  # fmt: skip
