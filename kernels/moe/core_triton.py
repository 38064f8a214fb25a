"""The kernels and launch helpers of the Triton fused mixture-of-experts (`experts_triton.py`, the CUDA
path of `experts.py`, and its backward `experts_triton_bwd.py`, which both import this module): grouped GEMMs
and a slot-order combine.

Math: `experts.py`'s. Legend: T = tokens, H = hidden, E = experts, I = expert intermediate size, k = experts
per token, n = T * k entries (entry p = t * k + j), P = rows of the expert-grouped layout.

Layout (`align_triton.align`: three Triton launches, no host synchronisation). The entries are
grouped by (expert, p), as a stable sort of the ids would: a function of the ids alone. Each expert's run is padded
to whole BLOCK_M tiles: padded row r holds entry rows[r] (-1 = padding) and M tile i belongs to expert
tile_expert[i] (E past the last used tile). The capacity P = (cdiv(n, BLOCK_M) + min(E, n)) * BLOCK_M
bounds sum_e cdiv(n_e, BLOCK_M) * BLOCK_M for every routing, so grids depend on (T, k, E) only and
the launch can be captured in a CUDA graph.

Forward kernels:
1. `_gate_up_kernel` (`gate_up`), per tile (M tile of one expert, BLOCK_N columns of I): gate and up
   accumulators over K = H from x rows gathered by token; epilogue: both rounded to the model dtype (what `linear`
   stores as gu), then a = div_rn(g, 1 + exp(-g)) * u in fp32 (what `silu_and_mul` computes),
   rounded: act [P, I]. With STORE_GU (backward recompute) the rounded gu [P, 2I] is written too.
2. `_grouped_gemm_kernel` (`grouped_gemm`): y = act @ w_down[e]^T, fp32, each row stored at its
   entry: y [n, H].
3. `_combine_kernel` (`combine`), per token: out[t] = w_t0 * y_t0 + w_t1 * y_t1 + ... in slot order,
   fp32, one rounding. Compiled without FMA contraction, so each product is rounded to fp32 before its
   addition, as torch's `w * y` then `+` does.

Invariant: one REDUCTION per weight shape, the dense GEMM's (`gemm/linear_triton.py`). For an expert weight
of shape (N, K, dtype) the K step is `gemm.linear_triton.gemm_config(N, K, dtype).block_k`, the dense
`linear`'s own, and every tile walks K from 0 upwards, one tl.dot per step on the fp32 accumulator,
the K tail masked to zeros (as `_linear_kernel`). Which tile, and which row of it, a token lands in
(that depends on the batch) only decides who computes its row, never how; padding rows read as
zeros and are never combined. So the result is bitwise `linear(x_e, w_gate_up[e])` ->
`silu_and_mul` -> `linear(a_e, w_down[e], out_dtype=fp32)` of the Triton dense ops, expert by expert,
then torch's slot-order combine: the tests check exactly that. On CUDA the tiles keep BLOCK_M >= 64
(wgmma warpgroup tiles, as every dense tile): a smaller tile would compile to another MMA instruction,
whose internal order nothing promises to equal the dense kernel's.

Backward: `experts_triton_bwd.py` (deterministic, no atomics; gu and act recomputed by `_gate_up_kernel`
with the forward's configuration, so they are the forward's bits).

Interpreter note: no @triton.jit library helpers (tl.cdiv, tl.zeros, tl.sum): they stay compiled-only
when Triton was imported before TRITON_INTERPRET was set (the tests). DOT_FP32 (interpreter only):
its tl.dot reads bf16 as raw bits; bf16 -> fp32 is exact.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from ..gemm.linear_triton import gemm_config
from ..gemm.tiles_triton import tile_coords
from .align_triton import Layout


@triton.jit
def tile_rows(tile, ROWS, top_k, BLOCK_M: tl.constexpr):
    """(offs_m, entry, row_ok, token) of M tile `tile` of the expert-grouped layout: its padded rows,
    the entry each holds (-1 = padding), which are real, and each entry's token (0 for padding)."""
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    entry = tl.load(ROWS + offs_m)
    row_ok = entry >= 0
    token = (tl.where(row_ok, entry, 0) // top_k).to(tl.int64)
    return offs_m, entry, row_ok, token


@triton.jit(do_not_specialize=["num_tiles_m"])
def _gate_up_kernel(
    X,  # [T, H], unit stride in H
    W,  # [E, 2I, H] contiguous: rows 0..I-1 gate, I..2I-1 up
    ROWS,  # int32 [P]: entry of each padded row, -1 = padding
    TILE_EXPERT,  # int32 [P / BLOCK_M]: expert of each M tile, E = unused
    ACT,  # [P, I] model dtype
    GU,  # [P, 2I] model dtype (written with STORE_GU only)
    num_tiles_m,  # P / BLOCK_M: follows T, so not specialized
    n_experts,
    inter,
    hidden,
    top_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_am,
    stride_gm,
    STORE_GU: tl.constexpr,  # backward recompute: also write the rounded gu
    EVEN_K: tl.constexpr,  # H % BLOCK_K == 0 (a function of the weight shape)
    BLOCK_M: tl.constexpr,  # rows per tile = the layout's padding unit (who computes, not how)
    BLOCK_N: tl.constexpr,  # columns of I per tile (gate and up each)
    BLOCK_K: tl.constexpr,  # K step: the dense linear's for [2I, H], fixes the accumulation order
    GROUP_M: tl.constexpr,  # tile order only
    DOT_FP32: tl.constexpr,  # interpreter only
):
    num_pid_n = (inter + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = tile_coords(tl.program_id(0), num_tiles_m, num_pid_n, GROUP_M)
    expert = tl.load(TILE_EXPERT + pid_m)
    if expert < n_experts:
        # 1. Rows: the tokens of this tile's entries (padding reads zeros); columns past I read column 0.
        offs_m, entry, row_ok, token = tile_rows(pid_m, ROWS, top_k, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.where(offs_n < inter, offs_n, 0).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = X + token[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        wg_ptrs = W + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + offs_k[:, None]  # gate^T
        wu_ptrs = wg_ptrs + inter * stride_wn  # up^T
        # 2. K loop from 0, in order, one dot shape per accumulator (as the dense kernel).
        acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for ki in range((hidden + BLOCK_K - 1) // BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                wg = tl.load(wg_ptrs)
                wu = tl.load(wu_ptrs)
            else:
                k_left = hidden - ki * BLOCK_K
                x = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                wg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                wu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if DOT_FP32:
                x = x.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g = tl.dot(x, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(x, wu, acc_u, input_precision="ieee")
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K
        # 3. Round gu once (as linear stores it), SiLU-and-mul in fp32 (as silu_and_mul), round, store.
        g = acc_g.to(ACT.dtype.element_ty)
        u = acc_u.to(ACT.dtype.element_ty)
        col_ok = (offs_n < inter)[None, :]
        rows64 = offs_m.to(tl.int64)[:, None]
        if STORE_GU:
            tl.store(GU + rows64 * stride_gm + offs_n[None, :], g, mask=col_ok)
            tl.store(GU + rows64 * stride_gm + inter + offs_n[None, :], u, mask=col_ok)
        g32 = g.to(tl.float32)
        a = tl.math.div_rn(g32, 1.0 + tl.exp(-g32)) * u.to(tl.float32)
        tl.store(ACT + rows64 * stride_am + offs_n[None, :], a.to(ACT.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["num_tiles_m"])
def _grouped_gemm_kernel(
    A,  # rows of K elements, unit stride in K
    B,  # per-expert [N, K] views: element (e, n, k) at e * stride_be + n * stride_bn + k * stride_bk
    OUT,  # [P, N] (OUT_BY_ENTRY False) or [n, N] (OUT_BY_ENTRY True)
    ROWS,  # int32 [P]: entry of each padded row, -1 = padding
    TILE_EXPERT,  # int32 [P / BLOCK_M]
    num_tiles_m,  # follows T, so not specialized
    n_experts,
    N,
    K,
    top_k,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_om,
    A_BY_TOKEN: tl.constexpr,  # A row = the entry's token (x, dOut) instead of the padded row
    OUT_BY_ENTRY: tl.constexpr,  # store each row at its entry instead of its padded row
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    BLOCK_M: tl.constexpr,  # the layout's padding unit
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # K step (forward: the dense linear's, fixes the accumulation order)
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only
):
    """OUT[row] = A[row'] @ B[e]^T over one M tile of expert e, the dense kernel's K loop."""
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = tile_coords(tl.program_id(0), num_tiles_m, num_pid_n, GROUP_M)
    expert = tl.load(TILE_EXPERT + pid_m)
    if expert < n_experts:
        offs_m, entry, row_ok, token = tile_rows(pid_m, ROWS, top_k, BLOCK_M)
        if A_BY_TOKEN:
            a_rows = token
        else:
            a_rows = offs_m.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < N)[None, :]
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        # Columns past N masked (not clamped to a valid column): the backward reads B with unit stride
        # in N, and a clamp would hide that contiguity from the compiler (scalar loads, ~10x slower).
        b_ptrs = B + expert.to(tl.int64) * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for ki in range((K + BLOCK_K - 1) // BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok, other=0.0)
            else:
                k_left = K - ki * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=n_ok & (offs_k[:, None] < k_left), other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        if OUT_BY_ENTRY:
            out_rows = tl.where(row_ok, entry, 0).to(tl.int64)
            mask = row_ok[:, None] & n_ok
        else:
            out_rows = offs_m.to(tl.int64)
            mask = n_ok
        tl.store(
            OUT + out_rows[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=mask
        )


@triton.jit
def _combine_kernel(
    Y,  # [n, H] fp32, entry p = t * TOP_K + j
    WEIGHTS,  # fp32 [n] (HAS_WEIGHTS) or a dummy
    IDS,  # int [n]
    OUT,  # [T, H]
    hidden,
    n_experts,
    stride_y,
    stride_o,
    TOP_K: tl.constexpr,  # experts per token: the slot loop is unrolled in slot order
    HAS_WEIGHTS: tl.constexpr,  # forward: w * y; backward dX: plain sum
    BLOCK_H: tl.constexpr,  # columns per program (elementwise over H: any block gives the same bits)
):
    """out[t] = ((v_0 + v_1) + v_2) + ..., v_j = w_tj * y_tj; NaN where the id lies outside [0, E)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    p = t * TOP_K
    acc = tl.load(Y + p * stride_y + offs, mask=mask, other=0.0)
    if HAS_WEIGHTS:
        acc = tl.load(WEIGHTS + p) * acc
    e = tl.load(IDS + p)
    acc = tl.where((e >= 0) & (e < n_experts), acc, float("nan"))
    for j in tl.static_range(1, TOP_K):
        v = tl.load(Y + (p + j) * stride_y + offs, mask=mask, other=0.0)
        if HAS_WEIGHTS:
            v = tl.load(WEIGHTS + p + j) * v
        e = tl.load(IDS + p + j)
        acc = acc + tl.where((e >= 0) & (e < n_experts), v, float("nan"))
    tl.store(OUT + t * stride_o + offs, acc.to(OUT.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# configurations and layout
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """One grouped-GEMM launch configuration."""

    block_m: int  # rows per tile, the layout's padding unit (speed only; >= 64 on CUDA, see above)
    block_n: int
    block_k: int  # K step: in the forward the dense linear's for the weight shape, part of the bits
    group_m: int  # row tiles per L2 group (order only)
    num_warps: int
    num_stages: int  # software pipelining depth (speed only)


def forward_configs(hidden: int, inter: int, dtype: torch.dtype) -> tuple[MoeConfig, MoeConfig]:
    """(gate_up, down) configurations. Their BLOCK_K is `gemm_config(N, K, dtype).block_k` of the expert
    weight shape ([2I, H] and [H, I]): the dense linear's reduction order. Their BLOCK_M is shared
    (one layout serves both GEMMs). Not yet tuned on a GPU: tiles follow the dense default rules."""
    k_gate_up = gemm_config(2 * inter, hidden, dtype).block_k
    k_down = gemm_config(hidden, inter, dtype).block_k
    if dtype == torch.float32:  # fp32 dots run on FMA units: small tiles
        return MoeConfig(64, 32, k_gate_up, 8, 4, 3), MoeConfig(64, 64, k_down, 8, 4, 3)
    return MoeConfig(64, 64, k_gate_up, 8, 4, 4), MoeConfig(64, 128, k_down, 8, 4, 4)


def interpreted() -> bool:
    return type(_combine_kernel).__name__ == "InterpretedFunction"


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def gate_up(x, w_gate_up, layout: Layout, cfg: MoeConfig, top_k: int, store_gu: bool):
    """(act [P, I], gu [P, 2I] or None) in the model dtype."""
    n_experts, two_inter, hidden = w_gate_up.shape
    inter = two_inter // 2
    capacity = layout.rows.shape[0]
    act = torch.empty(capacity, inter, dtype=x.dtype, device=x.device)  # [P, I]
    gu = torch.empty(capacity, two_inter, dtype=x.dtype, device=x.device) if store_gu else act  # [P, 2I]
    num_tiles_m = capacity // layout.block_m
    if num_tiles_m == 0:
        return act, (gu if store_gu else None)
    grid = (num_tiles_m * triton.cdiv(inter, cfg.block_n),)
    _gate_up_kernel[grid](
        x, w_gate_up, layout.rows, layout.tile_expert, act, gu,
        num_tiles_m, n_experts, inter, hidden, top_k,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), gu.stride(0),
        STORE_GU=store_gu, EVEN_K=hidden % cfg.block_k == 0, BLOCK_M=layout.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, DOT_FP32=interpreted(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return act, (gu if store_gu else None)


def grouped_gemm(
    a, b, strides_b, n_cols, k, out, layout: Layout, cfg: MoeConfig, a_by_token, out_by_entry, top_k
):
    """out rows = a rows @ b[e]^T per M tile (see `_grouped_gemm_kernel`); b's [N, K] view by strides_b."""
    capacity = layout.rows.shape[0]
    num_tiles_m = capacity // layout.block_m
    if num_tiles_m == 0:
        return out
    grid = (num_tiles_m * triton.cdiv(n_cols, cfg.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, out, layout.rows, layout.tile_expert,
        num_tiles_m, layout.tile_start.shape[0] - 1, n_cols, k, top_k,
        a.stride(0), *strides_b, out.stride(0),
        A_BY_TOKEN=a_by_token, OUT_BY_ENTRY=out_by_entry, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=layout.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_FP32=interpreted(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def combine(y, weights, topk_ids, n_experts, dtype):
    """[T, H] in dtype: each token's k rows of y [n, H] (times weights [n], if given) in slot order."""
    n_tokens, top_k = topk_ids.shape
    hidden = y.shape[1]
    out = torch.empty(n_tokens, hidden, dtype=dtype, device=y.device)
    if n_tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(n_tokens, triton.cdiv(hidden, block_h))](
        y, weights if weights is not None else y, topk_ids, out, hidden, n_experts, y.stride(0), out.stride(0),
        TOP_K=top_k, HAS_WEIGHTS=weights is not None, BLOCK_H=block_h, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out
