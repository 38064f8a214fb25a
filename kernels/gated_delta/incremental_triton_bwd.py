"""Triton backward of design C's chunk computation (training only): fp32, deterministic (no atomics), not
batch-invariant (DESIGN rule 7). Math of the forward in `incremental.py`; per chunk (S^T the start state,
dS^T the gradient of the state after the chunk, 0 after a partial chunk; K~_j = exp(G_L - G_j) k_j,
G_L = G_{C-1}, P the causal product, gamma = exp(G)):
    dV'  = P^T dO + K~ dS                      dS_start^T = gamma_L dS^T + dO^T (gamma q) - dV'^T W
    dq   = gamma dO S^T + (dP . E) k            dP = dO V'^T,  E_ij = exp(G_i - G_j)
    dW   = -dV' S^T,  dK~ = V' dS,  dx = T^T dV',  dy = T^T dW,  dT = dV' x^T + dW y^T
    dA   = -T^T dT T^T (strictly lower),  A_ij = beta_i (k_i . k_j) E_ij,  y_j = beta_j gamma_j k_j
and the chain to k, beta, G, then g (dg_i = sum_{m >= i} dG_m). Two launches:
1. reverse state pass, program (v tile, sequence x v head): the chunks last to first: dV' of each chunk
   (stored), dS of each chunk (stored), the initial state's gradient;
2. chunk gradients, program (chunk, v head), every chunk at once: dq, dk (this v head's part), dv, dg, dbeta.
The host sums the k heads' parts over their v heads with a torch sum (fixed order).
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from . import incremental_cache as layout
from . import incremental_tiles_triton as tiles

# Launch options of the backward programs: many [CHUNK, DK] fp32 tiles live at once (8 warps), and one
# stage (no multi-buffered loads) keeps the shared memory within an H100/H200 SM.
LAUNCH = dict(num_warps=8, num_stages=1, enable_fp_fusion=False)


@triton.jit
def _rows(X, rows, valid, head, H, cols, D: tl.constexpr):
    """X[rows, head, cols] of a [T, H, D] tensor as fp32 [len(rows), len(cols)] (0 past D or not valid)."""
    mask = valid[:, None] & (cols < D)[None, :]
    return tl.load(X + (rows[:, None] * H + head) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _mm(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b: fp32 operands ("ieee"), or rounded to bf16 ("bf16": a bf16 model's gradients, as
    flash-linear-attention's backward rounds them; half the shared memory of fp32 operands; "bf16-fp32":
    the same values through an fp32 dot, for the interpreter, whose tl.dot misreads bf16)."""
    if PRECISION == "bf16":
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif PRECISION == "bf16-fp32":
        out = tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit(do_not_specialize=["n_seqs"])
def _bwd_state_kernel(
    QH, KH, GC, W, DO, DHT, DH, DVN, DH0, BOS, EOS, CHUNK_START, n_seqs, HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    iv = tl.program_id(0)
    n = tl.program_id(1) // HV
    hv = tl.program_id(1) % HV
    hk = hv // RATIO
    bos = tl.load(BOS + n).to(tl.int64)
    eos = tl.load(EOS + n).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
    rc = tl.arange(0, CHUNK)
    tile = (hv * DV + ov[:, None]).to(tl.int64) * DK + ok[None, :]
    live = (ov < DV)[:, None] & (ok < DK)[None, :]
    full = (eos - bos) // CHUNK
    first_chunk = tl.load(CHUNK_START + n).to(tl.int64)
    d_final = tl.load(DHT + n.to(tl.int64) * HV * DV * DK + tile, mask=live, other=0.0)
    dh = tl.full([BLOCK_V, BLOCK_K], 0.0, tl.float32)  # the gradient of the state after the chunk
    n_chunks = (eos - bos + CHUNK - 1) // CHUNK
    for cc in range(n_chunks):
        c = n_chunks - 1 - cc
        if c == full - 1:
            dh += d_final
        tl.store(DH + (first_chunk + c) * HV * DV * DK + tile, dh, mask=live)
        rows = bos + c * CHUNK + rc
        valid = rows < eos
        q = _rows(QH, rows, valid, hk, HK, ok, DK)
        k = _rows(KH, rows, valid, hk, HK, ok, DK)
        w = _rows(W, rows, valid, hv, HV, ok, DK)
        do = _rows(DO, rows, valid, hv, HV, ov, DV)
        G = tl.load(GC + rows * HV + hv, mask=valid, other=0.0)
        causal = (rc[None, :] <= rc[:, None]) & valid[:, None] & valid[None, :]
        p = tl.where(causal, _mm(q, tl.trans(k), tl.full([CHUNK, CHUNK], 0.0, tl.float32), PRECISION)
                     * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)  # fmt: skip
        is_full = c < full
        g_last = tl.where(is_full, tl.reduce(tl.where(rc == CHUNK - 1, G, 0.0), 0, _sum_combine), 0.0)
        k_last = tl.where(is_full & valid[:, None], k * tl.exp(tl.where(valid, g_last - G, 0.0))[:, None], 0.0)
        dvn = _mm(k_last, tl.trans(dh), _mm(tl.trans(p), do, tl.full([CHUNK, BLOCK_V], 0.0, tl.float32), PRECISION),
                  PRECISION)  # fmt: skip
        tl.store(DVN + (rows[:, None] * HV + hv) * DV + ov[None, :], dvn, mask=valid[:, None] & (ov < DV)[None, :])
        q_gamma = q * tl.exp(G)[:, None]
        dh = _mm(tl.trans(do), q_gamma, dh * tl.exp(g_last), PRECISION) - _mm(
            tl.trans(dvn), w, tl.full([BLOCK_V, BLOCK_K], 0.0, tl.float32), PRECISION
        )
    if full == 0:
        dh += d_final
    tl.store(DH0 + n.to(tl.int64) * HV * DV * DK + tile, dh, mask=live)


@triton.jit(do_not_specialize=["n_chunks"])
def _bwd_chunk_kernel(
    QH, KH, X, V, GC, BETA, TS, W, VN, H, DH, DVN, DO, DQ, DK_, DV_, DG, DBETA, EOS, CHUNK_SEQ, CHUNK_ROW, n_chunks,
    stride_vt, stride_vh, HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    n = tl.load(CHUNK_SEQ + c)
    eos = tl.load(EOS + n)
    first = tl.load(CHUNK_ROW + c)
    rc = tl.arange(0, CHUNK)
    ok = tl.arange(0, BLOCK_K)
    rows = first + rc
    valid = rows < eos
    is_full = eos - first >= CHUNK
    q = _rows(QH, rows, valid, hk, HK, ok, DK)
    k = _rows(KH, rows, valid, hk, HK, ok, DK)
    G = tl.load(GC + rows * HV + hv, mask=valid, other=0.0)
    beta = tl.load(BETA + rows * HV + hv, mask=valid, other=0.0)
    t = _rows(TS, rows, valid, hv, HV, rc, CHUNK)  # [C, C]
    gamma = tl.exp(G)
    pair = valid[:, None] & valid[None, :]
    causal = (rc[None, :] <= rc[:, None]) & pair
    decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))
    zc = tl.full([CHUNK, CHUNK], 0.0, tl.float32)
    zk = tl.full([CHUNK, BLOCK_K], 0.0, tl.float32)
    dq, dw, dk_last, dp, dt = zk, zk, zk, zc, zc
    dbeta = tl.full([CHUNK], 0.0, tl.float32)
    dh_h = tl.full([BLOCK_V, BLOCK_K], 0.0, tl.float32)  # sum of dS * S over the v tiles
    state = c.to(tl.int64) * HV * DV * DK
    # 1. the sums over the v tiles
    for iv in range((DV + BLOCK_V - 1) // BLOCK_V):
        ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
        sv = state + (hv * DV + ov[:, None]) * DK + ok[None, :]
        mv = (ov < DV)[:, None] & (ok < DK)[None, :]
        h = tl.load(H + sv, mask=mv, other=0.0).to(tl.float32)  # S^T of the chunk's start [BV, BK]
        dh = tl.load(DH + sv, mask=mv, other=0.0)
        vn = _rows(VN, rows, valid, hv, HV, ov, DV)
        dvn = _rows(DVN, rows, valid, hv, HV, ov, DV)
        do = _rows(DO, rows, valid, hv, HV, ov, DV)
        x = _rows(X, rows, valid, hv, HV, ov, DV)
        v = tl.load(V + rows[:, None] * stride_vt + hv * stride_vh + ov[None, :],
                    mask=valid[:, None] & (ov < DV)[None, :], other=0.0).to(tl.float32)  # fmt: skip
        dq = _mm(do, h, dq, PRECISION)
        dp = _mm(do, tl.trans(vn), dp, PRECISION)
        dk_last = _mm(vn, dh, dk_last, PRECISION)
        dw = _mm(dvn, h, dw, PRECISION)
        dx = _mm(tl.trans(t), dvn, tl.full([CHUNK, BLOCK_V], 0.0, tl.float32), PRECISION)
        tl.store(DV_ + (rows[:, None] * HV + hv) * DV + ov[None, :], beta[:, None] * dx,
                 mask=valid[:, None] & (ov < DV)[None, :])  # fmt: skip
        dbeta += tl.reduce(v * dx, 1, _sum_combine)
        dt = _mm(dvn, tl.trans(x), dt, PRECISION)
        dh_h += dh * h
    # 2. the output's state term, then W = T y
    dq = dq * gamma[:, None]
    dG = tl.reduce(q * dq, 1, _sum_combine)
    dw = -dw
    y = k * (beta * gamma)[:, None]
    dt = _mm(dw, tl.trans(y), dt, PRECISION)
    dy = _mm(tl.trans(t), dw, zk, PRECISION)
    dk = dy * (beta * gamma)[:, None]
    ky = tl.reduce(k * dy, 1, _sum_combine)
    dbeta += gamma * ky
    dG += beta * gamma * ky
    # 3. A = beta_i (k_i . k_j) E_ij through T = (I + A)^-1
    lower = (rc[None, :] < rc[:, None]) & pair
    da = tl.where(lower, -_mm(_mm(tl.trans(t), dt, zc, PRECISION), tl.trans(t), zc, PRECISION), 0.0)
    kk = _mm(k, tl.trans(k), zc, PRECISION)
    ma = da * tl.where(lower, beta[:, None] * kk * decay, 0.0)
    dG += tl.reduce(ma, 1, _sum_combine) - tl.reduce(ma, 0, _sum_combine)
    dbeta += tl.reduce(da * kk * decay, 1, _sum_combine)
    dkk = da * beta[:, None] * decay
    dk = _mm(tl.trans(dkk), k, _mm(dkk, k, dk, PRECISION), PRECISION)
    # 4. the causal product P_ij = (q_i . k_j) E_ij
    dqk = tl.where(causal, dp * decay, 0.0)
    dq = _mm(dqk, k, dq, PRECISION)
    dk = _mm(tl.trans(dqk), q, dk, PRECISION)
    mp = tl.where(causal, dp * _mm(q, tl.trans(k), zc, PRECISION) * decay, 0.0)
    dG += tl.reduce(mp, 1, _sum_combine) - tl.reduce(mp, 0, _sum_combine)
    # 5. the state after a full chunk: exp(G_L) S + K~^T V'
    g_last = tl.where(is_full, tl.reduce(tl.where(rc == CHUNK - 1, G, 0.0), 0, _sum_combine), 0.0)
    to_last = tl.where(is_full & valid, tl.exp(tl.where(valid, g_last - G, 0.0)), 0.0)
    dk += dk_last * to_last[:, None]
    z = tl.reduce(dk_last * k * to_last[:, None], 1, _sum_combine)
    dG -= z
    d_gamma_last = tl.reduce(tl.reduce(dh_h, 1, _sum_combine), 0, _sum_combine)
    dG += tl.where(rc == CHUNK - 1, tl.reduce(z, 0, _sum_combine) + d_gamma_last * tl.exp(g_last), 0.0)
    dg = tl.reduce(tl.where(rc[None, :] >= rc[:, None], dG[None, :], 0.0), 1, _sum_combine)  # G = cumsum(g)
    mk = valid[:, None] & (ok < DK)[None, :]
    tl.store(DQ + (rows[:, None] * HV + hv) * DK + ok[None, :], dq, mask=mk)
    tl.store(DK_ + (rows[:, None] * HV + hv) * DK + ok[None, :], dk, mask=mk)
    tl.store(DG + rows * HV + hv, dg, mask=valid)
    tl.store(DBETA + rows * HV + hv, dbeta, mask=valid)


def chunk_backward(v, do, d_final, scratch: dict, bos, eos):
    """Gradients of the chunk computation: (dq_hat [T, HK, DK], dk_hat [T, HK, DK], dv [T, HV, DV], dg,
    dbeta [T, HV], d_initial_state [N, HV, DV, DK]), fp32, from the forward's scratch (`chunk_forward`
    with store_t) of rows [bos[n], eos[n]); do [T, HV, DV], d_final [N, HV, DV, DK]."""
    n_tokens, hv, d_v = v.shape
    hk, d_k = scratch["q"].shape[1], scratch["q"].shape[2]
    n_seqs, device = bos.shape[0], v.device
    f32 = dict(dtype=torch.float32, device=device)
    block_k, _, block_v = tiles.block_sizes(d_k, d_v)
    precision = "ieee" if v.dtype == torch.float32 else "bf16-fp32" if tiles.is_interpreted() else "bf16"
    const = dict(DK=d_k, DV=d_v, BLOCK_K=block_k, BLOCK_V=block_v, CHUNK=layout.CHUNK, PRECISION=precision, **LAUNCH)
    n_chunks = scratch["seq"].shape[0]
    dh = torch.empty(max(n_chunks, 1), hv, d_v, d_k, **f32)
    dvn = torch.zeros(n_tokens, hv, d_v, **f32)
    dh0 = torch.empty(n_seqs, hv, d_v, d_k, **f32)
    do = do.contiguous()
    bos, eos = bos.long().contiguous(), eos.long().contiguous()
    if n_seqs:
        _bwd_state_kernel[(triton.cdiv(d_v, block_v), n_seqs * hv)](
            scratch["q"], scratch["k"], scratch["G"], scratch["w"], do, d_final, dh, dvn, dh0, bos, eos,
            scratch["chunk_start"], n_seqs, hk, hv, hv // hk, **const,
        )  # fmt: skip
    dq = torch.zeros(n_tokens, hv, d_k, **f32)
    dk = torch.zeros(n_tokens, hv, d_k, **f32)
    dv = torch.zeros(n_tokens, hv, d_v, **f32)
    dg = torch.zeros(n_tokens, hv, **f32)
    dbeta = torch.zeros(n_tokens, hv, **f32)
    if n_chunks:
        _bwd_chunk_kernel[(n_chunks, hv)](
            scratch["q"], scratch["k"], scratch["x"], v, scratch["G"], scratch["beta"], scratch["t"], scratch["w"],
            scratch["vnew"], scratch["h"], dh, dvn, do, dq, dk, dv, dg, dbeta, eos, scratch["seq"], scratch["first"],
            n_chunks, v.stride(0), v.stride(1), hk, hv, hv // hk, **const,
        )  # fmt: skip
    ratio = hv // hk
    dq_hat = dq.view(n_tokens, hk, ratio, d_k).sum(2)  # a k head's v heads, in order
    dk_hat = dk.view(n_tokens, hk, ratio, d_k).sum(2)
    return dq_hat, dk_hat, dv, dg, dbeta, dh0
