"""Backward of the Triton fused MoE (training only: correct and deterministic, no atomics; it need not be
batch-invariant, DESIGN rule 7). Legend and layout as in `experts_triton.py`.

Math, per entry (t, j) of expert e, with g = dOut[t] @ w_down[e] (fp32 [I]) and gu, a the forward's:
    d topk_weights[t, j] = g . a                     (= dOut[t] . y_tj)
    dGU   = SiLU-and-mul backward at gu of w_tj * g  (fp32, rounded to the model dtype for the GEMMs)
    dX[t] = sum over slots j in order of dGU_tj @ w_gate_up[e]   (fp32 rows, `_combine_kernel`, one rounding)
    dW_gate_up[e] = sum over e's rows of dGU^T x[t]             [2I, H], zero for an unrouted expert
    dW_down[e]    = sum over e's rows of (w_tj dOut[t])^T a     [H, I] (the scaled rows rounded to the
                                                                  model dtype before the dot)
Steps: 1. gu and act recomputed by `_gate_up_kernel` (the forward kept only its inputs); G by
`_grouped_gemm_kernel` reading w_down[e] as [I, H] through its strides. 2. d topk_weights and dGU by
torch ops (row sums and elementwise: deterministic). 3. dX rows by `_grouped_gemm_kernel` reading
w_gate_up[e] as [H, 2I], then the slot-order combine. 4./5. `_grouped_wgrad_kernel`: one program per
(expert, BLOCK_N x BLOCK_K tile of its weight gradient) walks that expert's padded rows tile by tile in
order, so every sum has one order for a given routing.
"""

import torch
import triton
import triton.language as tl

from ..gemm.activation import silu_and_mul_grad
from .align_triton import Layout
from .core_triton import MoeConfig, combine, gate_up, grouped_gemm, tile_rows


@triton.jit
def _grouped_wgrad_kernel(
    L,  # rows of N elements, unit stride in N
    R,  # rows of K elements, unit stride in K
    SCALE,  # fp32 [n] per-entry scale of L's rows (HAS_SCALE) or a dummy
    DW,  # [E, N, K] contiguous, weight dtype
    ROWS,  # int32 [P]
    TILE_START,  # int32 [E + 1]: first M tile of each expert; expert e owns tiles [start[e], start[e+1])
    N,
    K,
    top_k,
    stride_lm,
    stride_rm,
    L_BY_TOKEN: tl.constexpr,  # L row = the entry's token (dOut) instead of the padded row
    R_BY_TOKEN: tl.constexpr,  # R row = the entry's token (x) instead of the padded row
    HAS_SCALE: tl.constexpr,  # L rows times SCALE[entry] (the routing weight), rounded to L's dtype
    BLOCK_M: tl.constexpr,  # the layout's padding unit: the reduction step over an expert's rows
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only
):
    """DW[e] tile = sum over expert e's padded rows, in order, of L[row]^T R[row] (fp32, one rounding)."""
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    num_k = (K + BLOCK_K - 1) // BLOCK_K
    pid = tl.program_id(0)
    expert = pid // (num_n * num_k)
    pid_n = (pid % (num_n * num_k)) // num_k
    pid_k = pid % num_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for tile in range(tl.load(TILE_START + expert), tl.load(TILE_START + expert + 1)):
        offs_m, entry, row_ok, token = tile_rows(tile, ROWS, top_k, BLOCK_M)
        if L_BY_TOKEN:
            l_rows = token
        else:
            l_rows = offs_m.to(tl.int64)
        if R_BY_TOKEN:
            r_rows = token
        else:
            r_rows = offs_m.to(tl.int64)
        lt = tl.load(
            L + l_rows[:, None] * stride_lm + offs_n[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0
        )
        if HAS_SCALE:
            s = tl.load(SCALE + entry, mask=row_ok, other=0.0)
            lt = (lt.to(tl.float32) * s[:, None]).to(L.dtype.element_ty)
        r = tl.load(
            R + r_rows[:, None] * stride_rm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        if DOT_FP32:
            lt = lt.to(tl.float32)
            r = r.to(tl.float32)
        acc = tl.dot(tl.trans(lt), r, acc, input_precision="ieee")
    dw_ptrs = DW + expert.to(tl.int64) * N * K + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def backward_configs(dtype: torch.dtype, block_m: int) -> tuple[MoeConfig, MoeConfig]:
    """(grouped GEMM, weight gradient) configurations of the backward: speed only (its reductions need
    not follow the forward's). block_m is the forward layout's."""
    if dtype == torch.float32:
        return MoeConfig(block_m, 64, 32, 8, 4, 3), MoeConfig(block_m, 64, 64, 1, 4, 2)
    return MoeConfig(block_m, 128, 64, 8, 4, 3), MoeConfig(block_m, 128, 128, 1, 8, 3)


def moe_backward(grad_out, x, w_gate_up, w_down, topk_ids, topk_weights, layout: Layout, cfg_gate_up, needs):
    """[dX, dW_gate_up, dW_down, d topk_weights] of `experts_triton._forward`, given its layout and gate_up
    configuration (the recompute must be the forward's bits); None where `needs` (x, w_gate_up,
    w_down, topk_weights) is False."""
    need_x, need_wgu, need_wd, need_w = needs
    n_experts, two_inter, hidden = w_gate_up.shape
    inter = two_inter // 2
    n_tokens, top_k = topk_ids.shape
    cfg_mm, cfg_wgrad = backward_configs(x.dtype, layout.block_m)
    grad_out = grad_out.contiguous()
    w_flat = topk_weights.reshape(-1)
    capacity = layout.rows.shape[0]
    # 1. The forward's gu and act again; G = dOut[t] @ w_down[e] (w_down[e] read as [I, H]).
    act, gu = gate_up(x, w_gate_up, layout, cfg_gate_up, top_k, store_gu=True)  # [P, I], [P, 2I]
    g = torch.empty(capacity, inter, dtype=torch.float32, device=x.device)  # [P, I]
    strides = (w_down.stride(0), w_down.stride(2), w_down.stride(1))
    grouped_gemm(grad_out, w_down, strides, inter, hidden, g, layout, cfg_mm,
                 a_by_token=True, out_by_entry=False, top_k=top_k)  # fmt: skip
    # 2. Elementwise and per-row steps in torch (deterministic): d weights, dGU.
    pad = layout.rows < 0
    w_rows = torch.where(pad, 0.0, w_flat[layout.rows.clamp(min=0).long()])  # [P]
    grads = [None, None, None, None]
    if need_w:
        dw_rows = torch.cat([(g * act.float()).sum(-1), g.new_full((1,), float("nan"))])  # [P + 1]
        grads[3] = dw_rows[layout.entry_row].view(n_tokens, top_k)
    if need_x or need_wgu:
        dgu = silu_and_mul_grad(gu, g * w_rows[:, None]).to(x.dtype)  # [P, 2I]
        if need_x:  # 3. dX rows = dGU @ w_gate_up[e] (read as [H, 2I]), summed over slots in order
            dx_rows = torch.empty(n_tokens * top_k, hidden, dtype=torch.float32, device=x.device)  # [n, H]
            strides = (w_gate_up.stride(0), w_gate_up.stride(2), w_gate_up.stride(1))
            grouped_gemm(dgu, w_gate_up, strides, hidden, two_inter, dx_rows, layout, cfg_mm,
                         a_by_token=False, out_by_entry=True, top_k=top_k)  # fmt: skip
            grads[0] = combine(dx_rows, None, topk_ids, n_experts, x.dtype)
        if need_wgu:  # 4. dW_gate_up[e] = dGU^T x
            grads[1] = _wgrad(dgu, x, None, w_gate_up, layout, cfg_wgrad, False, True, top_k)
    if need_wd:  # 5. dW_down[e] = (w dOut)^T act
        grads[2] = _wgrad(grad_out, act, w_flat, w_down, layout, cfg_wgrad, True, False, top_k)
    return grads


def _wgrad(left, right, scale, weight, layout: Layout, cfg: MoeConfig, l_by_token, r_by_token, top_k):
    """dW [E, N, K] (weight's shape and dtype) = per expert, sum over its rows of left^T right."""
    n_experts, n_cols, k = weight.shape
    dw = torch.empty_like(weight)
    grid = (n_experts * triton.cdiv(n_cols, cfg.block_n) * triton.cdiv(k, cfg.block_k),)
    _grouped_wgrad_kernel[grid](
        left, right, scale if scale is not None else left, dw, layout.rows, layout.tile_start,
        n_cols, k, top_k, left.stride(0), right.stride(0),
        L_BY_TOKEN=l_by_token, R_BY_TOKEN=r_by_token, HAS_SCALE=scale is not None,
        BLOCK_M=layout.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_FP32=_interpreted(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return dw


def _interpreted() -> bool:
    return type(_grouped_wgrad_kernel).__name__ == "InterpretedFunction"
