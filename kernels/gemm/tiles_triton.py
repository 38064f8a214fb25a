"""Triton building blocks shared by the GEMM kernels (linear_triton, split_triton, moe/core_triton):
the tile order, and the reduction of one K range, which fixes how every output element is summed.

`dot_k_range` (pointer loads) and `dot_k_range_tma` (tensor descriptors) reduce a K range the same
way: from its first column, one `tl.dot` per BLOCK_K step chained on an fp32 accumulator in K order,
what lies past M, N or the range's end read as exact zeros. A kernel that splits K into parts calls
them once per part; the parts are summed by the caller.
"""

import triton
import triton.language as tl


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a tile: GROUP_M row-tiles share each column sweep so W stays in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // tiles_per_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % tiles_per_group) % group_size_m
    pid_n = (tile_id % tiles_per_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def dot_k_range(
    x_ptrs,  # [BLOCK_M, BLOCK_K] pointers at the range's first column
    w_ptrs,  # [BLOCK_K, BLOCK_N] pointers (W^T tile) at the range's first column
    row_ok,  # [BLOCK_M] rows below M
    k_len,  # columns in the range
    EVEN_K: tl.constexpr,  # k_len % BLOCK_K == 0: no tail mask
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] sum over one K range from its first column: one `tl.dot` per BLOCK_K
    step, chained on the accumulator in K order, the tail masked with exact zeros. The only K loop of
    the pointer kernels (split_triton.py's too), so every path reduces a range the same way."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for ki in range((k_len + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_left = k_len - ki * BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def dot_k_range_tma(
    x_desc,
    w_desc,
    row0,
    col0,
    first_tile,
    k_tiles,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """`dot_k_range` through tensor descriptors: K steps first_tile .. first_tile + k_tiles - 1, in
    order; what lies past M, N or K loads as exact zeros."""
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for ki in range(first_tile, first_tile + k_tiles):
        x = x_desc.load([row0, ki * BLOCK_K])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([col0, ki * BLOCK_K])  # [BLOCK_N, BLOCK_K]
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w.T, acc, input_precision="ieee")
    return acc
