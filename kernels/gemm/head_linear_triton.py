"""Triton per-head linear maps (the CUDA path of `head_linear.py`): y[t, h] = x[t, h] @ W[h]^T.

Program (row tile, column tile, head): acc [BLOCK_M, BLOCK_N] fp32 from zero, then for each K step
of HEAD_BLOCK_K columns in order one `tl.dot(x_tile, w_tile, acc)` (on Hopper: a chain of k = 16
MMAs on the accumulator in K order), rows past T, columns past N and the K tail loaded as exact
zeros; the sum rounded once to the output dtype. The weight tile [HEAD_BLOCK_K, BLOCK_N] is read
through the weight's own strides (W_UK^T is a transposed view of `kv_b_proj.weight`): the layout
decides only how a tile is loaded. HEAD_BLOCK_K is one constant, so every call reduces an element in
the same order whatever T, the tile or the head count: the bits of row t depend on x[t] and W alone.
"""

import torch
import triton
import triton.language as tl

# K step of every launch: with K it fixes the accumulation order (the interpreter's dot sums a step
# at a time), so it is one constant for every shape.
HEAD_BLOCK_K = 64
# Tile (speed only: a tile decides which program computes an element, not how).
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 64, 4, 3


@triton.jit(do_not_specialize=["T"])
def _head_linear_kernel(
    x_ptr,  # [T, H, K], unit stride in K
    w_ptr,  # [H, N, K], any strides
    y_ptr,  # [T, H, N], contiguous
    T,  # not specialized: the token count must not select another compiled kernel
    N,
    K: tl.constexpr,  # per weight shape (one compilation each): the K loop's bound is a constant
    stride_xt,
    stride_xh,
    stride_wh,
    stride_wn,
    stride_wk,
    stride_yt,
    stride_yh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # HEAD_BLOCK_K: part of the reduction order
    DOT_FP32: tl.constexpr,  # interpreter only: its tl.dot multiplies bf16 raw bits; bf16 -> fp32 is exact
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < T
    col_ok = offs_n < N
    x_ptrs = x_ptr + head * stride_xh + offs_m.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    w_ptrs = w_ptr + head * stride_wh + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    # 1. K steps in order, the tail masked with exact zeros.
    for ki in range((K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - ki * BLOCK_K
        x = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    # 2. Round once, store the valid part.
    y_ptrs = y_ptr + head * stride_yh + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _interpreted() -> bool:
    return type(_head_linear_kernel).__name__ == "InterpretedFunction"


def head_linear_triton(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[T, H, N] in `out_dtype` of x [T, H, K] (unit stride in K) and weight [H, N, K] (any strides),
    checked by `head_linear.head_linear`. CUDA tensors (CPU tensors only under TRITON_INTERPRET=1)."""
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError(f"head_linear_triton needs CUDA tensors, got {x.device} (set TRITON_INTERPRET=1 on CPU)")
    n_tokens, n_heads, k = x.shape
    n = weight.shape[1]
    y = torch.empty(n_tokens, n_heads, n, dtype=out_dtype, device=x.device)
    if n_tokens == 0 or n == 0 or n_heads == 0:
        return y
    grid = (triton.cdiv(n_tokens, BLOCK_M), triton.cdiv(n, BLOCK_N), n_heads)
    _head_linear_kernel[grid](
        x, weight, y, n_tokens, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=HEAD_BLOCK_K,
        DOT_FP32=_interpreted() and x.dtype != torch.float32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return y
