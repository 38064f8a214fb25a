"""Triton backward of the gated delta recurrence (training only): a reverse recurrence, deterministic,
not batch-invariant (DESIGN rule 7).

Forward, per token (state tile S^T [DV, DK], fp32): S' = alpha S (alpha = exp(g)), u = v - S'^T k,
d = beta u, S_t = S' + k d^T, o = S_t^T q. Backward, tokens in reverse, dS = dL/dS_t carried back:
    dq   = S_t do                       dS  += q do^T
    dd   = dS^T k                       dk   = dS d - S' du,  du = beta dd,  dv = du
    dbeta = dd . u                      dS'  = dS - k du^T
    dg   = <dS', S'>  (= d alpha * alpha)   dS_{t-1} = alpha dS'
The states S_{t-1} are rebuilt, not inverted (alpha may underflow): a first pass stores the state at
every CHUNK-th token (checkpoints); the second pass takes the chunks last to first, replays a chunk
from its checkpoint storing its states in a per-program scratch, then walks it in reverse.

Program (v tile, sequence x v head) owns its rows of dv and its own partial rows of dq, dk, dg,
dbeta (sums over its v tile); the host sums the partials over the v tiles and the v heads of a k
head with torch sums (fixed order, no atomics).
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

# Tokens per checkpoint: memory is (tokens / CHUNK) states plus CHUNK states per program.
CHUNK = 16


@triton.jit
def _advance(h, QH, KH, V, G, BETA, t, hk, hv, ok, ov, mk, mv, HK, HV, DK, DV):
    """The state after token t from the state before it (the forward's step, on the given q_hat, k_hat)."""
    k = tl.load(KH + (t * HK + hk) * DK + ok, mask=mk, other=0.0)
    v = tl.load(V + (t * HV + hv) * DV + ov, mask=mv, other=0.0).to(tl.float32)
    h = h * tl.exp(tl.load(G + t * HV + hv))
    u = v - tl.reduce(h * k[None, :], 1, _sum_combine)
    return h + (u * tl.load(BETA + t * HV + hv))[:, None] * k[None, :]


@triton.jit(do_not_specialize=["n_seqs", "n_tokens", "n_chunks"])
def _recurrent_bwd_kernel(
    QH, KH, V, G, BETA, DO, DHT, H0, CU, CHUNK_START, READ,
    DQ, DK_, DV_, DG, DBETA, DH0, CKPT, SCRATCH,
    n_seqs, n_tokens, n_chunks, HK, HV, RATIO,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    iv = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // RATIO
    bos = tl.load(CU + n).to(tl.int64)
    eos = tl.load(CU + n + 1).to(tl.int64)
    first_chunk = tl.load(CHUNK_START + n).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    rv = tl.arange(0, BLOCK_V)
    ov = iv * BLOCK_V + rv
    mk = ok < DK
    mv = ov < DV
    live = mv[:, None] & mk[None, :]
    tile = (hv * DV + ov[:, None]).to(tl.int64) * DK + ok[None, :]  # in a [N, HV, DV, DK] state
    local = rv[:, None] * BLOCK_K + ok[None, :]  # in a [BLOCK_V, BLOCK_K] checkpoint or scratch tile
    tile_size = BLOCK_V * BLOCK_K
    ckpt = CKPT + ((iv * n_chunks + first_chunk) * HV + hv).to(tl.int64) * tile_size
    scratch = SCRATCH + ((iv * n_seqs + n) * HV + hv).to(tl.int64) * CHUNK * tile_size
    read = tl.load(READ + n).to(tl.int64)
    h = tl.load(H0 + read * HV * DV * DK + tile, mask=live & ((ok * 0 + read)[None, :] >= 0), other=0.0)
    chunks = (eos - bos + CHUNK - 1) // CHUNK
    # 1. checkpoints: the state before each chunk
    for c in range(chunks):
        tl.store(ckpt + c * HV * tile_size + local, h)
        for t in range(bos + c * CHUNK, tl.minimum(bos + c * CHUNK + CHUNK, eos)):
            h = _advance(h, QH, KH, V, G, BETA, t, hk, hv, ok, ov, mk, mv, HK, HV, DK, DV)
    tl.debug_barrier()  # checkpoints written by every thread before any reads them
    # 2. chunks last to first: replay the chunk into the scratch, then walk it in reverse
    dh = tl.load(DHT + n * HV * DV * DK + tile, mask=live, other=0.0)
    for cc in range(chunks):
        c = chunks - 1 - cc
        start = bos + c * CHUNK
        end = tl.minimum(start + CHUNK, eos)
        h = tl.load(ckpt + c * HV * tile_size + local)
        for t in range(start, end):
            tl.store(scratch + (t - start) * tile_size + local, h)
            h = _advance(h, QH, KH, V, G, BETA, t, hk, hv, ok, ov, mk, mv, HK, HV, DK, DV)
        tl.debug_barrier()  # the chunk's states written before any thread reads them back
        for tt in range(end - start):
            t = end - 1 - tt
            prev = tl.load(scratch + (t - start) * tile_size + local)  # S_{t-1}
            q = tl.load(QH + (t * HK + hk) * DK + ok, mask=mk, other=0.0)
            k = tl.load(KH + (t * HK + hk) * DK + ok, mask=mk, other=0.0)
            v = tl.load(V + (t * HV + hv) * DV + ov, mask=mv, other=0.0).to(tl.float32)
            do = tl.load(DO + (t * HV + hv) * DV + ov, mask=mv, other=0.0).to(tl.float32)
            alpha = tl.exp(tl.load(G + t * HV + hv))
            beta = tl.load(BETA + t * HV + hv)
            decayed = prev * alpha  # S'
            u = v - tl.reduce(decayed * k[None, :], 1, _sum_combine)
            d = u * beta
            state = decayed + d[:, None] * k[None, :]  # S_t
            dq = tl.reduce(state * do[:, None], 0, _sum_combine)  # [BLOCK_K]
            dh = dh + do[:, None] * q[None, :]
            dd = tl.reduce(dh * k[None, :], 1, _sum_combine)  # [BLOCK_V]
            du = dd * beta
            dk = tl.reduce(dh * d[:, None], 0, _sum_combine) - tl.reduce(
                decayed * du[:, None], 0, _sum_combine
            )
            d_decayed = dh - du[:, None] * k[None, :]
            dg = tl.reduce(tl.reduce(d_decayed * decayed, 1, _sum_combine), 0, _sum_combine)
            dbeta = tl.reduce(dd * u, 0, _sum_combine)
            dh = d_decayed * alpha
            part = (iv * n_tokens + t) * HV + hv  # this program's partial row
            tl.store(DQ + part * DK + ok, dq, mask=mk)
            tl.store(DK_ + part * DK + ok, dk, mask=mk)
            tl.store(DV_ + (t * HV + hv) * DV + ov, du, mask=mv)
            tl.store(DG + part, dg)
            tl.store(DBETA + part, dbeta)
        tl.debug_barrier()  # the scratch is read by every thread before the next chunk overwrites it
    tl.store(DH0 + n * HV * DV * DK + tile, dh, mask=live)


def recurrence_backward(q_hat, k_hat, v, g, beta, do, d_final, initial_state, cu_seqlens, config):
    """Gradients of the recurrence: (dq_hat [T, HK, DK], dk_hat [T, HK, DK], dv [T, HV, DV],
    dg [T, HV], dbeta [T, HV], d_initial_state [N, HV, DV, DK] or None), all fp32.

    q_hat, k_hat: fp32 [T, HK, DK]; v [T, HV, DV]; g, beta fp32 [T, HV]; do [T, HV, DV]; d_final
    [N, HV, DV, DK] or None; initial_state [N, HV, DV, DK] or None; config: the forward's
    (BLOCK_K, BLOCK_V, num_warps)."""
    n_tokens, hk, d_k = q_hat.shape
    hv, d_v = v.shape[1], v.shape[2]
    n_seqs = cu_seqlens.shape[0] - 1
    device = v.device
    block_k, block_v, warps = config
    n_v = triton.cdiv(d_v, block_v)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    chunks = (lengths + CHUNK - 1) // CHUNK  # [N]
    chunk_start = torch.cumsum(chunks, 0) - chunks  # [N]: each sequence's first checkpoint
    n_chunks = int(chunks.sum())  # a host sync: the backward sizes its buffers
    f32 = dict(dtype=torch.float32, device=device)
    ckpt = torch.empty(n_v, max(n_chunks, 1), hv, block_v, block_k, **f32)
    scratch = torch.empty(n_v * max(n_seqs, 1) * hv, CHUNK, block_v, block_k, **f32)
    dq = torch.empty(n_v, n_tokens, hv, d_k, **f32)
    dk = torch.empty(n_v, n_tokens, hv, d_k, **f32)
    dv = torch.empty(n_tokens, hv, d_v, **f32)
    dg = torch.empty(n_v, n_tokens, hv, **f32)
    dbeta = torch.empty(n_v, n_tokens, hv, **f32)
    dh0 = torch.empty(n_seqs, hv, d_v, d_k, **f32)
    if d_final is None:
        d_final = torch.zeros_like(dh0)
    seq_ids = torch.arange(n_seqs, dtype=torch.int64, device=device)
    read = torch.full_like(seq_ids, -1) if initial_state is None else seq_ids
    if n_seqs and n_tokens:
        _recurrent_bwd_kernel[(n_v, n_seqs * hv)](
            q_hat.contiguous(), k_hat.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            do.contiguous(), d_final.contiguous(), initial_state if initial_state is not None else dh0,
            cu_seqlens, chunk_start, read, dq, dk, dv, dg, dbeta, dh0, ckpt, scratch,
            n_seqs, n_tokens, max(n_chunks, 1), hk, hv, hv // hk,
            DK=d_k, DV=d_v, BLOCK_K=block_k, BLOCK_V=block_v, CHUNK=CHUNK, num_warps=warps,
        )  # fmt: skip
    else:
        dh0.copy_(d_final)
        dv.zero_()
    ratio = hv // hk
    dq_hat = dq.sum(0).view(n_tokens, hk, ratio, d_k).sum(2)  # v tiles, then the k head's v heads
    dk_hat = dk.sum(0).view(n_tokens, hk, ratio, d_k).sum(2)
    return dq_hat, dk_hat, dv, dg.sum(0), dbeta.sum(0), (dh0 if initial_state is not None else None)
