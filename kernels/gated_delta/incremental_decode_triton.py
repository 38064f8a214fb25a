"""Design C's decode step on Triton: one row a sequence, in three launches (math in `incremental.py`; the
shared row-tile routines and their invariant in `incremental_tiles_triton.py`).

1. `prepared_rows`: the chunk kernels' `normalize_kernel` on the step's rows (the step's rows packed in
   row tiles): the row's normalised q and k, g, beta and x = dt(beta v). A row's values do not depend on
   its place in the row tile nor on the rows beside it (its norm is an FMA dot in K order, the rest
   elementwise).
2. `_decode_weights_kernel`, program (sequence, v head): what the row needs that no v column changes,
   through the chunk kernels' routines in a row tile of their shape with the row at its place (chunk
   position % ROWS): G, the row of A, its step of the forward substitution (the row of T), W, and the
   output's weights (P = dt((q . k_j) exp(G_i - G_j)), dt(q exp(G))). They go to per-step scratch rows,
   stored from the tile (no reduction, so every bit, the sign of a zero included); unless it completes
   the chunk, the row's k, g, beta and T row go to the slot.
3. `_decode_kernel`, program (v tile, sequence, v head): U, V' = U - W S and o from the state tile and
   the slot's x and V' rows, the weights loaded back into row tiles (the row at its place, zeros
   elsewhere: the tiles the step computed them in). A row that completes the chunk updates the state
   with the full tiles (the slot's CHUNK - 1 rows and the row's own); any other row goes to the slot.

The v-independent work runs once a v head instead of once a v tile, and each program holds fewer tiles
than one program doing all of it would. A step of more rows a sequence goes to the chunk kernels
(`incremental_chunk_triton.py`), which start from the rows a slot holds.
"""

import torch
import triton
import triton.language as tl

from . import incremental_cache as layout
from . import incremental_decode_cuda
from . import incremental_tiles_triton as tiles
from .incremental_chunk_triton import normalize_kernel
from .rules import L2NORM_EPS, SOFTPLUS_THRESHOLD, qk_scale


@triton.jit
def _row_tile(ROW, cols, own, valid_cols):
    """A scratch row ROW[cols] placed at the row tile's own place, zeros elsewhere: [ROWS, len(cols)]."""
    return tl.load(ROW + (own.to(tl.int32) * 0)[:, None] + cols[None, :], mask=own[:, None] & valid_cols[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _store_row(ROW, tile, cols, own, valid_cols):
    """The own row of a row tile to ROW[cols] (a masked store: no reduction, every bit kept)."""
    tl.store(ROW + (own.to(tl.int32) * 0)[:, None] + cols[None, :], tile, mask=own[:, None] & valid_cols[None, :])


@triton.jit
def _chunk_keys_gates(K, A, ck, cg, start, stride_kt, stride_kh, stride_at, hk, hv, ok, mk, rc, at, old,
                      HK, HV, DK: tl.constexpr):  # fmt: skip
    """The chunk's k [CHUNK, BK] and g [CHUNK] tiles: the slot's held rows, the step's row (prepared K, A)
    at its place, zeros past it; and that row's (k, g)."""
    k_p = tl.load(K + start * stride_kt + hk * stride_kh + ok, mask=mk, other=0.0)
    g_p = tl.load(A + start * stride_at + hv)
    k_c = tl.load(ck + (rc[:, None] * HK + hk) * DK + ok[None, :], mask=old[:, None] & mk[None, :], other=0.0)
    k_c = tl.where(at[:, None], k_p[None, :], k_c)
    g_c = tl.where(at, g_p, tl.load(cg + rc * HV + hv, mask=old, other=0.0))
    return k_c, g_c, k_p, g_p


@triton.jit(do_not_specialize=["n_seqs"])
def _decode_weights_kernel(
    Q, K, A, B, CK, CG, CB, CT, SK, SG, SB, ST, START, HELD, SLOT, T_ROW, W_ROW, P_ROW, QG_ROW, n_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_at, stride_bt, HK, HV, RATIO,
    DK: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (sequence, v head): the row's T row, W, P and dt(q exp(G)) to the scratch rows, its k, g,
    beta and T row to the slot. Q, K: prepared q_hat, k_hat; A, B: prepared g, beta (fp32)."""
    n = tl.program_id(0) // HV
    hv = tl.program_id(0) % HV
    hk = hv // RATIO
    slot = tl.load(SLOT + n).to(tl.int64)
    if slot >= 0:  # slot -1: a padded request
        p = tl.load(HELD + n).to(tl.int64)
        start = tl.load(START + n).to(tl.int64)
        dt = K.dtype.element_ty
        ok = tl.arange(0, BLOCK_K)
        mk = ok < DK
        rc = tl.arange(0, CHUNK)
        rr = tl.arange(0, ROWS)
        ck, cg, cb, ct = CK + slot * SK, CG + slot * SG, CB + slot * SB, CT + slot * ST
        pos, own, rows_r, at, old = tiles.row_place(p, start, rc, rr, ROWS)
        first = (p // ROWS) * ROWS
        # the row's own values, in row tiles
        mkr = own[:, None] & mk[None, :]
        q_r = tl.load(Q + rows_r[:, None] * stride_qt + hk * stride_qh + ok[None, :], mask=mkr, other=0.0)
        k_r = tl.load(K + rows_r[:, None] * stride_kt + hk * stride_kh + ok[None, :], mask=mkr, other=0.0)
        beta_r = tl.load(B + rows_r * stride_bt + hv, mask=own, other=0.0)
        beta_p = tl.load(B + start * stride_bt + hv)
        # the chunk's gates and keys, the row in its place
        k_c, g_c, k_p, g_p = _chunk_keys_gates(K, A, ck, cg, start, stride_kt, stride_kh, stride_at, hk, hv, ok, mk,
                                               rc, at, old, HK, HV, DK)  # fmt: skip
        beta_c = tl.where(at, beta_p, tl.load(cb + rc * HV + hv, mask=old, other=0.0))
        G_c = tiles.gate_cumsum(g_c, rc)
        G_r = tiles.pick_entries(G_c, rc[None, :] == pos[:, None])
        # the row of T: its row of L from the tile's earlier rows, then its columns before the tile
        k_b = tl.load(ck + (pos[:, None] * HK + hk) * DK + ok[None, :], mask=(pos < p)[:, None] & mk[None, :],
                      other=0.0)  # fmt: skip
        k_b = tl.where(own[:, None], k_r, k_b)  # the tile's keys: earlier rows from the slot, the row's own
        a_in = tiles.a_rows(k_r, k_b, beta_r, G_r, G_r, pos, pos, PRECISION, DOT_FP32)
        # (the row's A within the tile through its T scratch row, which takes the T row last)
        row = n * HV + hv
        tl.store(T_ROW + row * CHUNK + rr, tiles.pick(a_in, own))
        tl.debug_barrier()  # the stores are visible to every thread
        l_row = tiles.solve_block_row_at(T_ROW + row * CHUNK, ct + (first * HV + hv) * CHUNK + first, HV * CHUNK,
                                         p - first, rr)  # fmt: skip
        tl.debug_barrier()  # every thread has read the scratch row before the T row overwrites it
        beta_b = tiles.pick_entries(beta_c, rc[None, :] == pos[:, None])
        a_t = tiles.a_rows(k_b, k_c, beta_b, G_r, G_c, pos, rc, PRECISION, DOT_FP32)
        before = tl.load(ct + (rc[:, None] * HV + hv) * CHUNK + rc[None, :], mask=(rc < first)[:, None], other=0.0)
        t_tile = tiles.tile_rows(tl.where(own[:, None], l_row[None, :], 0.0), tl.where(rc[None, :] < first, a_t, 0.0),
                                 before, first, rc, ROWS)  # fmt: skip
        t_row = tiles.pick(t_tile, own)
        t_r = tl.where(own[:, None], t_row[None, :], 0.0)
        w = tiles.solved_product(t_r, tiles.decayed_keys(k_c, beta_c, G_c, dt), PRECISION, DOT_FP32)
        p_w, qg = tiles.output_weights(q_r, G_r, pos, k_c, G_c, rc, PRECISION, DOT_FP32)
        tl.store(T_ROW + row * CHUNK + rc, t_row)
        _store_row(W_ROW + row * DK, w, ok, own, mk)
        _store_row(P_ROW + row * CHUNK, p_w, rc, own, rc < CHUNK)
        _store_row(QG_ROW + row * DK, qg, ok, own, mk)
        if p < CHUNK - 1:  # the row to the slot (which holds CHUNK - 1 rows: a completing row is not kept)
            tl.store(cg + p * HV + hv, g_p)
            tl.store(cb + p * HV + hv, beta_p)
            tl.store(ct + (p * HV + hv) * CHUNK + rc, t_row)
            if hv % RATIO == 0:
                tl.store(ck + (p * HK + hk) * DK + ok, k_p, mask=mk)


@triton.jit(do_not_specialize=["n_seqs"])
def _decode_kernel(
    K, A, V, OUT, STATE, CK, CX, CG, CVN, STATE_DT, S_STATE, SK, SX, SG, SVN, S_STATE_DT, START, HELD, SLOT, READ,
    T_ROW, W_ROW, P_ROW, QG_ROW, n_seqs, stride_kt, stride_kh, stride_at, stride_vt, stride_vh, stride_ot, stride_oh,
    HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (v tile, sequence, v head): the row's U, V' and o from `_decode_weights_kernel`'s rows; the
    state update of a completed chunk (the state and, rounded, STATE_DT), or the row's x and V' to the slot.
    K, A, V: the prepared k_hat, g and x = dt(beta v) (the completing row's k and g: the slot holds the
    chunk's other rows)."""
    iv = tl.program_id(0)
    n = tl.program_id(1) // HV
    hv = tl.program_id(1) % HV
    hk = hv // RATIO
    slot = tl.load(SLOT + n).to(tl.int64)
    if slot >= 0:  # slot -1: a padded request (no state read or written, no output row)
        p = tl.load(HELD + n).to(tl.int64)
        start = tl.load(START + n).to(tl.int64)
        read = tl.load(READ + n).to(tl.int64)
        dt = V.dtype.element_ty
        STATE, tile, live, ok, ov, mk, mv = tiles.state_cells(STATE, hv, iv, DK, DV, BLOCK_K, BLOCK_V)
        rc = tl.arange(0, CHUNK)
        ck, cx, cg, cvn = CK + slot * SK, CX + slot * SX, CG + slot * SG, CVN + slot * SVN
        pos, own, rows_r, at, old = tiles.row_place(p, start, rc, tl.arange(0, ROWS), ROWS)
        row = n * HV + hv
        t_r = tl.where(own[:, None], tl.load(T_ROW + row * CHUNK + rc)[None, :], 0.0)
        w = _row_tile(W_ROW + row * DK, ok, own, mk)
        x_p = tl.load(V + start * stride_vt + hv * stride_vh + ov, mask=mv, other=0.0)
        x_c = tl.load(cx + (rc[:, None] * HV + hv) * DV + ov[None, :], mask=old[:, None] & mv[None, :], other=0.0)
        u = tiles.solved_product(t_r, tl.where(at[:, None], x_p[None, :], x_c), PRECISION, DOT_FP32)
        s = tiles.state_tile(STATE, read, S_STATE, tile, live, ok).to(dt)
        vn_p = tiles.pick(tiles.delta_rows(u, w, s, PRECISION, DOT_FP32), own).to(dt)
        vn_c = tl.load(cvn + (rc[:, None] * HV + hv) * DV + ov[None, :], mask=old[:, None] & mv[None, :], other=0.0)
        vn_c = tl.where(at[:, None], vn_p[None, :], vn_c)
        p_w = _row_tile(P_ROW + row * CHUNK, rc, own, rc < CHUNK)
        qg = _row_tile(QG_ROW + row * DK, ok, own, mk)
        o = tiles.output_product(p_w, qg, vn_c, tl.trans(s), PRECISION, DOT_FP32)
        tl.store(OUT + rows_r[:, None] * stride_ot + hv * stride_oh + ov[None, :], o.to(OUT.dtype.element_ty),
                 mask=own[:, None] & mv[None, :])  # fmt: skip
        if p == CHUNK - 1:  # the chunk completes: the state update of its full tiles
            k_c, g_c, _, _ = _chunk_keys_gates(K, A, ck, cg, start, stride_kt, stride_kh, stride_at, hk, hv, ok, mk,
                                               rc, at, old, HK, HV, DK)  # fmt: skip
            G_c = tiles.gate_cumsum(g_c, rc)
            s32 = tiles.state_after(tiles.state_tile(STATE, read, S_STATE, tile, live, ok), k_c, G_c, vn_c, rc, CHUNK,
                              PRECISION, DOT_FP32)  # fmt: skip
            tl.debug_barrier()  # every thread has read the state before any writes to it
            tl.store(STATE + slot * S_STATE + tile, s32, mask=live)
            tl.store(STATE_DT + hv * DV * DK + slot * S_STATE_DT + tile, tiles.rounded(s32, dt), mask=live)
        else:
            if read < 0:  # a sequence that starts here: its boundary state is zeros
                tl.store(STATE + slot * S_STATE + tile, tl.where(live, 0.0, 0.0), mask=live)
                tl.store(STATE_DT + hv * DV * DK + slot * S_STATE_DT + tile, tl.where(live, 0.0, 0.0).to(dt), mask=live)
            tl.store(cx + (p * HV + hv) * DV + ov, x_p, mask=mv)
            tl.store(cvn + (p * HV + hv) * DV + ov, vn_p, mask=mv)


def prepared_rows(q, k, v, a, b, A_log, dt_bias):
    """(q_hat, k_hat, x, g, beta) of the step's rows by the chunk kernels' `normalize_kernel` over every row
    of q in tiles of ROWS (PACKED: a row's values do not depend on the rows beside it): q_hat, k_hat
    [T, HK, DK] and x = dt(beta v) [T, HV, DV] in q's dtype, g and beta [T, HV] fp32. Rows that are no
    sequence's (a CUDA graph's padded requests) are computed too, and read by no one."""
    (n_tokens, hk, d_k), (_, hv, d_v) = q.shape, v.shape
    device, dt = q.device, q.dtype
    q_hat, k_hat = (torch.empty(n_tokens, hk, d_k, dtype=dt, device=device) for _ in range(2))
    x = torch.empty(n_tokens, hv, d_v, dtype=dt, device=device)
    g, beta = (torch.empty(n_tokens, hv, dtype=torch.float32, device=device) for _ in range(2))
    block_k, block_dv, _ = tiles.block_sizes(d_k, d_v)
    normalize_kernel[(triton.cdiv(n_tokens, tiles.ROWS), hk)](
        q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), q_hat, k_hat, x, g, beta, None, None, None, None,
        None, None, None, None, None, None, 0, 0, 0, 0, n_tokens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0),
        b.stride(0), hk, hv, hv // hk, qk_scale(d_k), L2NORM_EPS, DK=d_k, DV=d_v, BLOCK_K=block_k,
        BLOCK_DV=block_dv, ROWS=tiles.ROWS, CHUNK=tiles.ROWS, SOFTPLUS_MAX=SOFTPLUS_THRESHOLD, PACKED=True,
        **tiles.launch_options(),
    )  # fmt: skip
    return q_hat, k_hat, x, g, beta


def _shape(d_k: int, dt: torch.dtype) -> dict:
    """The two decode kernels' common constexprs and launch options."""
    block_k, _, _ = tiles.block_sizes(d_k, d_k)
    return dict(DK=d_k, BLOCK_K=block_k, ROWS=tiles.ROWS, CHUNK=layout.CHUNK, **tiles.dot_options(dt),
                **tiles.launch_options(step=True))  # fmt: skip


def decode_weights_triton(q_hat, k_hat, g, beta, cache, start, held, slots, rows) -> None:
    """`_decode_weights_kernel` over the step's sequences: rows = (t_row, w_row, p_row, qg_row)."""
    n_seqs, hk, hv = start.shape[0], q_hat.shape[1], g.shape[1]
    _decode_weights_kernel[(n_seqs * hv,)](
        q_hat, k_hat, g, beta, cache.k, cache.g, cache.beta, cache.t, *(t.stride(0) for t in (cache.k, cache.g,
        cache.beta, cache.t)), start, held, slots, *rows, n_seqs, q_hat.stride(0), q_hat.stride(1), k_hat.stride(0),
        k_hat.stride(1), g.stride(0), beta.stride(0), hk, hv, hv // hk, **_shape(q_hat.shape[2], q_hat.dtype),
    )  # fmt: skip


def decode_forward(q, k, v, a, b, A_log, dt_bias, out, cache, start, held, slots, read) -> None:
    """A decode step: sequence n's one row, packed row start[n], at chunk position held[n] of its slot
    slots[n] of the cache (an IncrementalCache: held[n] rows held, the boundary state at read[n], -1:
    zeros; slots[n] = -1: a padded request, skipped); o to out's rows. No host read (CUDA graphs)."""
    n_seqs, (_, hk, d_k), (_, hv, d_v) = start.shape[0], q.shape, v.shape
    if n_seqs == 0:
        return
    q_hat, k_hat, x, g, beta = prepared_rows(q, k, v, a, b, A_log, dt_bias)
    chunk, dt, device = layout.CHUNK, q.dtype, q.device
    t_row = torch.empty(n_seqs, hv, chunk, dtype=torch.float32, device=device)
    p_row = torch.empty(n_seqs, hv, chunk, dtype=dt, device=device)
    w_row, qg_row = (torch.empty(n_seqs, hv, d_k, dtype=dt, device=device) for _ in range(2))
    rows = (t_row, w_row, p_row, qg_row)
    if incremental_decode_cuda.supported(q_hat, d_v):  # the same step in CUDA (incremental_decode_cuda.py)
        incremental_decode_cuda.decode_weights(q_hat, k_hat, g, beta, cache, start, held, slots, rows)
        incremental_decode_cuda.decode_values(k_hat, g, x, out, cache, start, held, slots, read, rows)
        return
    decode_weights_triton(q_hat, k_hat, g, beta, cache, start, held, slots, rows)
    _, _, block_v = tiles.block_sizes(d_k, d_v)
    _decode_kernel[(triton.cdiv(d_v, block_v), n_seqs * hv)](
        k_hat, g, x, out, cache.state, cache.k, cache.x, cache.g, cache.vnew, cache.state_dt,
        *(t.stride(0) for t in (cache.state, cache.k, cache.x, cache.g, cache.vnew, cache.state_dt)), start, held,
        slots, read, *rows,
        n_seqs, k_hat.stride(0), k_hat.stride(1), g.stride(0), x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        hk, hv, hv // hk, DV=d_v, BLOCK_V=block_v, **_shape(d_k, dt),
    )  # fmt: skip
