"""Design C's step kernel: the rows of a step that complete a sequence's partial chunk (a prefill that
continues a slot), and the entry `step_forward`, which sends a decode step (one row a sequence) to
`incremental_decode_triton.py` (math in `incremental.py`; the shared row-tile routines and their
invariant in `incremental_tiles_triton.py`).

Program (v tile, sequence x v head) loads the slot's boundary state tile and the partial chunk's rows
(k, x, g, beta, T, V') into chunk tiles, then computes its rows one at a time: each row through the
routines the chunk kernels use, in a row tile of their shape with the row at its place (chunk position
% ROWS) and zeros elsewhere: normalise, G, the row of A, one step of the forward substitution (T's rows
before the row tile in one dot, the tile's earlier rows in another, as the chunk kernels solve a tile),
its U, W, V' and o. A row at chunk position CHUNK - 1 completes the chunk: the state update of the full tiles,
the product the chunk kernels compute. Then the rows go to the slot (or, after a full chunk, the state and
its rounded copy).

Per step the program reads the state tile and the held rows once (a row at position p reads p rows)
and writes one row; the state is written only when a chunk completes (or zeros, when a sequence starts
here): vLLM's recurrent step reads and writes the whole state every token.
"""

import triton
import triton.language as tl

from . import incremental_cache as layout
from . import incremental_tiles_triton as tiles
from .incremental_decode_triton import decode_forward
from .incremental_tiles_triton import (
    a_rows,
    block_columns,
    decayed_keys,
    delta_rows,
    gate_cumsum,
    gate_rows,
    normalized_rows,
    output_product,
    output_weights,
    pick,
    pick_entries,
    pick_one,
    rounded,
    row_place,
    solve_block_row,
    solved_product,
    state_after,
    state_cells,
    state_tile,
    tile_rows,
)
from .rules import L2NORM_EPS, SOFTPLUS_THRESHOLD, qk_scale


@triton.jit
def _step_row(
    p, held, start, s, k_c, x_c, vn_c, g_c, beta_c, t_c, k_b, t_b, Q, K, V, A, B, OUT, stride_qt, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, stride_ot, stride_oh, hk, hv, ok, ov, mv, rc,
    rr, decay, dt_bias, scale, eps, DK: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Row p of the chunk (packed row start + p - held): its o to OUT, and the tiles with the row in."""
    dt = k_c.dtype
    pos, own, rows_r, at, _ = row_place(p, start + p - held, rc, rr, ROWS)  # its row tile, its packed row
    if p % ROWS == 0:  # a new row tile
        k_b = tl.full([ROWS, BLOCK_K], 0.0, dt)
        t_b = tl.full([ROWS, CHUNK], 0.0, tl.float32)
    q_r = normalized_rows(Q, rows_r, own, hk, stride_qt, stride_qh, ok, eps, scale, DK).to(dt)
    k_r = normalized_rows(K, rows_r, own, hk, stride_kt, stride_kh, ok, eps, 1.0, DK).to(dt)
    g_r, beta_r = gate_rows(A, B, rows_r, own, hv, stride_at, stride_bt, decay, dt_bias, SOFTPLUS_MAX)
    mvr = own[:, None] & mv[None, :]
    v_r = tl.load(V + rows_r[:, None] * stride_vt + hv * stride_vh + ov[None, :], mask=mvr, other=0.0)
    x_r = (v_r.to(tl.float32) * beta_r[:, None]).to(dt)
    k_c = tl.where(at[:, None], pick(k_r, own).to(dt)[None, :], k_c)
    k_b = tl.where(own[:, None], k_r, k_b)
    x_c = tl.where(at[:, None], pick(x_r, own).to(dt)[None, :], x_c)
    g_c = tl.where(at, pick_one(g_r, own), g_c)
    beta_c = tl.where(at, pick_one(beta_r, own), beta_c)
    G_c = gate_cumsum(g_c, rc)
    G_r = pick_entries(G_c, rc[None, :] == pos[:, None])
    first = (p // ROWS) * ROWS
    a_in = a_rows(k_r, k_b, beta_r, G_r, G_r, pos, pos, PRECISION, DOT_FP32)
    l_row = solve_block_row(pick(a_in, own), block_columns(t_b, first, ROWS), p - first, rr)
    a_t = a_rows(k_b, k_c, pick_entries(beta_c, rc[None, :] == pos[:, None]), G_r, G_c, pos, rc, PRECISION, DOT_FP32)
    before = tl.where(rc[:, None] < first, t_c, 0.0)  # T's rows before the tile
    t_tile = tile_rows(tl.where(own[:, None], l_row[None, :], 0.0), tl.where(rc[None, :] < first, a_t, 0.0), before,
                       first, rc, ROWS)  # fmt: skip
    t_row = pick(t_tile, own)
    t_c = tl.where(at[:, None], t_row[None, :], t_c)
    t_b = tl.where(own[:, None], t_row[None, :], t_b)
    t_r = tl.where(own[:, None], t_row[None, :], 0.0)
    w = solved_product(t_r, decayed_keys(k_c, beta_c, G_c, dt), PRECISION, DOT_FP32)
    u = solved_product(t_r, x_c, PRECISION, DOT_FP32)
    vn = delta_rows(u, w, s, PRECISION, DOT_FP32)
    vn_c = tl.where(at[:, None], pick(vn, own).to(dt)[None, :], vn_c)
    p_w, qg = output_weights(q_r, G_r, pos, k_c, G_c, rc, PRECISION, DOT_FP32)
    o = output_product(p_w, qg, vn_c, tl.trans(s.to(dt)), PRECISION, DOT_FP32)
    tl.store(OUT + rows_r[:, None] * stride_ot + hv * stride_oh + ov[None, :], o.to(OUT.dtype.element_ty),
             mask=mvr)  # fmt: skip
    if p == CHUNK - 1:
        s = state_after(s, k_c, G_c, vn_c, rc, CHUNK, PRECISION, DOT_FP32)
    return s, k_c, x_c, vn_c, g_c, beta_c, t_c, k_b, t_b


@triton.jit
def _step_rows(
    held, count, start, read, slot, Q, K, V, A, B, OUT, STATE, S_STATE, STATE_DT, S_STATE_DT, ck, cx, cvn, cg, cb, ct,
    tile, live,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, stride_ot, stride_oh, HK,
    HV, RATIO, iv, hk, hv, ok, ov, mk, mv, rc, rr, decay, dt_bias, scale, eps, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, SOFTPLUS_MAX: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """count rows from chunk position held on (held + count <= CHUNK): the boundary state tile and the held
    rows loaded into whole chunk tiles (zeros from row `held` on), each row through `_step_row`, then the
    new rows to the slot, or the state of a completed chunk (or of a sequence starting here)."""
    s = state_tile(STATE, read, S_STATE, tile, live, ok)
    old = rc < held
    k_c = tl.load(ck + (rc[:, None] * HK + hk) * DK + ok[None, :], mask=old[:, None] & mk[None, :], other=0.0)
    x_c = tl.load(cx + (rc[:, None] * HV + hv) * DV + ov[None, :], mask=old[:, None] & mv[None, :], other=0.0)
    vn_c = tl.load(cvn + (rc[:, None] * HV + hv) * DV + ov[None, :], mask=old[:, None] & mv[None, :], other=0.0)
    g_c = tl.load(cg + rc * HV + hv, mask=old, other=0.0)
    beta_c = tl.load(cb + rc * HV + hv, mask=old, other=0.0)
    t_c = tl.load(ct + (rc[:, None] * HV + hv) * CHUNK + rc[None, :], mask=old[:, None], other=0.0)
    pos = (held // ROWS) * ROWS + rr  # the first row's tile: its held rows (k, T) as tiles of their own
    k_b = tl.load(ck + (pos[:, None] * HK + hk) * DK + ok[None, :], mask=(pos < held)[:, None] & mk[None, :],
                  other=0.0)  # fmt: skip
    t_b = tl.load(ct + (pos[:, None] * HV + hv) * CHUNK + rc[None, :], mask=(pos < held)[:, None], other=0.0)
    tiles_ = (s, k_c, x_c, vn_c, g_c, beta_c, t_c, k_b, t_b)
    for p in range(held, held + count):
        tiles_ = _step_row(
            p, held, start, *tiles_, Q, K, V, A, B, OUT, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
            stride_vh, stride_at, stride_bt, stride_ot, stride_oh, hk, hv, ok, ov, mv, rc, rr, decay, dt_bias, scale,
            eps, DK, BLOCK_K, ROWS, CHUNK, SOFTPLUS_MAX, PRECISION, DOT_FP32,
        )  # fmt: skip
    s, k_c, x_c, vn_c, g_c, beta_c, t_c, k_b, t_b = tiles_
    done = held + count == CHUNK
    tl.debug_barrier()  # every thread has read the slot before any writes to it
    if done | (read < 0):
        tl.store(STATE + slot * S_STATE + tile, s, mask=live)
        tl.store(STATE_DT + slot * S_STATE_DT + tile, rounded(s, STATE_DT.dtype.element_ty), mask=live)
    if held + count < CHUNK:
        new = (rc >= held) & (rc < held + count)
        tl.store(cx + (rc[:, None] * HV + hv) * DV + ov[None, :], x_c, mask=new[:, None] & mv[None, :])
        tl.store(cvn + (rc[:, None] * HV + hv) * DV + ov[None, :], vn_c, mask=new[:, None] & mv[None, :])
        if iv == 0:
            tl.store(cg + rc * HV + hv, g_c, mask=new)
            tl.store(cb + rc * HV + hv, beta_c, mask=new)
            tl.store(ct + (rc[:, None] * HV + hv) * CHUNK + rc[None, :], t_c, mask=new[:, None])
            if hv % RATIO == 0:
                tl.store(ck + (rc[:, None] * HK + hk) * DK + ok[None, :], k_c, mask=new[:, None] & mk[None, :])


@triton.jit(do_not_specialize=["n_seqs"])
def _step_kernel(
    Q, K, V, A, B, A_LOG, DT_BIAS, OUT, STATE, CK, CX, CG, CB, CT, CVN, STATE_DT, S_STATE, SK, SX, SG, SB, ST, SVN,
    S_STATE_DT, START, COUNT, HELD, SLOT, READ, n_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, stride_ot, stride_oh,
    HK, HV, RATIO, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    iv = tl.program_id(0)
    n = tl.program_id(1) // HV
    hv = tl.program_id(1) % HV
    hk = hv // RATIO
    count = tl.load(COUNT + n)
    slot = tl.load(SLOT + n).to(tl.int64)
    if (count > 0) & (slot >= 0):  # slot -1: a padded request (no state read or written, no output row)
        held = tl.load(HELD + n).to(tl.int64)
        start = tl.load(START + n).to(tl.int64)
        read = tl.load(READ + n).to(tl.int64)
        STATE, tile, live, ok, ov, mk, mv = state_cells(STATE, hv, iv, DK, DV, BLOCK_K, BLOCK_V)
        STATE_DT += hv * DV * DK
        rc = tl.arange(0, CHUNK)
        rr = tl.arange(0, ROWS)
        # the slot's cache rows: row i of the chunk at cache row i (each tensor at its slot stride S*)
        ck, cx, cvn = CK + slot * SK, CX + slot * SX, CVN + slot * SVN
        cg, cb, ct = CG + slot * SG, CB + slot * SB, CT + slot * ST
        decay = tl.exp(tl.load(A_LOG + hv).to(tl.float32))
        dt_bias = tl.load(DT_BIAS + hv).to(tl.float32)
        _step_rows(
            held, count, start, read, slot, Q, K, V, A, B, OUT, STATE, S_STATE, STATE_DT, S_STATE_DT, ck, cx, cvn, cg,
            cb, ct, tile, live, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
            stride_ot, stride_oh, HK, HV, RATIO, iv, hk, hv, ok, ov, mk, mv, rc, rr, decay, dt_bias, scale, eps,
            DK, DV, BLOCK_K, ROWS, CHUNK, SOFTPLUS_MAX, PRECISION, DOT_FP32,
        )  # fmt: skip

def step_forward(q, k, v, a, b, A_log, dt_bias, out, cache, start, count, held, slots, read, single=False) -> None:
    """The step kernel: for each sequence n, count[n] rows from packed row start[n] on, at chunk positions
    held[n] .. held[n] + count[n] - 1 (held[n] + count[n] <= CHUNK) of its slot slots[n] of the cache
    (an IncrementalCache, each tensor at its slot stride: held[n] rows held, the boundary state at read[n],
    -1: zeros; slots[n] = -1: none, the sequence is skipped); o to out's rows.
    single: every count is 1 (a decode step: `incremental_decode_triton.decode_forward`)."""
    if single:
        decode_forward(q, k, v, a, b, A_log, dt_bias, out, cache, start, held, slots, read)
        return
    n_seqs, (_, hk, d_k), (_, hv, d_v) = start.shape[0], q.shape, v.shape
    if n_seqs == 0:
        return
    block_k, _, block_v = tiles.block_sizes(d_k, d_v)
    rows = (cache.state, cache.k, cache.x, cache.g, cache.beta, cache.t, cache.vnew, cache.state_dt)
    _step_kernel[(triton.cdiv(d_v, block_v), n_seqs * hv)](
        q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), out, *rows, *(t.stride(0) for t in rows), start, count,
        held, slots, read, n_seqs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        out.stride(0), out.stride(1), hk, hv, hv // hk, qk_scale(d_k), L2NORM_EPS,
        DK=d_k, DV=d_v, BLOCK_K=block_k, BLOCK_V=block_v, ROWS=tiles.ROWS, CHUNK=layout.CHUNK,
        SOFTPLUS_MAX=SOFTPLUS_THRESHOLD, **tiles.dot_options(q.dtype), **tiles.launch_options(),
    )  # fmt: skip
