"""Triton chunked gated delta rule, chunks anchored at each sequence's position 0 (candidate design B:
the training kernel, reused by decode on the partial chunk).

Math (fp32 state; q_hat, k_hat, g, beta as in rules.py, q_hat and k_hat rounded to the
input dtype as the dot operands, as flash-linear-attention's chunked kernels do): per chunk of CHUNK
rows starting at a multiple of CHUNK, with G_i = g_0 + ... + g_i (in-chunk cumulative log decay),
state S at the chunk's start and rows past the sequence's end masked (k, v, q = 0, g = beta = 0):
    A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)   for j < i, else 0
    Tm      = (I + A)^-1                           forward substitution, row by row
    W = Tm (beta exp(G) k),  U = Tm (beta v)       (`_chunk_prepare_kernel`, every chunk at once)
    V' = U - W S                                   (the chunk's delta-rule values)
    o_i = exp(G_i) q_i S + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) V'_j
    S  <- exp(G_last) S + sum_j exp(G_last - G_j) k_j V'_j^T   (`_chunk_state_kernel`, chunks in order)
The state after a sequence's last full chunk goes to HT[WRITE[n]] (nothing without a full chunk).

Invariant under test (design B): row i of a chunk reads rows j > i only through exact zeros (the
masks of A and of the causal product, the lower-triangular Tm), so a chunk holding rows 0..p of a
sequence (a decode step: the cached partial chunk plus the new row, zero-padded) should give row p
the bits it has in the full chunk of training. The CPU interpreter proves it for numpy's products;
on the GPU the tensor-core products decide (tests/kernels/gated_delta/test_chunked.py, CUDA part).
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from .rules import L2NORM_EPS, SOFTPLUS_THRESHOLD, qk_scale

# Rows per chunk: the anchor grid of training and of the cache (a chunk commits its state when full).
CHUNK = 64
# v columns per program of the state pass: fixes the state tile, hence every sum's order.
BLOCK_V = 64


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """tl.dot(a, b) in fp32 accumulation. DOT_FP32, interpreter only: its tl.dot reads bf16 operands as
    raw bits, so there the products are summed over the last axis of a broadcast fp32 product."""
    if DOT_FP32:
        return tl.reduce(
            a.to(tl.float32)[:, None, :] * tl.trans(b.to(tl.float32))[None, :, :], 2, _sum_combine
        )
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _chunk_rows(Q, K, V, A, B, A_LOG, DT_BIAS, rows, valid, hk, hv, ok, ov, stride_qt, stride_qh,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, scale, eps,
                DK: tl.constexpr, DV: tl.constexpr, SOFTPLUS_MAX: tl.constexpr):  # fmt: skip
    """A chunk's inputs: (q_hat [C, BK], k_hat [C, BK] in the input dtype, v [C, BV] fp32, g [C], beta [C]);
    rows past the sequence's end are 0 (g and beta too)."""
    mk = ok < DK
    mq = valid[:, None] & mk[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + hk * stride_qh + ok[None, :], mask=mq, other=0.0).to(
        tl.float32
    )
    k = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + ok[None, :], mask=mq, other=0.0).to(
        tl.float32
    )
    mv = valid[:, None] & (ov < DV)[None, :]
    v = tl.load(V + rows[:, None] * stride_vt + hv * stride_vh + ov[None, :], mask=mv, other=0.0).to(
        tl.float32
    )
    q = q * tl.rsqrt(tl.reduce(q * q, 1, _sum_combine) + eps)[:, None] * scale
    k = k * tl.rsqrt(tl.reduce(k * k, 1, _sum_combine) + eps)[:, None]
    x = tl.load(A + rows * stride_at + hv, mask=valid, other=0.0).to(tl.float32) + tl.load(DT_BIAS + hv).to(
        tl.float32
    )
    soft = tl.where(x > SOFTPLUS_MAX, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_MAX))))
    g = tl.where(valid, -tl.exp(tl.load(A_LOG + hv).to(tl.float32)) * soft, 0.0)
    b = tl.load(B + rows * stride_bt + hv, mask=valid, other=0.0).to(tl.float32)
    beta = tl.where(valid, tl.math.div_rn(1.0, 1.0 + tl.exp(-b)).to(B.dtype.element_ty).to(tl.float32), 0.0)
    return q.to(Q.dtype.element_ty), k.to(Q.dtype.element_ty), v, g, beta


@triton.jit(do_not_specialize=["n_chunks"])
def _chunk_prepare_kernel(
    Q, K, V, A, B, A_LOG, DT_BIAS, W, U, GC, CU, CHUNK_SEQ, CHUNK_ROW,
    n_chunks, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    HV, RATIO, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    CHUNK: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (chunk, v head): 1. cumulative decay G; 2. A; 3. Tm by forward substitution; 4. W, U, G stored."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    n = tl.load(CHUNK_SEQ + c)
    eos = tl.load(CU + n + 1).to(tl.int64)
    r = tl.arange(0, CHUNK)
    rows = tl.load(CHUNK_ROW + c).to(tl.int64) + r
    valid = rows < eos
    ok = tl.arange(0, BLOCK_K)
    ov = tl.arange(0, BLOCK_DV)
    _, k, v, g, beta = _chunk_rows(
        Q, K, V, A, B, A_LOG, DT_BIAS, rows, valid, hk, hv, ok, ov, stride_qt, stride_qh, stride_kt, stride_kh,
        stride_vt, stride_vh, stride_at, stride_bt, scale, eps, DK, DV, SOFTPLUS_MAX,
    )  # fmt: skip
    gc = tl.associative_scan(g, 0, _sum_combine)  # [C]: row i depends on rows <= i only
    lower = r[:, None] > r[None, :]
    kk = _dot(k, tl.trans(k), PRECISION, DOT_FP32)  # [C, C] fp32
    a = tl.where(lower, beta[:, None] * kk * tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
    tm = -a  # rows < i hold Tm - I once row i is reached
    for i in range(1, CHUNK):
        row = tl.reduce(tl.where(r[:, None] == i, tm, 0.0), 0, _sum_combine)  # -A[i, :]
        row = row + tl.reduce(row[:, None] * tm, 0, _sum_combine)  # - A[i, j] (I + (Tm - I))[j, :] over j < i
        tm = tl.where(r[:, None] == i, row[None, :], tm)
    tm = tm + tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    dt = Q.dtype.element_ty
    w = _dot(tm.to(dt), (k.to(tl.float32) * (beta * tl.exp(gc))[:, None]).to(dt), PRECISION, DOT_FP32)
    u = _dot(tm.to(dt), (v * beta[:, None]).to(dt), PRECISION, DOT_FP32)
    tl.store(W + (rows[:, None] * HV + hv) * DK + ok[None, :], w, mask=valid[:, None] & (ok < DK)[None, :])
    tl.store(U + (rows[:, None] * HV + hv) * DV + ov[None, :], u, mask=valid[:, None] & (ov < DV)[None, :])
    tl.store(GC + rows * HV + hv, gc, mask=valid)


@triton.jit(do_not_specialize=["n_seqs"])
def _chunk_state_kernel(
    Q, K, V, A, B, A_LOG, DT_BIAS, W, U, GC, OUT, H0, HT, CU, READ, WRITE,
    n_seqs, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_ot, stride_oh, HV, RATIO, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (v tile, sequence x v head): the chunks in order: V', o, the state update; the state
    after the last full chunk to HT[WRITE[n]]."""
    iv = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // RATIO
    bos = tl.load(CU + n).to(tl.int64)
    eos = tl.load(CU + n + 1).to(tl.int64)
    r = tl.arange(0, CHUNK)
    ok = tl.arange(0, BLOCK_K)
    ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = ok < DK
    mv = ov < DV
    live = mv[:, None] & mk[None, :]
    tile = (hv * DV + ov[:, None]).to(tl.int64) * DK + ok[None, :]
    read = tl.load(READ + n).to(tl.int64)
    s = tl.load(H0 + read * HV * DV * DK + tile, mask=live & ((ok * 0 + read)[None, :] >= 0), other=0.0)
    dt = Q.dtype.element_ty
    causal = r[:, None] >= r[None, :]
    full = (eos - bos) // CHUNK
    for c in range((eos - bos + CHUNK - 1) // CHUNK):
        rows = bos + c * CHUNK + r
        valid = rows < eos
        q, k, _, _, _ = _chunk_rows(
            Q, K, V, A, B, A_LOG, DT_BIAS, rows, valid, hk, hv, ok, ov, stride_qt, stride_qh, stride_kt,
            stride_kh, stride_vt, stride_vh, stride_at, stride_bt, scale, eps, DK, DV, SOFTPLUS_MAX,
        )  # fmt: skip
        w = tl.load(
            W + (rows[:, None] * HV + hv) * DK + ok[None, :], mask=valid[:, None] & mk[None, :], other=0.0
        )
        u = tl.load(
            U + (rows[:, None] * HV + hv) * DV + ov[None, :], mask=valid[:, None] & mv[None, :], other=0.0
        )
        gc = tl.load(GC + rows * HV + hv, mask=valid, other=0.0)
        last = tl.minimum(eos - bos - c * CHUNK, CHUNK) - 1  # the chunk's last row (CHUNK - 1 if full)
        g_last = tl.reduce(tl.where(r == last, gc, 0.0), 0, _sum_combine)  # the decay across the chunk
        s_t = tl.trans(s).to(dt)  # [BK, BV]
        v_new = u - _dot(w.to(dt), s_t, PRECISION, DOT_FP32)  # [C, BV]
        qk = _dot(q, tl.trans(k), PRECISION, DOT_FP32)  # [C, C]
        p = tl.where(causal, qk * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
        o = _dot((q.to(tl.float32) * tl.exp(gc)[:, None]).to(dt), s_t, PRECISION, DOT_FP32)
        o += _dot(p.to(dt), v_new.to(dt), PRECISION, DOT_FP32)
        tl.store(OUT + rows[:, None] * stride_ot + hv * stride_oh + ov[None, :], o.to(OUT.dtype.element_ty),
                 mask=valid[:, None] & mv[None, :])  # fmt: skip
        k_decayed = (k.to(tl.float32) * tl.exp(g_last - gc)[:, None]).to(dt)
        s = s * tl.exp(g_last) + _dot(tl.trans(v_new.to(dt)), k_decayed, PRECISION, DOT_FP32)
        if c == full - 1:
            write = tl.load(WRITE + n).to(tl.int64)
            tl.debug_barrier()  # every thread has read its tile of the slot before any writes
            tl.store(HT + write * HV * DV * DK + tile, s, mask=live & ((ok * 0 + write)[None, :] >= 0))


def chunk_map(cu_seqlens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence [C_total], first row [C_total]) of every chunk of every sequence, chunks anchored at
    each sequence's first row (a host sync: the grid is the chunk count)."""
    cu = cu_seqlens.long().cpu()
    lengths = cu[1:] - cu[:-1]
    counts = (lengths + chunk - 1) // chunk
    seq = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    first = torch.cumsum(counts, 0) - counts
    rows = cu[:-1][seq] + (torch.arange(int(counts.sum())) - first[seq]) * chunk
    return seq.to(cu_seqlens.device), rows.to(cu_seqlens.device)


def chunked_forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, h0, read, ht, write):
    """o [T, HV, DV] in v's dtype of packed sequences, each from the state h0[read[n]] (0 where
    read[n] < 0) at a chunk boundary; the state after a sequence's last full chunk to ht[write[n]]."""
    n_tokens, hk, d_k = q.shape
    hv, d_v = v.shape[1], v.shape[2]
    n_seqs = cu_seqlens.shape[0] - 1
    o = torch.empty(n_tokens, hv, d_v, dtype=v.dtype, device=v.device)
    if n_tokens == 0:
        return o
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    seq, first = chunk_map(cu_seqlens, CHUNK)
    w = torch.empty(n_tokens, hv, d_k, dtype=torch.float32, device=v.device)
    u = torch.empty(n_tokens, hv, d_v, dtype=torch.float32, device=v.device)
    gc = torch.empty(n_tokens, hv, dtype=torch.float32, device=v.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    dot_fp32 = type(_chunk_state_kernel).__name__ == "InterpretedFunction" and q.dtype != torch.float32
    block_k, block_dv = triton.next_power_of_2(d_k), triton.next_power_of_2(d_v)
    block_v = min(BLOCK_V, block_dv)
    common = (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
    )  # fmt: skip
    _chunk_prepare_kernel[(seq.shape[0], hv)](
        q, k, v, a, b, A_log, dt_bias, w, u, gc, cu_seqlens, seq, first, seq.shape[0], *common,
        hv, hv // hk, qk_scale(d_k), L2NORM_EPS,
        DK=d_k, DV=d_v, BLOCK_K=block_k, BLOCK_DV=block_dv, CHUNK=CHUNK, SOFTPLUS_MAX=SOFTPLUS_THRESHOLD,
        PRECISION=precision, DOT_FP32=dot_fp32, num_warps=4,
    )  # fmt: skip
    _chunk_state_kernel[(triton.cdiv(d_v, block_v), n_seqs * hv)](
        q, k, v, a, b, A_log, dt_bias, w, u, gc, o, h0, ht, cu_seqlens, read, write, n_seqs, *common,
        o.stride(0), o.stride(1), hv, hv // hk, qk_scale(d_k), L2NORM_EPS,
        DK=d_k, DV=d_v, BLOCK_K=block_k, BLOCK_V=block_v, CHUNK=CHUNK, SOFTPLUS_MAX=SOFTPLUS_THRESHOLD,
        PRECISION=precision, DOT_FP32=dot_fp32, num_warps=4,
    )  # fmt: skip
    return o
