"""Triton (CUDA) causal attention over packed sequences: the training entry point and its autograd.

`varlen_attention` runs `_varlen_fwd_kernel`: program (row tile, kv head) -> BLOCK_M rows of one
sequence, each row reduced by `core_triton.attend_rows` (the math, the invariant and the
key splits are that module's), so a row's bits are those of the paged entry point
(`paged_triton.py`) for the same query. The path is differentiable (`_VarlenAttention`,
backward in `varlen_triton_bwd.py`: deterministic, no atomics).
"""

import torch
import triton
import triton.language as tl

from ..autograd_utils import backward_without_autocast
from .core_triton import (
    LOG2E,
    attend_rows,
    dot_precision,
    forward_config,
    head_block,
    interpreted,
    key_split_tiles,
    latent_config,
    load_rope_tile,
    load_tile,
    query_rows,
    seq_of_tile,
    store_tile,
    tile_count,
    tile_start,
)
from .latent import latent_attention_backward, values_in_keys
from .tiles import KEY_TILE
from .varlen_triton_bwd import varlen_attention_backward


@triton.jit(do_not_specialize=["n_seqs"])  # the batch size must not select another kernel
def _varlen_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    cu_ptr,
    n_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    GROUP: tl.constexpr,  # Hq // Hkv: query heads packed along the rows of one kv head's tile
    HEAD_DIM: tl.constexpr,  # query/key head size
    HEAD_DIM_V: tl.constexpr,  # value head size
    BLOCK_D: tl.constexpr,  # their power-of-two tiles (core_triton.head_block)
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    STORE_LSE: tl.constexpr,  # training keeps the log-sum-exp for the backward
    SPLIT_TILES: tl.constexpr = 0,  # key tiles per split (0: none)
    HEAD_DIM_R: tl.constexpr = 0,  # the latent's rotary dims (core_triton.attend_tile; 0: none)
    BLOCK_R: tl.constexpr = 16,
):
    """Training entry: packed sequences (cu_seqlens); program (tile, kv head) -> BLOCK_M rows."""
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # late (long) tiles first
    kv_head = tl.program_id(1)
    b = seq_of_tile(cu_ptr, n_seqs, tile, TOKENS)
    seq_start = tl.load(cu_ptr + b)
    seq_end = tl.load(cu_ptr + b + 1)
    first = seq_start + (tile - tile_start(seq_start, b, TOKENS)) * TOKENS
    if first >= seq_end:
        return
    token, head, valid, q_pos = query_rows(first, seq_end, first - seq_start, kv_head, GROUP, BLOCK_M)
    max_pos = first - seq_start + tl.minimum(seq_end - first, TOKENS) - 1
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + token * stride_qt + head * stride_qh
    q = load_tile(q_rows[:, None] + offs_d[None, :], valid, offs_d, HEAD_DIM, BLOCK_D, True)
    q_r = q
    if HEAD_DIM_R > 0:
        q_r = load_rope_tile(q_rows, valid, HEAD_DIM, HEAD_DIM_R, BLOCK_R)
    out, lse = attend_rows(
        q,
        q_r,
        q_pos,
        first - seq_start,
        max_pos,
        seq_end - seq_start,
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_vh,
        seq_start,
        stride_kt,
        stride_vt,
        cu_ptr,  # no block table
        0,
        0,
        qk_scale,
        False,
        1,
        HEAD_DIM,
        HEAD_DIM_V,
        BLOCK_D,
        BLOCK_DV,
        BLOCK_M,
        BLOCK_N,
        PRECISION,
        DOT_FP32,
        SPLIT_TILES,
        HEAD_DIM_R,
        BLOCK_R,
    )
    o_ptrs = o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
    store_tile(o_ptrs, out.to(o_ptr.dtype.element_ty), valid, offs_dv, HEAD_DIM_V, BLOCK_DV)
    if STORE_LSE:
        tl.store(lse_ptr + token * stride_lt + head, lse, mask=valid)


def _varlen_forward(q, k, v, cu_seqlens, scale, store_lse, split_tiles):
    """out [T, Hq, Dv] (q.dtype) and, if store_lse, lse [T, Hq] fp32 in log2 units; `split_tiles`:
    `key_split_tiles`'. The latent (`values_in_keys(k, v)`): q [T, Hq, C + R], k [T, 1, C + R], v
    its first C dims; Hq / group programs along the kv-head axis all read the one key head."""
    n_tokens, n_heads, head_dim = q.shape
    head_dim_v = v.shape[2]
    if values_in_keys(k, v):
        group, block_m, num_warps, num_stages = latent_config(
            head_dim_v, head_dim - head_dim_v, n_heads, fp32=q.dtype == torch.float32
        )
        head_dim_r, head_dim, n_kv, stride_kh = head_dim - head_dim_v, head_dim_v, n_heads // group, 0
    else:
        n_kv, head_dim_r, stride_kh = k.shape[1], 0, k.stride(1)
        group = n_heads // n_kv
        block_m, num_warps, num_stages = forward_config(head_dim, group, head_dim_v)
    out = torch.empty((n_tokens, n_heads, head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((n_tokens, n_heads) if store_lse else (1, 1), dtype=torch.float32, device=q.device)
    n_seqs = cu_seqlens.shape[0] - 1
    if n_tokens == 0:
        return out, lse
    cu = cu_seqlens.to(torch.int32)
    grid = (tile_count(n_tokens, n_seqs, block_m // group), n_kv)
    _varlen_fwd_kernel[grid](
        q, k, v, out, lse, cu, n_seqs, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), stride_kh, v.stride(0), stride_kh if head_dim_r else v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=head_block(head_dim),
        BLOCK_DV=head_block(head_dim_v), BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        PRECISION=dot_precision(q.dtype), DOT_FP32=interpreted(), STORE_LSE=store_lse, enable_fp_fusion=False,
        num_warps=num_warps, num_stages=num_stages, SPLIT_TILES=split_tiles,
        HEAD_DIM_R=head_dim_r, BLOCK_R=head_block(head_dim_r) if head_dim_r else 16,
    )  # fmt: skip
    return out, lse


class _VarlenAttention(torch.autograd.Function):
    """varlen attention with the FlashAttention-2 style recomputing backward (deterministic)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, split_tiles):
        out, lse = _varlen_forward(q, k, v, cu_seqlens, scale, True, split_tiles)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens.to(torch.int32))
        ctx.scale = scale
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        backward = latent_attention_backward if values_in_keys(k, v) else varlen_attention_backward
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.scale)
        return dq, dk, dv, None, None, None


def varlen_attention(q, k, v, cu_seqlens, scale, longest=None):
    """Triton implementation of `causal.varlen_attention` (inputs already checked there);
    `longest`: the longest sequence, if the caller has it (`key_split_tiles`)."""
    if values_in_keys(k, v):
        latent_config(v.shape[2], k.shape[2] - v.shape[2], q.shape[1], fp32=q.dtype == torch.float32)
    else:
        forward_config(q.shape[2], q.shape[1] // k.shape[1], v.shape[2])
    split_tiles = key_split_tiles(q.shape[0] if longest is None else longest)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _VarlenAttention.apply(q, k, v, cu_seqlens, scale, split_tiles)
    return _varlen_forward(q, k, v, cu_seqlens, scale, False, split_tiles)[0]
