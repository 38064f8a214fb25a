"""Design C's chunk kernels (training, prefill, the chunk-aligned rows of a chunked-prefill step): math in
`incremental.py`, the row-tile routines and their invariant in `incremental_tiles_triton.py`.

Four launches over the chunks of rows [BOS[n], EOS[n]) (anchored at BOS[n], a chunk boundary; launcher:
`incremental_triton.chunk_forward`):
1. normalise (chunk row tile, k head): q_hat, k_hat (dt), g, beta, x = dt(beta v) to scratch;
2. prepare (chunk, v head): G; A over the chunk, the inverse L of its blocks within the row tiles at
   once; per row tile in order, its rows of T from L, A and the rows before it; then W and U of the
   chunk; every chunk at once (no state);
3. state (v tile, sequence x v head): the chunks in order: h = dt(S) kept for 4, the chunk's V', the
   state after a full chunk; the state after the last full chunk to HT[WRITE[n]];
4. output (chunk, v head, v tile): the chunk's o from h, q, k, G, V'.
Every product but T's chains takes the whole chunk's rows at once (a 64-row MMA: its elements are those
of the step kernels' 16-row products, `incremental_tiles_triton.py`).
A sequence's last, partial chunk leaves its rows (k, x, g, beta, T, V') in cache slot CACHE_SLOT[n]
(-1: none), for the step kernel to continue from.
"""

import triton
import triton.language as tl

from .incremental_tiles_triton import (
    a_rows,
    block_rows,
    computed,
    decayed_keys,
    delta_rows,
    diagonal_blocks,
    gate_cumsum,
    gate_rows,
    normalized_rows,
    output_product,
    output_weights,
    pick_along,
    rounded,
    solve_blocks,
    solved_product,
    state_after,
    state_tile,
    tile_rows,
    with_tile_rows,
)


@triton.jit(do_not_specialize=["n_chunks"])
def normalize_kernel(
    Q, K, V, A, B, A_LOG, DT_BIAS, QH, KH, X, GR, BETA, EOS, CHUNK_SEQ, CHUNK_ROW, n_chunks,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, HK, HV, RATIO, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, PACKED: tl.constexpr = False,
):  # fmt: skip
    """Program (row tile of a chunk, k head): the row tile's inputs, each row at place (chunk row % ROWS).
    PACKED: a decode step's rows instead, each a sequence's (its values do not depend on its place): rows
    ROWS * program .. of 0 .. n_chunks - 1 (EOS, CHUNK_SEQ, CHUNK_ROW unread)."""
    hk = tl.program_id(1)
    if PACKED:
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        valid = rows < n_chunks
    else:
        c = tl.program_id(0) // (CHUNK // ROWS)
        n = tl.load(CHUNK_SEQ + c)
        rows = tl.load(CHUNK_ROW + c) + (tl.program_id(0) % (CHUNK // ROWS)) * ROWS + tl.arange(0, ROWS)
        valid = rows < tl.load(EOS + n)
    ok = tl.arange(0, BLOCK_K)
    mk = valid[:, None] & (ok < DK)[None, :]
    dt = QH.dtype.element_ty
    q = normalized_rows(Q, rows, valid, hk, stride_qt, stride_qh, ok, eps, scale, DK)
    k = normalized_rows(K, rows, valid, hk, stride_kt, stride_kh, ok, eps, 1.0, DK)
    tl.store(QH + (rows[:, None] * HK + hk) * DK + ok[None, :], q.to(dt), mask=mk)
    tl.store(KH + (rows[:, None] * HK + hk) * DK + ok[None, :], k.to(dt), mask=mk)
    ov = tl.arange(0, BLOCK_DV)
    mv = valid[:, None] & (ov < DV)[None, :]
    for j in range(RATIO):
        hv = hk * RATIO + j
        decay = tl.exp(tl.load(A_LOG + hv).to(tl.float32))
        g, beta = gate_rows(A, B, rows, valid, hv, stride_at, stride_bt, decay, tl.load(DT_BIAS + hv).to(tl.float32),
                            SOFTPLUS_MAX)  # fmt: skip
        tl.store(GR + rows * HV + hv, g, mask=valid)
        tl.store(BETA + rows * HV + hv, beta, mask=valid)
        v = tl.load(V + rows[:, None] * stride_vt + hv * stride_vh + ov[None, :], mask=mv, other=0.0)
        tl.store(X + (rows[:, None] * HV + hv) * DV + ov[None, :], (v.to(tl.float32) * beta[:, None]).to(dt), mask=mv)


@triton.jit(do_not_specialize=["n_chunks"])
def prepare_kernel(
    KH, X, GR, BETA, GC, W, U, TS, EOS, CHUNK_SEQ, CHUNK_ROW, CACHE_SLOT, CK, CX, CG, CB, CT, SK, SX, SG, SB, ST,
    n_chunks, HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, STORE_T: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (chunk, v head): 1. G, A over the chunk, every row tile's L; 2. per row tile in order, its T rows;
    3. W, U of the chunk; 4. a tail's rows to the cache."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    n = tl.load(CHUNK_SEQ + c)
    eos = tl.load(EOS + n)
    first = tl.load(CHUNK_ROW + c)
    rc = tl.arange(0, CHUNK)
    rr = tl.arange(0, ROWS)
    rows_c = first + rc
    valid_c = rows_c < eos
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
    nb = tl.arange(0, CHUNK // ROWS)
    t_c = tl.full([CHUNK, CHUNK], 0.0, tl.float32)
    for tile in range(CHUNK // ROWS):  # the tiles' rows of T in order, each from the rows before it
        a_t = block_rows(a_c, tile, ROWS)
        l_t = pick_along(l3, (nb == tile)[:, None, None], 0)
        t_r = tile_rows(l_t, tl.where(rc[None, :] < tile * ROWS, a_t, 0.0), t_c, tile * ROWS, rc, ROWS)
        t_c = with_tile_rows(t_c, t_r, tile, rc, ROWS)
    w = solved_product(t_c, y_c, PRECISION, DOT_FP32)
    tl.store(W + (rows_c[:, None] * HV + hv) * DK + ok[None, :], w, mask=valid_c[:, None] & mk[None, :])
    for iv in range((DV + BLOCK_V - 1) // BLOCK_V):
        ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
        mv = valid_c[:, None] & (ov < DV)[None, :]
        x_c = tl.load(X + (rows_c[:, None] * HV + hv) * DV + ov[None, :], mask=mv, other=0.0)
        u = solved_product(t_c, x_c, PRECISION, DOT_FP32)
        tl.store(U + (rows_c[:, None] * HV + hv) * DV + ov[None, :], u, mask=mv)
    if STORE_T:
        tl.store(TS + (rows_c[:, None] * HV + hv) * CHUNK + rc[None, :], t_c, mask=valid_c[:, None])
    slot = tl.load(CACHE_SLOT + n).to(tl.int64)
    length = eos - first
    if (slot >= 0) & (length < CHUNK):  # the sequence's partial last chunk: its rows to the cache
        held = rc < length  # row i of the chunk goes to the slot's cache row i (slot strides SK .. ST)
        tl.store(CG + slot * SG + rc * HV + hv, g_c, mask=held)
        tl.store(CB + slot * SB + rc * HV + hv, beta_c, mask=held)
        tl.store(CT + slot * ST + (rc[:, None] * HV + hv) * CHUNK + rc[None, :], t_c, mask=held[:, None])
        if hv % RATIO == 0:
            tl.store(CK + slot * SK + (rc[:, None] * HK + hk) * DK + ok[None, :], k_c, mask=held[:, None] & mk[None, :])
        for iv in range((DV + BLOCK_V - 1) // BLOCK_V):
            ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
            mv = held[:, None] & (ov < DV)[None, :]
            x_c = tl.load(X + (rows_c[:, None] * HV + hv) * DV + ov[None, :], mask=mv, other=0.0)
            tl.store(CX + slot * SX + (rc[:, None] * HV + hv) * DV + ov[None, :], x_c, mask=mv)


@triton.jit(do_not_specialize=["n_seqs"])
def state_kernel(
    W, U, KH, GC, VN, H, H0, HT, HT_DT, BOS, EOS, CHUNK_START, READ, WRITE, CACHE_SLOT, CVN, S_H0, S_HT, S_HT_DT, SVN,
    n_seqs, HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, WRITE_DT: tl.constexpr,
):  # fmt: skip
    """Program (v tile, sequence x v head): the chunks in order: h = dt(S) to H, the chunk's V', the state
    after a full chunk; a partial chunk's V' rows to the cache; the state after the last full chunk (or the
    zero state of a sequence that starts here) to HT[WRITE[n]] and, WRITE_DT, rounded to HT_DT[WRITE[n]]."""
    iv = tl.program_id(0)
    n = tl.program_id(1) // HV
    hv = tl.program_id(1) % HV
    hk = hv // RATIO
    bos = tl.load(BOS + n).to(tl.int64)
    eos = tl.load(EOS + n).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = ok < DK, ov < DV
    tile = (hv * DV + ov[:, None]).to(tl.int64) * DK + ok[None, :]  # [BV, BK] in one state
    live = mv[:, None] & mk[None, :]
    read = tl.load(READ + n).to(tl.int64)
    s = state_tile(H0, read, S_H0, tile, live, ok)
    full = (eos - bos) // CHUNK
    first_chunk = tl.load(CHUNK_START + n).to(tl.int64)
    slot = tl.load(CACHE_SLOT + n).to(tl.int64)
    rc = tl.arange(0, CHUNK)
    for c in range((eos - bos + CHUNK - 1) // CHUNK):
        rows_c = bos + c * CHUNK + rc
        valid_c = rows_c < eos
        tl.store(H + (first_chunk + c) * HV * DV * DK + tile, s.to(H.dtype.element_ty), mask=live)
        w = tl.load(W + (rows_c[:, None] * HV + hv) * DK + ok[None, :], mask=valid_c[:, None] & mk[None, :], other=0.0)
        mvc = valid_c[:, None] & mv[None, :]
        u = tl.load(U + (rows_c[:, None] * HV + hv) * DV + ov[None, :], mask=mvc, other=0.0)
        vn_c = delta_rows(u, computed(w, valid_c), s, PRECISION, DOT_FP32)  # the chunk's V' rows
        tl.store(VN + (rows_c[:, None] * HV + hv) * DV + ov[None, :], vn_c, mask=mvc)
        if (slot >= 0) & (c == full):  # the partial last chunk: its V' rows to the cache (row i to cache row i)
            tl.store(CVN + slot * SVN + (rc[:, None] * HV + hv) * DV + ov[None, :], vn_c, mask=mvc)
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
    QH, KH, GC, VN, H, OUT, EOS, CHUNK_SEQ, CHUNK_ROW, n_chunks, stride_ot, stride_oh, HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (chunk, v head, v tile): o of each row tile from the chunk's start state h, q, k, G and V'."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    n = tl.load(CHUNK_SEQ + c)
    eos = tl.load(EOS + n)
    first = tl.load(CHUNK_ROW + c)
    rc = tl.arange(0, CHUNK)
    rows_c = first + rc
    valid_c = rows_c < eos
    ok = tl.arange(0, BLOCK_K)
    ov = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = ok < DK, ov < DV
    h = tl.load(H + c.to(tl.int64) * HV * DV * DK + (hv * DV + ov[:, None]) * DK + ok[None, :],
                mask=mv[:, None] & mk[None, :], other=0.0)  # fmt: skip
    k_c = tl.load(KH + (rows_c[:, None] * HK + hk) * DK + ok[None, :], mask=valid_c[:, None] & mk[None, :], other=0.0)
    G_c = tl.load(GC + rows_c * HV + hv, mask=valid_c, other=0.0)
    vn_c = tl.load(VN + (rows_c[:, None] * HV + hv) * DV + ov[None, :], mask=valid_c[:, None] & mv[None, :], other=0.0)
    q_c = tl.load(QH + (rows_c[:, None] * HK + hk) * DK + ok[None, :], mask=valid_c[:, None] & mk[None, :], other=0.0)
    p, qg = output_weights(computed(q_c, valid_c), G_c, rc, k_c, G_c, rc, PRECISION, DOT_FP32)
    o = output_product(p, qg, vn_c, tl.trans(h), PRECISION, DOT_FP32)
    tl.store(OUT + rows_c[:, None] * stride_ot + hv * stride_oh + ov[None, :], o.to(OUT.dtype.element_ty),
             mask=valid_c[:, None] & mv[None, :])  # fmt: skip
