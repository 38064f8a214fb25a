"""Backward of the Triton varlen attention (training only; deterministic, need not be batch-invariant).

Math (FlashAttention-2 recomputation), per query row i (position p_i, head h) and key j <= p_i of
its sequence, c = scale * log2(e), lse_i the forward's log-sum-exp in log2 units:
    P_ij  = exp2(c * (q_i . k_j) - lse_i)                          (the forward's softmax, recomputed)
    delta_i = sum_d dO_i[d] * O_i[d]                                 (fp32, `_delta_kernel`)
    dV_j  = sum_i P_ij dO_i        dP_ij = dO_i . v_j        dS_ij = P_ij (dP_ij - delta_i)
    dK_j  = scale * sum_i dS_ij q_i                 dQ_i = scale * sum_j dS_ij k_j

Head sizes: q, k, dQ, dK have D dims, v, O, dO, dV have Dv (core_triton: "Head sizes").

Determinism: no atomics. `_dkdv_kernel` owns one key tile of one kv head and loops over the query
tiles of its sequence in order (the G query heads of the kv head sit along the rows, so the group
sum happens inside the dots); `_dq_kernel` owns one row tile and loops over the key tiles in order.
Every sum therefore has one fixed order per launch shape. Programs find their sequence on the device
as the forward does (`core_triton.seq_of_tile`): no host synchronisation.
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from .core_triton import (
    LOG2E,
    head_block,
    load_tile,
    query_rows,
    seq_of_tile,
    store_tile,
    tile_count,
    tile_dot,
    tile_start,
)

# BLOCK_D (the query/key head size's tile) -> (BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) of
# `_dkdv_kernel` and of `_dq_kernel`; only speed depends on these (the backward need not be
# batch-invariant, only deterministic). Head sizes that are not powers of two (DeepSeek's 192/128)
# run in their power-of-two tiles, the dims past the head size loaded as 0 and never stored.
BWD_CONFIGS = {
    16: ((64, 64, 4, 2), (64, 64, 4, 2)),
    32: ((64, 64, 4, 2), (64, 64, 4, 2)),
    64: ((64, 64, 4, 2), (64, 64, 4, 2)),
    128: ((64, 64, 4, 2), (128, 32, 4, 3)),
    256: ((64, 32, 8, 1), (64, 32, 8, 1)),
}


@triton.jit
def _delta_kernel(
    o_ptr,
    do_ptr,
    delta_ptr,
    n_rows,
    n_heads,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    HEAD_DIM: tl.constexpr,  # the value head size (O's and dO's)
    BLOCK_DV: tl.constexpr,  # its power-of-two tile
    BLOCK_R: tl.constexpr,  # (token, head) rows per program; each row's sum is one fixed tree
):
    """delta[t, h] = sum_d fp32(dO[t, h, d]) * fp32(O[t, h, d]) for BLOCK_R rows r = t * Hq + h."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n_rows
    t = (r // n_heads).to(tl.int64)
    h = r % n_heads
    d = tl.arange(0, BLOCK_DV)
    o = load_tile(o_ptr + (t * stride_ot + h * stride_oh)[:, None] + d[None, :], ok, d, HEAD_DIM, BLOCK_DV, True)
    do = load_tile(do_ptr + (t * stride_dot + h * stride_doh)[:, None] + d[None, :], ok, d, HEAD_DIM, BLOCK_DV, True)
    tl.store(delta_ptr + r, tl.reduce(o.to(tl.float32) * do.to(tl.float32), 1, _sum_combine), mask=ok)


@triton.jit
def _dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    cu_ptr,
    n_seqs,
    qk_scale,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_lt,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    GROUP: tl.constexpr,  # Hq // Hkv: query heads of this kv head along the rows
    HEAD_DIM: tl.constexpr,  # query/key head size
    HEAD_DIM_V: tl.constexpr,  # value head size
    BLOCK_D: tl.constexpr,  # their power-of-two tiles
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs
    DOT_FP32: tl.constexpr,  # interpreter only (see `tile_dot`)
):
    """dK, dV of one BLOCK_N-key tile of one kv head (tiles found as in the forward, early ones first)."""
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = seq_of_tile(cu_ptr, n_seqs, tile, BLOCK_N)
    seq_start = tl.load(cu_ptr + b)
    seq_end = tl.load(cu_ptr + b + 1)
    first = seq_start + (tile - tile_start(seq_start, b, BLOCK_N)) * BLOCK_N
    if first >= seq_end:
        return
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key = first + offs_n
    k_valid = key < seq_end
    k_pos = key - seq_start
    key = key.to(tl.int64)
    k_ptrs = k_ptr + key[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    k = load_tile(k_ptrs, k_valid, offs_d, HEAD_DIM, BLOCK_D, True)
    v_ptrs = v_ptr + key[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :]
    v = load_tile(v_ptrs, k_valid, offs_dv, HEAD_DIM_V, BLOCK_DV, True)
    dk = tl.full([BLOCK_N, BLOCK_D], 0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_DV], 0, dtype=tl.float32)
    # Queries before the tile's first key see none of it: start there, walk to the sequence end.
    for q_first in range(first, seq_end, TOKENS):
        token, head, valid, q_pos = query_rows(
            q_first, seq_end, q_first - seq_start, kv_head, GROUP, BLOCK_M
        )
        q = load_tile(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], valid,
                      offs_d, HEAD_DIM, BLOCK_D, True)  # fmt: skip
        do = load_tile(do_ptr + token[:, None] * stride_dot + head[:, None] * stride_doh + offs_dv[None, :], valid,
                       offs_dv, HEAD_DIM_V, BLOCK_DV, True)  # fmt: skip
        lse = tl.load(lse_ptr + token * stride_lt + head, mask=valid, other=0.0)
        delta = tl.load(delta_ptr + token * stride_lt + head, mask=valid, other=0.0)
        # 1. Recompute P (zero where masked), 2. dV += P^T dO, 3. dS = P (dO V^T - delta), dK += dS^T Q.
        s = tile_dot(q, tl.trans(k), None, PRECISION, DOT_FP32)  # [BLOCK_M, BLOCK_N]
        p = tl.exp2(tl.fma(s, qk_scale, -lse[:, None]))
        p = tl.where(valid[:, None] & (k_pos[None, :] <= q_pos[:, None]), p, 0.0)
        dv = tile_dot(tl.trans(p.to(do.dtype)), do, dv, PRECISION, DOT_FP32)
        dp = tile_dot(do, tl.trans(v), None, PRECISION, DOT_FP32)
        ds = p * (dp - delta[:, None])
        dk = tile_dot(tl.trans(ds.to(q.dtype)), q, dk, PRECISION, DOT_FP32)
    dk = dk * scale
    dk_ptrs = dk_ptr + key[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :]
    store_tile(dk_ptrs, dk.to(dk_ptr.dtype.element_ty), k_valid, offs_d, HEAD_DIM, BLOCK_D)
    dv_ptrs = dv_ptr + key[:, None] * stride_dvt + kv_head * stride_dvh + offs_dv[None, :]
    store_tile(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), k_valid, offs_dv, HEAD_DIM_V, BLOCK_DV)


@triton.jit
def _dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    cu_ptr,
    n_seqs,
    qk_scale,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_lt,
    stride_dqt,
    stride_dqh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """dQ of one row tile of one kv head (tiles found as in the forward, late ones first)."""
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    b = seq_of_tile(cu_ptr, n_seqs, tile, TOKENS)
    seq_start = tl.load(cu_ptr + b)
    seq_end = tl.load(cu_ptr + b + 1)
    first = seq_start + (tile - tile_start(seq_start, b, TOKENS)) * TOKENS
    if first >= seq_end:
        return
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    token, head, valid, q_pos = query_rows(first, seq_end, first - seq_start, kv_head, GROUP, BLOCK_M)
    q = load_tile(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], valid, offs_d,
                  HEAD_DIM, BLOCK_D, True)  # fmt: skip
    do = load_tile(do_ptr + token[:, None] * stride_dot + head[:, None] * stride_doh + offs_dv[None, :], valid,
                   offs_dv, HEAD_DIM_V, BLOCK_DV, True)  # fmt: skip
    lse = tl.load(lse_ptr + token * stride_lt + head, mask=valid, other=0.0)
    delta = tl.load(delta_ptr + token * stride_lt + head, mask=valid, other=0.0)
    dq = tl.full([BLOCK_M, BLOCK_D], 0, dtype=tl.float32)
    max_pos = first - seq_start + tl.minimum(seq_end - first, TOKENS) - 1
    for t in range(0, max_pos // BLOCK_N + 1):
        k_pos = t * BLOCK_N + offs_n
        k_valid = k_pos < seq_end - seq_start
        key = (seq_start + k_pos).to(tl.int64)
        k = load_tile(k_ptr + key[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], k_valid, offs_d,
                      HEAD_DIM, BLOCK_D, True)  # fmt: skip
        v = load_tile(v_ptr + key[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :], k_valid, offs_dv,
                      HEAD_DIM_V, BLOCK_DV, True)  # fmt: skip
        # 1. Recompute P, 2. dS = P (dO V^T - delta), 3. dQ += dS K.
        s = tile_dot(q, tl.trans(k), None, PRECISION, DOT_FP32)
        p = tl.exp2(tl.fma(s, qk_scale, -lse[:, None]))
        p = tl.where(valid[:, None] & (k_pos[None, :] <= q_pos[:, None]), p, 0.0)
        dp = tile_dot(do, tl.trans(v), None, PRECISION, DOT_FP32)
        ds = p * (dp - delta[:, None])
        dq = tile_dot(ds.to(k.dtype), k, dq, PRECISION, DOT_FP32)
    dq = dq * scale
    dq_ptrs = dq_ptr + token[:, None] * stride_dqt + head[:, None] * stride_dqh + offs_d[None, :]
    store_tile(dq_ptrs, dq.to(dq_ptr.dtype.element_ty), valid, offs_d, HEAD_DIM, BLOCK_D)


def varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens, scale):
    """(dq, dk, dv) of `varlen_triton.varlen_attention`; q, k [T, H, D], v, out, grad_out [T, H, Dv];
    lse [T, Hq] fp32 in log2 units; cu_seqlens int32 [B + 1]. No host synchronisation."""
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    n_tokens, n_heads, head_dim = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if n_tokens == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty((n_tokens, n_heads), dtype=torch.float32, device=q.device)
    block_r = 64
    _delta_kernel[(triton.cdiv(n_tokens * n_heads, block_r),)](
        out, grad_out, delta, n_tokens * n_heads, n_heads,
        out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1),
        HEAD_DIM=v.shape[2], BLOCK_DV=head_block(v.shape[2]), BLOCK_R=block_r,
    )  # fmt: skip
    args = (grad_out, q, k, v, lse.contiguous(), delta, cu_seqlens, scale)
    _launch_dkdv(*args, dk, dv)
    _launch_dq(*args, dq)
    return dq, dk, dv


def _launch_meta(q, k, v, block_m, kernel):
    group = q.shape[1] // k.shape[1]
    block_m = max(block_m, triton.next_power_of_2(group))  # a tile holds at least one token's heads
    meta = {
        "GROUP": group,
        "HEAD_DIM": q.shape[2],
        "HEAD_DIM_V": v.shape[2],
        "BLOCK_D": head_block(q.shape[2]),
        "BLOCK_DV": head_block(v.shape[2]),
        "BLOCK_M": block_m,
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "DOT_FP32": type(kernel).__name__ == "InterpretedFunction",
    }
    return group, block_m, meta


def _launch_dkdv(grad_out, q, k, v, lse, delta, cu_seqlens, scale, dk, dv):
    block_m, block_n, num_warps, num_stages = BWD_CONFIGS[head_block(q.shape[2])][0]
    _, block_m, meta = _launch_meta(q, k, v, block_m, _dkdv_kernel)
    n_seqs = cu_seqlens.shape[0] - 1
    _dkdv_kernel[(tile_count(q.shape[0], n_seqs, block_n), k.shape[1])](
        q, k, v, grad_out, lse, delta, dk, dv, cu_seqlens, n_seqs, scale * LOG2E, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), lse.stride(0), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **meta,
    )  # fmt: skip


def _launch_dq(grad_out, q, k, v, lse, delta, cu_seqlens, scale, dq):
    block_m, block_n, num_warps, num_stages = BWD_CONFIGS[head_block(q.shape[2])][1]
    group, block_m, meta = _launch_meta(q, k, v, block_m, _dq_kernel)
    n_seqs = cu_seqlens.shape[0] - 1
    _dq_kernel[(tile_count(q.shape[0], n_seqs, block_m // group), k.shape[1])](
        q, k, v, grad_out, lse, delta, dq, cu_seqlens, n_seqs, scale * LOG2E, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), lse.stride(0), dq.stride(0), dq.stride(1),
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **meta,
    )  # fmt: skip
