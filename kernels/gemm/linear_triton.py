"""Batch-invariant linear layer on CUDA (Triton): y = x @ W^T + b.

Math: for each row m and output column n, with K cut into S = k_split equal parts (S = 1 or 2, one
per weight shape; S = 1 unless `_TUNED` says otherwise),
    p_s[m, n] = sum over k in part s of x[m, k] * W[n, k]   (fp32 accumulator, tl.dot)
    acc[m, n] = p_0[m, n] (+ p_1[m, n])                      (one fp32 addition when S = 2)
    y[m, n]   = (acc[m, n] + fp32(b[n])).to(out_dtype)       (bias added once, after the K loop)

Invariant (DESIGN rule 2): the bits of output row m depend only on x[m] and W.
- One REDUCTION per weight shape: for each (N, K, dtype) the K step BLOCK_K and the split S are
  fixed, and every part is walked from its first column upwards in steps of BLOCK_K, in order, with
  one `tl.dot(x_tile, w_tile, acc)` per step (on Hopper: wgmma instructions of k = 16, chained on
  the fp32 accumulator in K order), the tail masked with zeros (adding 0.0 changes no bit)
  (`tiles_triton.dot_k_range`). The split's boundaries are a function of K alone, never of M
  or the load; whether one program sums both parts (two accumulators) or two programs each compute
  one (`split_triton`, decode sizes) changes no bit: p_0 + p_1 == p_1 + p_0. No autotuning.
- The TILE shape (BLOCK_M, BLOCK_N, warps, stages, persistent programs) and how tiles reach shared
  memory (pointer loads, or TMA descriptors with optional warp specialization: `_linear_kernel_tma`)
  decide only which program computes which output elements, never how one is computed: an
  element's products and their accumulation order are the same in a 64x128 tile of 4 warps as in a
  128x256 tile of 8 warps. So the tile may follow M: a tuned shape has one tile per M bucket (small
  tiles fill the SMs at decode batch sizes, large ones reuse loads at prefill sizes), all with the
  SAME BLOCK_K and S; `_TUNED` refuses buckets that differ in either, and the CUDA tests check
  `torch.equal` between every bucket's tile, across bucket boundaries, and TMA against pointer loads.
- Rows past M read as zeros and are never stored; a row's value never depends on its neighbours.
- Persistent grid: min(tiles, programs_per_sm * SMs) programs loop over tiles in grouped order
  (L2 reuse); a tile's value is computed from scratch by whichever program takes it, so neither
  the SM count nor the tile order can change it.
fp32 inputs use true fp32 products ("ieee", no TF32), like torch's default matmul.

Launch configurations live in one table, `_TUNED`, keyed by (dtype, N, K): tiles by M bucket;
shapes it lacks get `_default_config` (one tile for every M). `_TUNED_ON` replaces some buckets'
tiles on a named CUDA card (the H200), never a shape's k_split or bounds; a card's tile may take
another BLOCK_K, which on the GPU groups the same chain of k = 16 MMAs (see `_TUNED_ON`). Changing
an entry's BLOCK_K changes the bits for that weight shape on both sides (rollout and trainer) alike,
so the contract holds, but recorded log-probs will differ.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ..checks import SUPPORTED_DTYPES, check_dim, check_dtype, check_last_dim_contiguous, check_same_device
from . import linear_cute
from .split_triton import linear_split_programs
from .tiles_triton import dot_k_range, dot_k_range_tma, tile_coords


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,  # [M, K], unit stride in K
    w_ptr,  # [N, K], unit stride in K
    b_ptr,  # [N] or a dummy when HAS_BIAS is False
    y_ptr,  # [M, N], contiguous
    M,  # not specialized: M must not select a different compiled kernel
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,  # a different kernel with and without bias, never per call shape
    EVEN_K: tl.constexpr,  # (K / K_SPLIT) % BLOCK_K == 0 (a function of K alone): no tail mask
    BLOCK_M: tl.constexpr,  # tile shape: the dot shape, fixed per weight shape (N, K)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # K step: fixes the accumulation order
    K_SPLIT: tl.constexpr,  # 1 or 2 equal K parts summed in fp32 (part of the order, like BLOCK_K)
    GROUP_M: tl.constexpr,  # tile order only (L2 reuse); does not change any value
    NUM_PROGRAMS: tl.constexpr,  # persistent programs (per device): who computes a tile, not its value
    DOT_FP32: tl.constexpr,  # interpreter only: its tl.dot multiplies bf16 raw bits; bf16->fp32 is exact
):
    start_pid = tl.program_id(0)
    # Plain ceil-divisions and tl.full, not tl.cdiv / tl.zeros: those are @triton.jit helpers of
    # Triton's own, compiled-only if Triton was imported before TRITON_INTERPRET was set (tests).
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_pid_m * num_pid_n
    k_part = K // K_SPLIT  # columns per part
    offs_k = tl.arange(0, BLOCK_K)
    # The epilogue recomputes its tile's coordinates from its own counter (flattened-loop idiom).
    tile_id_out = start_pid - NUM_PROGRAMS

    for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=True):
        # 1. Tile coordinates. Rows past M are masked (zeros, no traffic: clamping them all to one
        #    row makes every SM hammer one L2 line when M is small); columns past N read column 0.
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_m < M
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] = W^T tile

        # 2. Each K part from its first column, in order, one dot shape; the masked tail contributes
        #    exact zeros. Parts (K_SPLIT = 2) are added to a total that starts at zero: 0 + p_0 is p_0
        #    (a sum from +0 is never -0), so the total is p_0 + p_1. One K loop in the code: a second
        #    loop would take shared memory for its own pipeline.
        if K_SPLIT == 1:
            acc = dot_k_range(x_ptrs, w_ptrs, row_ok, k_part, EVEN_K, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for part in range(K_SPLIT):
                acc += dot_k_range(
                    x_ptrs + part * k_part, w_ptrs + part * k_part, row_ok, k_part,
                    EVEN_K, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip

        # 3. Bias once in fp32, round once to the output dtype, store the valid part.
        tile_id_out += NUM_PROGRAMS
        pid_m, pid_n = tile_coords(tile_id_out, num_pid_m, num_pid_n, GROUP_M)
        offs_ym = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_yn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_yn, mask=offs_yn < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_ym.to(tl.int64)[:, None] * stride_ym + offs_yn[None, :]
        y_mask = (offs_ym[:, None] < M) & (offs_yn[None, :] < N)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


# TMA variant (Hopper): the same math and reduction, only how tiles reach shared memory differs. The
# descriptors zero-fill rows past M, columns past N and the K tail (exact zeros, as the masked loads
# above), and the store drops what lies past M or N; so an element's bits equal the pointer kernel's
# for the same BLOCK_K whatever the tile. The tests compare the two.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel_tma(
    x_desc,  # [M, K] descriptor, block [BLOCK_M, BLOCK_K]
    w_desc,  # [N, K] descriptor, block [BLOCK_N, BLOCK_K]
    y_desc,  # [M, N] descriptor, block [BLOCK_M, BLOCK_N]
    b_ptr,  # [N] or a dummy when HAS_BIAS is False
    M,  # not specialized: M must not select a different compiled kernel
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # K step: fixes the accumulation order
    K_SPLIT: tl.constexpr,  # 1 or 2 equal K parts summed in fp32 (as the pointer kernel)
    GROUP_M: tl.constexpr,  # tile order only (L2 reuse)
    NUM_PROGRAMS: tl.constexpr,  # persistent programs: who computes a tile, not its value
    DOT_FP32: tl.constexpr,  # interpreter only (see linear_triton.py)
    WARP_SPECIALIZE: tl.constexpr,  # producer/consumer warps (speed only)
):
    start_pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_pid_m * num_pid_n
    k_tiles = (K // K_SPLIT + BLOCK_K - 1) // BLOCK_K  # per part
    tile_id_out = start_pid - NUM_PROGRAMS
    for tile_id in tl.range(
        start_pid, num_tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        if K_SPLIT == 1:
            acc = dot_k_range_tma(
                x_desc, w_desc, row0, col0, 0, k_tiles, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K
            )
        else:  # K_SPLIT > 1 only where K / K_SPLIT is a multiple of BLOCK_K; a total from zero (above)
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for part in range(K_SPLIT):
                acc += dot_k_range_tma(
                    x_desc, w_desc, row0, col0, part * k_tiles, k_tiles, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K
                )
        tile_id_out += NUM_PROGRAMS
        pid_m, pid_n = tile_coords(tile_id_out, num_pid_m, num_pid_n, GROUP_M)
        if HAS_BIAS:
            offs_yn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            bias = tl.load(b_ptr + offs_yn, mask=offs_yn < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch configuration; fixed per (dtype, N, K), whatever M is."""

    block_m: int
    block_n: int
    block_k: int  # K step: part of the reduction order, so part of the bits
    group_m: int  # row-tiles per L2 group (order only)
    num_warps: int
    num_stages: int  # software pipelining depth (speed only)
    programs_per_sm: int = 1  # persistent programs per SM (speed only): 2 hides small tiles' latency
    tma: bool = False  # tensor-descriptor loads/stores (_linear_kernel_tma; speed only, same bits)
    warp_specialize: bool = False  # TMA kernel only: producer/consumer warps (speed only)
    # K cut into k_split equal parts, each reduced from its first column as above, summed in fp32
    # (p0 + p1): part of the reduction order like block_k, so one per weight shape. Where N gives few
    # column tiles, the parts fill the SMs at decode sizes: split_programs computes them in separate
    # programs (split_triton.py; speed only, the same bits as one program computing both).
    k_split: int = 1
    split_programs: bool = False


_BF16 = torch.bfloat16
C = GemmConfig
T = True  # shorthand in the table: tma, warp_specialize


def S(cfg: GemmConfig, programs: bool = False) -> GemmConfig:
    """`cfg` with K in two parts (k_split = 2), computed by separate programs if `programs`."""
    return dataclasses.replace(cfg, k_split=2, split_programs=programs)


# Tuned entries, keyed by (dtype, N, K) of the weight: the fused q/k/v and gate/up, o, down and
# lm_head of Qwen3-1.7B and Qwen3-8B. Each is a list of M buckets ((largest M, tile), ..., (None,
# tile)) whose tiles all share ONE BLOCK_K (the reduction order). Picked on one H100 SXM (132 SMs;
# Triton 3.6, torch 2.11) with benchmarks/sweep_gemm.py (CUDA-graph timing against cuBLAS
# F.linear): the comment gives the sweep's speed vs cuBLAS in each bucket (M = 1 16 32 64 | 128 | 256 |
# 512 | 2048 8192, per merged bucket). The buckets up to M = 128 (decode) are 16- to 64-wide column
# tiles, pointer loads, 1-4 programs per SM (`sweep_gemm.py --narrow`, 2026-11-24): a narrow weight
# then puts a slice of W on every SM. They were re-picked with the weights read from HBM, as the
# model reads them (`sweep_gemm.py --narrow --tma --cold --ms 1,16,64,128` and `--split --cold`,
# 2026-11-25; "cold" in the comments: M = 1 16 64 | 128), and for the 1.7B qkv and o also the M = 192-512
# buckets (`--small --tma --cold --ms 128,192,256,384,512`: M = 192 256 | 384 512); the other buckets
# were timed L2-hot ("hot"). Cold, one deep pipeline per SM (8 stages, 1 program) wins where one row
# tile covers M.
_TUNED: dict[tuple[torch.dtype, int, int], tuple[tuple[int | None, GemmConfig], ...]] = {
    # Qwen3-1.7B: hidden 2048, intermediate 6144, q 2048, k/v 1024, vocab 151936
    (_BF16, 4096, 2048): (  # qkv: cold .91 .91 .92 | .81 | .77 .88 | .88 1.01 ; hot .93 .92
        (64, C(64, 32, 64, 8, 4, 8, 1)),
        (128, C(64, 32, 64, 8, 4, 6, 3)),
        (256, C(64, 128, 64, 8, 4, 5, 1, T, T)),
        (512, C(128, 128, 64, 8, 4, 5, 1, T, T)),
        (None, C(128, 128, 64, 8, 4, 4, 1, T, T)),
    ),
    (_BF16, 2048, 2048): (  # o: cold .83 .85 .85 | .78 | .84 .71 | .72 .93 ; hot .98 .99
        (64, C(64, 16, 64, 8, 4, 8, 1)),
        (128, C(64, 32, 64, 8, 4, 8, 1)),
        (256, C(64, 32, 64, 8, 4, 6, 2, T)),
        (512, C(64, 128, 64, 8, 4, 5, 1, T, T)),
        (None, C(128, 256, 64, 8, 8, 3, 1, T)),
    ),
    (_BF16, 12288, 2048): (  # gate_up: .95 .96 1.01 .96 | .96 | .85 | 1.06 | 1.02 .97
        (64, C(64, 32, 64, 8, 4, 4, 3)),
        (128, C(64, 64, 64, 8, 4, 4, 3)),
        (256, C(128, 256, 64, 8, 8, 3, 1, T, T)),
        (512, C(128, 128, 64, 8, 4, 5, 1, T, T)),
        (None, C(128, 256, 64, 8, 8, 3, 1, T, T)),
    ),
    # down: K in two parts (`sweep_gemm.py --split`, 2026-11-24: one K part per program at decode
    # sizes; before the split .67 .60 .6 1.03 | .85 | 1.1 | 1.02 | .86 .83)
    (_BF16, 2048, 6144): (  # down: cold .98 .97 1.0 1.04 | .87 | .75 ; hot | 1.04 | .82 .90
        (64, S(C(64, 32, 128, 8, 4, 6, 1), programs=True)),
        (128, S(C(64, 64, 128, 8, 4, 4, 1), programs=True)),
        (256, S(C(64, 64, 128, 8, 4, 4, 1, T, T))),
        (512, S(C(64, 128, 128, 8, 4, 4, 1, T))),
        (None, S(C(128, 128, 128, 8, 8, 3, 1, T))),
    ),
    (_BF16, 151936, 2048): (  # lm_head (fp32 out): 1.02 | .98 | .88 | .93 | .93 .86
        (64, C(64, 128, 64, 8, 4, 5, 1, T, T)),
        (128, C(128, 128, 64, 8, 4, 5, 1, T)),
        (512, C(128, 128, 64, 8, 4, 5, 1, T, T)),
        (None, C(128, 128, 64, 8, 4, 4, 1, T, T)),
    ),
    # Qwen3-8B: hidden 4096, intermediate 12288, q 4096, k/v 1024, vocab 151936 (qkv, o, gate_up, down,
    # lm_head); 2026-11-21 `--small --tma` and `--tma` sweeps of the 8B shapes
    (_BF16, 6144, 4096): (  # 0.92 0.94 0.96 0.91 | 0.78 | 0.88 | 0.85 | 0.92
        (64, C(64, 32, 64, 8, 4, 6, 3)),
        (128, C(64, 64, 64, 8, 4, 4, 3)),
        (256, C(128, 128, 64, 8, 4, 5, 1, T)),
        (512, C(128, 256, 64, 8, 8, 3, 1, T)),
        (None, C(128, 128, 64, 8, 4, 4, 1, T)),
    ),
    (_BF16, 4096, 4096): (  # cold 1.05 1.05 0.91 | 0.78 ; hot | 0.88 | 1.08 | 1.01
        (64, C(64, 32, 64, 8, 4, 8, 1)),
        (128, C(64, 32, 64, 8, 4, 6, 3)),
        (256, C(64, 128, 64, 8, 4, 5, 1, T, T)),
        (512, C(128, 128, 64, 8, 8, 5, 1, T)),
        (None, C(128, 256, 64, 8, 8, 3, 1, T)),
    ),
    (_BF16, 24576, 4096): (  # 0.99 0.99 1.00 1.00 | 0.97 | 0.94 | 0.96 | 1.03
        (64, C(64, 64, 64, 8, 4, 3, 4)),
        (128, C(64, 64, 64, 8, 4, 4, 3)),
        (256, C(128, 128, 64, 8, 4, 5, 1, T, T)),
        (512, C(128, 256, 64, 8, 8, 3, 1, T, T)),
        (None, C(128, 256, 64, 8, 8, 3, 1, T)),
    ),
    (_BF16, 4096, 12288): (  # cold 0.96 0.96 0.99 | 0.77 ; hot | 0.97 | 1.02 | 1.01
        (64, C(64, 32, 64, 8, 4, 8, 1)),
        (128, C(64, 32, 64, 8, 4, 6, 3, T, T)),
        (256, C(64, 128, 64, 8, 4, 5, 1, T)),
        (512, C(128, 128, 64, 8, 4, 5, 1, T, T)),
        (None, C(128, 256, 64, 8, 8, 3, 1, T, T)),
    ),
    (_BF16, 151936, 4096): (  # 1.04 | 0.99 | 0.97 | 1.04 | 0.93
        (64, C(64, 128, 64, 8, 4, 5, 1, T)),
        (128, C(128, 128, 64, 8, 8, 5, 1, T, T)),
        (256, C(128, 128, 64, 8, 4, 5, 1, T, T)),
        (512, C(128, 128, 64, 8, 4, 5, 1, T)),
        (None, C(128, 128, 64, 8, 4, 4, 1, T)),
    ),
}


# Tiles re-picked on other cards: {device-name fragment: {(dtype, N, K): {bucket bound: tile}}}. Speed
# only: on a CUDA device whose name contains the fragment, a tile here replaces `_TUNED`'s tile of that
# bucket; it keeps the shape's k_split and the buckets' bounds (`check_tiles_on`), so every card reduces
# every element in the same order and the trainer's bits do not depend on the card. It may take another
# BLOCK_K (bf16 only): on the GPU a bf16 dot over BLOCK_K columns is BLOCK_K / 16 tensor-core MMAs of
# k = 16 chained on the accumulator in K order, so BLOCK_K only groups one chain (CUDA test
# `test_block_k_does_not_change_bits_cuda`: BLOCK_K 16-256, pointer and TMA, 352 of 352 configurations
# bitwise equal on an H200); `_TUNED`'s single BLOCK_K is what the interpreter (one numpy sum per
# BLOCK_K) needs, and these tables never reach it.
_TUNED_ON: dict[str, dict[tuple[torch.dtype, int, int], dict[int | None, GemmConfig]]] = {
    # `sweep_gemm.py --shapes qwen3-8b --narrow --cold --ms 1,16,64,128` on an H200 (2026-11-28): the
    # H100's decode tiles keep too few weight bytes in flight for its 4.8 TB/s; cold M = 1 16 64 | 128
    "H200": {
        (_BF16, 6144, 4096): {  # qkv .96 .94 .95 | .75 (the H100's tiles here: .72 .75 .83 | .68)
            64: C(64, 64, 64, 8, 4, 8, 1),
            # `gemm-8b` (--any-k) on an H200 (2026-11-28): cold M = 128 .83 (this table's BLOCK_K 64
            # tile .74)
            128: C(64, 128, 128, 8, 4, 4, 1),
        },
        (_BF16, 24576, 4096): {  # gate_up .97 .97 .96 (.93 .94 .96)
            64: C(64, 64, 64, 8, 4, 4, 3),
            128: C(64, 128, 128, 8, 4, 4, 1),  # `gemm-8b` (--any-k): cold M = 128 .87 (.80)
        },
        # o and down: BLOCK_K 128 tiles (twice the weight bytes per K step), cold M = 16 | 128 against
        # the BLOCK_K 64 tiles' (this table's first pick): o 1.07 | .94 (.91 | .86), down .89 | .89 (.72 | .82)
        (_BF16, 4096, 4096): {64: C(64, 32, 128, 8, 4, 6, 1), 128: C(64, 64, 128, 8, 4, 6, 1)},
        (_BF16, 4096, 12288): {64: C(64, 32, 128, 8, 4, 8, 1), 128: C(64, 64, 128, 8, 4, 6, 1)},
    },
}


def check_tuned(table: dict) -> None:
    """Refuse a table whose buckets could change a shape's reduction with M (see the docstring)."""
    for key, buckets in table.items():
        if len({(cfg.block_k, cfg.k_split) for _, cfg in buckets}) != 1:  # the reduction order: one per shape
            raise AssertionError(f"_TUNED{key}: the tiles of one weight shape must share block_k and k_split")
        cfg = buckets[0][1]
        if cfg.k_split not in (1, 2) or key[2] % (cfg.k_split * cfg.block_k):
            raise AssertionError(f"_TUNED{key}: k_split 1 or 2, each part a whole number of BLOCK_K steps")
        if buckets[-1][0] is not None or any(b is None for b, _ in buckets[:-1]):
            raise AssertionError(f"_TUNED{key}: buckets rise to a last one without bound (None)")
        if buckets[-1][1].split_programs:  # the split kernel's tile counters are bounded
            raise AssertionError(f"_TUNED{key}: split_programs only in buckets with a largest M")
        if any(c.split_programs and c.k_split != 2 for _, c in buckets):
            raise AssertionError(f"_TUNED{key}: split_programs needs k_split = 2")


def check_tiles_on(table: dict, tuned: dict) -> None:
    """Refuse a device tile that is not a speed-only replacement of a `tuned` bucket's tile."""
    for device, tiles in table.items():
        for key, by_bound in tiles.items():
            if key not in tuned:
                raise AssertionError(f"_TUNED_ON[{device!r}]{key}: not a _TUNED shape")
            base = dict(tuned[key])
            for bound, cfg in by_bound.items():
                if bound not in base:
                    raise AssertionError(f"_TUNED_ON[{device!r}]{key}: {bound} is not one of the shape's bounds")
                if cfg.k_split != base[bound].k_split:
                    raise AssertionError(f"_TUNED_ON[{device!r}]{key}: k_split must be _TUNED's")
                if cfg.block_k != base[bound].block_k and key[0] != torch.bfloat16:
                    raise AssertionError(f"_TUNED_ON[{device!r}]{key}: another BLOCK_K only for bf16 (see above)")
                if cfg.k_split > 1 and key[2] % (cfg.k_split * cfg.block_k):
                    raise AssertionError(f"_TUNED_ON[{device!r}]{key}: each K part a whole number of BLOCK_K steps")
                if cfg.split_programs and bound is None:
                    raise AssertionError(f"_TUNED_ON[{device!r}]{key}: split_programs only in bounded buckets")


check_tuned(_TUNED)
check_tiles_on(_TUNED_ON, _TUNED)


def _default_config(n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """A rule of thumb from (N, K, dtype) only, after the tuned table: big tiles where N alone
    gives the SMs enough column tiles, narrower ones where it does not. Every choice fits the
    shared memory of an H100 with an fp32 output tile too."""
    if dtype == torch.float32:  # fp32 dots run on FMA units: small tiles, modest pipelining
        return GemmConfig(64, 64, 32, 8, 4, 3)
    if n >= 32768 or n * k >= 48 * 2**20:  # vocab-sized or wide MLP weights
        return GemmConfig(128, 128, 64, 8, 8, 4)
    if n <= 1024 or k >= 3 * n:  # few columns, long reductions
        return GemmConfig(64, 64, 128, 8, 4, 4)
    return GemmConfig(64, 128, 64, 8, 4, 4)


def gemm_config(n: int, k: int, dtype: torch.dtype, m: int = 1, device: torch.device | None = None) -> GemmConfig:
    """The launch configuration for x [M, K] times a weight [N, K] of `dtype` on `device`. The
    reduction is a function of (N, K, dtype) alone: k_split always, and BLOCK_K without a device (the
    interpreter's order); the tile follows M and, on a card with its own tiles, the card, whose tile
    may group the GPU's one chain of k = 16 MMAs in another BLOCK_K (see `_TUNED_ON`)."""
    buckets = _TUNED.get((dtype, n, k))
    if buckets is None:
        return _default_config(n, k, dtype)
    bound, cfg = next((bound, cfg) for bound, cfg in buckets if bound is None or m <= bound)
    if device is None:
        return cfg
    tile = _tiles_on(device).get((dtype, n, k), {}).get(bound, cfg)
    if tile.k_split != cfg.k_split:  # `_TUNED` changed after `check_tiles_on` ran (a patched table)
        raise ValueError(f"the card's tile {tile} for {(dtype, n, k)} splits K unlike _TUNED's {cfg}; fix _TUNED_ON")
    return tile


def tiles_for_device_name(name: str) -> dict:
    """The `_TUNED_ON` tiles of the card called `name` (empty: `_TUNED`'s tiles)."""
    return next((tiles for fragment, tiles in _TUNED_ON.items() if fragment in name), {})


@functools.cache
def _tiles_on(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return tiles_for_device_name(torch.cuda.get_device_name(device))


def tile_rows(m: int, n: int, config_n: int | None) -> int:
    """The M whose bucket picks the tile for M rows of n columns. A column shard (n of a weight's
    config_n rows, tensor parallelism) takes the tile the whole weight takes for the same output area,
    m n / config_n rows, so a rank's shard fills the SMs as the whole weight does at TP = 1. Speed
    only: every bucket of a shape shares its reduction (BLOCK_K, k_split; `check_tuned`)."""
    if config_n is None or config_n <= n:
        return m
    return max(1, -(-m * n // config_n))


def warmup_sizes(n: int, k: int, dtype: torch.dtype, config_n: int | None = None, sms: int = 0) -> list[int]:
    """One M per tile bucket of the weight shape (config_n or N, K) for a launch over n columns, and
    one per CuTe-DSL configuration where an untuned shape may take that path on `sms` multiprocessors
    (linear_cute.py): running `linear` once at each compiles every kernel variant a batch can reach,
    so none compiles while serving (vLLM's warm-up and CUDA-graph capture reach only some sizes, and
    none with --enforce-eager)."""
    whole = n if config_n is None else config_n
    buckets = _TUNED.get((dtype, whole, k))
    rows = [1]
    if buckets is not None:
        bounds = [bound for bound, _ in buckets[:-1]]
        rows = [r * whole // n for r in bounds + [bounds[-1] + 1]]  # tile_rows of each is the bound
    if sms and (dtype, n, k) not in _TUNED and (buckets is None or buckets[0][1].k_split == 1):
        rows = sorted({*rows, *linear_cute.warmup_rows(n, sms)})
    return rows


_SMEM = 232448  # shared memory per block on an H100 (227 KB); Triton asks exactly the estimate below


def _smem_bytes(cfg: GemmConfig, in_size: int, out_size: int) -> int:
    """Pipelined x/W tiles plus the output tile staged for the store (an estimate)."""
    stage = (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * in_size
    return cfg.num_stages * stage + cfg.block_m * cfg.block_n * out_size


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter runs programs one after another; a few exercise the tile loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def _interpreted() -> bool:
    return type(_linear_kernel).__name__ == "InterpretedFunction"


def linear_triton(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config_n: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ weight [N, K]^T (+ bias [N]) in `out_dtype`, fp32 accumulation.

    x2 may be any 2-D view with unit stride in K (rows strided), likewise weight; bias contiguous.
    `config_n`: choose the configuration (so BLOCK_K, the reduction order) as for a weight of
    config_n rows: a column shard of a larger weight (tensor parallelism) then reduces every column
    exactly as the whole weight does. CUDA tensors (CPU tensors only under TRITON_INTERPRET=1).
    """
    check_dtype("x2", x2)
    check_dtype("weight", weight)
    if weight.dtype != x2.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x2 dtype {x2.dtype}")
    check_dim("x2", x2, 2, "[M, K]")
    check_dim("weight", weight, 2, "[N, K]")
    m, k = x2.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x2 {tuple(x2.shape)} and weight {tuple(weight.shape)} disagree on K")
    check_last_dim_contiguous("x2", x2)
    check_last_dim_contiguous("weight", weight)
    if bias is not None:
        check_dtype("bias", bias)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        check_last_dim_contiguous("bias", bias)
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use torch.bfloat16 or torch.float32")
    check_same_device(x2=x2, weight=weight, bias=bias)
    return launch_linear(x2, weight, bias, out_dtype, config_n)


def launch_linear(x2, weight, bias, out_dtype, config_n=None, out=None) -> torch.Tensor:
    """`linear_triton` without its checks, for callers that made them (`linear.linear`): the decode
    step's lm_head launches from Python every step, so its host time counts. On Hopper a shape with
    no tuned tiles runs quack's GEMM instead, with the same bits (linear_cute.py). `out`: a contiguous
    [M, N] `out_dtype` tensor to write into (checked by the caller)."""
    if x2.device.type != "cuda" and not _interpreted():
        raise ValueError(f"linear_triton needs CUDA tensors, got {x2.device} (set TRITON_INTERPRET=1 on CPU)")
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x2.device) if out is None else out  # [M, N]
    if m == 0 or n == 0:
        return y
    cfg = gemm_config(n if config_n is None else config_n, k, x2.dtype, tile_rows(m, n, config_n), x2.device)
    while (
        out_dtype == torch.float32 and cfg.num_stages > 2 and _smem_bytes(cfg, x2.element_size(), 4) > _SMEM
    ):
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)  # room for the fp32 tile (speed only)
    if k % cfg.k_split:
        raise ValueError(f"K = {k} does not split into {cfg.k_split} equal parts ({cfg})")
    untuned = cfg.k_split == 1 and (x2.dtype, n, k) not in _TUNED
    if untuned and linear_cute.takes(x2, weight, bias, y):  # the same bits (linear_cute.py)
        linear_cute.launch(x2, weight, bias, y, num_sms(x2.device))
        return y
    if cfg.split_programs:
        linear_split_programs(x2, weight, bias, y, cfg, _interpreted())
        return y
    num_programs = num_sms(x2.device) * cfg.programs_per_sm
    num_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if cfg.tma and all(linear_cute.aligned(t) for t in (x2, weight, y)):  # what TMA addresses
        _launch_tma(x2, weight, bias, y, cfg, min(num_tiles, num_programs), num_programs)
        return y
    _linear_kernel[(min(num_tiles, num_programs),)](
        x2,
        weight,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=(k // cfg.k_split) % cfg.block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        K_SPLIT=cfg.k_split,
        GROUP_M=cfg.group_m,
        NUM_PROGRAMS=num_programs,
        DOT_FP32=_interpreted(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y


def _launch_tma(x2, weight, bias, y, cfg: GemmConfig, grid: int, num_programs: int) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x2.shape
    n = weight.shape[0]
    _linear_kernel_tma[(grid,)](
        TensorDescriptor.from_tensor(x2, [cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
        TensorDescriptor.from_tensor(y, [cfg.block_m, cfg.block_n]),
        bias if bias is not None else y,
        m, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        K_SPLIT=cfg.k_split, GROUP_M=cfg.group_m, NUM_PROGRAMS=num_programs,
        DOT_FP32=_interpreted(), WARP_SPECIALIZE=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
