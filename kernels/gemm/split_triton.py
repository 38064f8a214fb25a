"""The two K parts of a split GEMM tile in separate programs, for decode batch sizes (CUDA, Triton).

Legend: M rows, N output columns, K the reduction, S = 2 parts of K/2 columns each.
Math (the reduction `linear_triton` defines for a weight shape with k_split = 2):
    p_s[m, n] = sum over k in [s K/2, (s+1) K/2) of x[m, k] W[n, k]   (`dot_k_range`, from the
                                                                       part's first column, BLOCK_K steps)
    y[m, n]   = ((p_0 + p_1) + fp32(b[n])).to(out_dtype)
Why separate programs: a narrow weight (N = 2048) in 16-wide column tiles gives 128 tiles at M <= 64,
fewer than two per SM of an H100; two programs per tile, each reading half of K, double the loads in
flight. How they meet: each program writes its fp32 part to a workspace [2, M, N], then takes a ticket
on its tile's counter (an atomic add, acquire-release); the program that draws the second ticket reads
the other part, adds the two and writes y.
Why the bits do not depend on which program finishes last: with two parts the last one computes
p_mine + p_other, and fp32 addition is commutative (p_0 + p_1 and p_1 + p_0 are the same number),
so every element equals the one-program kernel's p_0 + p_1 whatever the scheduling. Rows past M are
neither read nor written.
The counters: allocated and zeroed with every launch, like the workspace, never kept between
launches. A kept array (one per stream, zeroed once, reset by the kernel) broke the contract in
vLLM: allocated while a CUDA graph was being captured, it lay in the graphs' shared memory pool,
where other graphs' replays overwrote it, and a decode graph then met non-zero tickets (the
prefix-cache composition of the 1.7B check, 2026-11-24). Per launch, the zero fill is part of the
same stream's work (and of a captured graph): no state survives a launch.
"""

import torch
import triton
import triton.language as tl

from .tiles_triton import dot_k_range, tile_coords


@triton.jit(do_not_specialize=["M"])
def _linear_split_kernel(
    x_ptr,  # [M, K], unit stride in K
    w_ptr,  # [N, K], unit stride in K
    b_ptr,  # [N] or a dummy when HAS_BIAS is False
    y_ptr,  # [M, N], row stride stride_ym
    part_ptr,  # [2, M, N] fp32 workspace, contiguous
    count_ptr,  # [tiles] int32 tickets, zero on entry (this launch's own)
    M,  # not specialized: M must not select a different compiled kernel
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # (K / 2) % BLOCK_K == 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # K step: the weight shape's, fixes the order inside a part
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only (see linear_triton.py)
):
    pid = tl.program_id(0)
    tile_id = pid // 2
    part = pid % 2
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_part = K // 2
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + part * k_part + offs_k[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + part * k_part + offs_k[:, None]
    acc = dot_k_range(x_ptrs, w_ptrs, row_ok, k_part, EVEN_K, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)

    # Publish this part, then take a ticket: the barrier orders every thread's stores before the
    # (single-thread, release) atomic; its acquire orders the last program's loads after it.
    mask = row_ok[:, None] & (offs_n[None, :] < N)
    mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    plane = M.to(tl.int64) * N
    tl.store(part_ptr + part * plane + mn, acc, mask=mask)
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    if ticket == 1:  # the other part is written: finish the tile
        other = tl.load(part_ptr + (1 - part) * plane + mn, mask=mask, other=0.0, cache_modifier=".cg")
        acc = acc + other  # p_mine + p_other == p_0 + p_1 (commutative)
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def linear_split_programs(x2, weight, bias, y, cfg, interpreted: bool) -> None:
    """y [M, N] = x2 @ weight^T (+ bias) with K in two parts computed by separate programs (see
    above); `linear_triton.linear_triton` has checked the inputs and chosen `cfg` (its GemmConfig,
    k_split == 2)."""
    m, k = x2.shape
    n = weight.shape[0]
    if cfg.k_split != 2:
        raise ValueError(f"split programs need k_split = 2, got {cfg}")
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    parts = torch.empty(2, m, n, dtype=torch.float32, device=x2.device)
    tickets = torch.zeros(tiles, dtype=torch.int32, device=x2.device)  # this launch's (see above)
    _linear_split_kernel[(2 * tiles,)](
        x2, weight, bias if bias is not None else y, y, parts, tickets,
        m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=(k // 2) % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_FP32=interpreted, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
