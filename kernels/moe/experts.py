"""Batch-invariant fused mixture-of-experts: the SwiGLU experts of Qwen3-MoE and their top-k combine.

Legend: T = tokens, H = hidden, E = experts, I = expert intermediate size, k = experts per token,
n = T * k (token, slot) entries, entry p = t * k + j.
Weights in Hugging Face transformers 5's layout (`Qwen3MoeExperts`): w_gate_up [E, 2I, H] (rows
0..I-1 gate, I..2I-1 up: `gate_up_proj`), w_down [E, H, I] (`down_proj`), both x's dtype.

Math, per token t and slot j, e = topk_ids[t, j]:
    gu     = linear(x[t], w_gate_up[e])        [2I] model dtype: exactly `kernels.linear` for that row
    a      = silu_and_mul(gu)                  [I]  model dtype: exactly `kernels.silu_and_mul`
    y_tj   = a @ w_down[e]^T                   [H]  fp32: `linear(a, w_down[e], out_dtype=fp32)`, NOT rounded
    out[t] = (((w_t0 * y_t0) + w_t1 * y_t1) + ... + w_t,k-1 * y_t,k-1).to(x.dtype)
             w_tj = topk_weights[t, j] (fp32); fp32 products, fp32 sums in slot order, one rounding

Invariant (DESIGN rule 6): a row's bits depend only on x[t], its k (expert, weight) pairs and the
expert weights: never on how many tokens an expert received, which tokens share the batch, their
order, or padding. Each expert GEMM row is a batch-invariant `linear` row (its K reduced in an order
fixed by the weight shape), SiLU-and-mul is elementwise, and the combine adds a token's k products
in slot order with no atomics.

Torch path (CPU; CUDA in reference mode): literally that composition of the batch-invariant ops,
expert by expert (the rows routed to e gathered in (token, slot) order, `linear`, `silu_and_mul`,
`linear(..., out_dtype=fp32)` scattered into an fp32 [n, H] buffer), then the slot-order sum
(`reduction.sequential_sum`). Exact by construction. Triton path (CUDA): `experts_triton.py`, one
grouped GEMM per projection; bitwise equal to the same composition of the Triton dense ops. As for
every op, the two backends agree to rounding only: rollout and trainer must run the same one.

Differences from Hugging Face's `Qwen3MoeExperts.forward` (eager; `grouped_mm` is alike): HF rounds
gu, a and y to the model dtype, multiplies y by a bf16 routing weight in bf16 and accumulates the
experts into the output with `index_add_` in expert order in the model dtype (several roundings,
order = expert id order); here y stays fp32, the weights are fp32 and one rounding ends the slot-order
sum. Expert GEMMs reduce K in a fixed order instead of cuBLAS/MKL's shape-dependent one.

Backward (training only: correct and deterministic, not batch-invariant; no atomics), with
g_tj = dOut[t] @ w_down[e] (fp32 [I]) and s = sigmoid of the gate half of gu:
    d topk_weights[t, j] = g_tj . a_tj              (= dOut[t] . y_tj)
    dA_tj  = w_tj * g_tj;   dGU_tj = SiLU-and-mul backward of dA_tj at gu_tj
    dW_down[e]    = sum over e's entries of (w_tj dOut[t])^T a_tj       [H, I]
    dW_gate_up[e] = sum over e's entries of dGU_tj^T x[t]               [2I, H] (zero if unrouted)
    dX[t]  = sum over slots j in order of dGU_tj @ w_gate_up[e]         fp32, rounded once
gu and a are recomputed in the backward (the forward keeps only its inputs).
"""

import torch

from ..autograd_utils import backward_without_autocast
from ..checks import check_moe_inputs
from ..dispatch import backend_for, reference_mode
from ..gemm.activation import silu_and_mul, silu_and_mul_grad
from ..gemm.linear import linear
from ..reduction import sequential_sum


def _expert_entries(topk_ids: torch.Tensor, n_experts: int):
    """(e, entries) for every expert e that received tokens: the entries p = t * k + j routed to it,
    ascending (token, then slot order). A function of the ids only."""
    flat = topk_ids.reshape(-1)  # [n]
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(n_experts + 1, device=flat.device, dtype=flat.dtype))
    bounds = bounds.tolist()  # the torch path runs on the host anyway (CPU, or CUDA reference mode)
    for e in range(n_experts):
        if bounds[e + 1] > bounds[e]:
            yield e, order[bounds[e] : bounds[e + 1]]


def _slot_sum(rows: torch.Tensor, n_tokens: int, top_k: int) -> torch.Tensor:
    """fp32 [T, H] = rows [T * k, H] summed over each token's k slots in slot order."""
    return sequential_sum(rows.view(n_tokens, top_k, rows.shape[1]).permute(0, 2, 1))


def _fused_moe_torch_forward(x, w_gate_up, w_down, topk_ids, topk_weights, gather_act=None, sizes=None):
    """[T, H_r]. Unsharded by default; a tensor-parallel rank passes `gather_act` and the whole
    layer's `sizes` (I, H) as for the Triton `_forward` (each GEMM with the whole weight's config_n)."""
    n_tokens, top_k = topk_ids.shape
    config_n = (None, None) if sizes is None else (2 * sizes[0], sizes[1])
    experts = list(_expert_entries(topk_ids, w_gate_up.shape[0]))
    act = torch.empty(n_tokens * top_k, w_gate_up.shape[1] // 2, dtype=x.dtype, device=x.device)  # [n, I_r]
    for e, entries in experts:
        act[entries] = silu_and_mul(linear(x[entries // top_k], w_gate_up[e], config_n=config_n[0]))
    if gather_act is not None:
        act = gather_act(act)  # [n, I]
    y = torch.empty(n_tokens * top_k, w_down.shape[1], dtype=torch.float32, device=x.device)  # [n, H_r]
    for e, entries in experts:
        y[entries] = linear(act[entries], w_down[e], out_dtype=torch.float32, config_n=config_n[1])  # fp32
    products = topk_weights.reshape(-1, 1) * y  # [n, H_r] fp32
    return _slot_sum(products, n_tokens, top_k).to(x.dtype)


class _FusedMoeFunction(torch.autograd.Function):
    """The torch path. Backward: fp32 matmuls per expert (see the module docstring); the forward's gu
    and a recomputed by the same batch-invariant ops, so they are the forward's bits."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, topk_ids, topk_weights):
        ctx.save_for_backward(x, w_gate_up, w_down, topk_ids, topk_weights)
        return _fused_moe_torch_forward(x, w_gate_up, w_down, topk_ids, topk_weights)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        x, w_gate_up, w_down, topk_ids, topk_weights = ctx.saved_tensors
        need_x, need_wgu, need_wd, _, need_w = ctx.needs_input_grad
        n_tokens, hidden = x.shape
        top_k = topk_ids.shape[1]
        g_out = grad_out.float()  # [T, H]
        w_flat = topk_weights.reshape(-1)  # [n]
        dx_rows = (
            torch.zeros(n_tokens * top_k, hidden, dtype=torch.float32, device=x.device) if need_x else None
        )
        d_wgu = torch.zeros(w_gate_up.shape, dtype=torch.float32, device=x.device) if need_wgu else None
        d_wd = torch.zeros(w_down.shape, dtype=torch.float32, device=x.device) if need_wd else None
        d_w = torch.zeros(n_tokens * top_k, dtype=torch.float32, device=x.device)  # [n]
        with reference_mode():  # the forward ran the torch path: recompute on it
            for e, entries in _expert_entries(topk_ids, w_gate_up.shape[0]):
                tokens = entries // top_k
                xe = x[tokens]  # [n_e, H]
                gu = linear(xe, w_gate_up[e])  # [n_e, 2I]
                a = silu_and_mul(gu).float()  # [n_e, I]
                go = g_out[tokens]  # [n_e, H]
                g = go @ w_down[e].float()  # [n_e, I]: dL/da before the routing weight
                we = w_flat[entries][:, None]  # [n_e, 1]
                d_w[entries] = (g * a).sum(-1)
                if need_wd:
                    d_wd[e] = (go * we).t() @ a
                if need_x or need_wgu:
                    dgu = silu_and_mul_grad(gu, g * we)  # [n_e, 2I]
                    if need_wgu:
                        d_wgu[e] = dgu.t() @ xe.float()
                    if need_x:
                        dx_rows[entries] = dgu @ w_gate_up[e].float()
        return (
            _slot_sum(dx_rows, n_tokens, top_k).to(x.dtype) if need_x else None,
            d_wgu.to(w_gate_up.dtype) if need_wgu else None,
            d_wd.to(w_down.dtype) if need_wd else None,
            None,
            d_w.view(n_tokens, top_k) if need_w else None,
        )


def _fused_moe_triton(x, w_gate_up, w_down, topk_ids, topk_weights):
    from .experts_triton import fused_moe_triton  # imported on first use: no Triton on CPU

    return fused_moe_triton(x, w_gate_up, w_down, topk_ids, topk_weights)


_IMPLS = {"torch": _FusedMoeFunction.apply, "triton": _fused_moe_triton}


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """[T, H] in x.dtype: the top-k SwiGLU experts of each token, combined (module docstring).

    x [T, H] bf16/fp32 (unit stride in H); w_gate_up [E, 2I, H] and w_down [E, H, I], contiguous, x's
    dtype; topk_ids int32/int64 [T, k] in [0, E); topk_weights fp32 [T, k] (`routing.route`).
    Differentiable w.r.t. x, both weights and topk_weights.
    """
    check_moe_inputs(x, w_gate_up, w_down, topk_ids, topk_weights)
    return _IMPLS[backend_for(x)](x, w_gate_up, w_down, topk_ids, topk_weights)


def _fused_moe_sharded_torch(x, w_gate_up, w_down, topk_ids, topk_weights, gather_act, inter, hidden):
    return _fused_moe_torch_forward(x, w_gate_up, w_down, topk_ids, topk_weights, gather_act, (inter, hidden))


def _fused_moe_sharded_triton(*args):
    from .experts_triton import fused_moe_sharded_triton

    return fused_moe_sharded_triton(*args)


_SHARDED_IMPLS = {"torch": _fused_moe_sharded_torch, "triton": _fused_moe_sharded_triton}


@torch.no_grad()
def fused_moe_sharded(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gather_act,
    inter: int,
    hidden: int,
) -> torch.Tensor:
    """One tensor-parallel rank's columns [T, H_r] of `fused_moe` (inference only).

    w_gate_up [E, 2 I_r, H]: the rank's block of each expert's gate rows, then of its up rows; w_down
    [E, H_r, I]: the rank's block of each expert's output rows, with the full I. `gather_act` maps the
    rank's activation columns [P, I_r] to all ranks' [P, I] (the group's all-gather, rank order).
    `inter`, `hidden`: the whole layer's I and H, which choose every GEMM's configuration (so its
    reduction order). Each output column is bit for bit `fused_moe`'s: the gate/up GEMM and
    SiLU-and-mul are column-local, the gathered activation is the whole one, each down column reduces
    the full I in the whole weight's order, and the combine is per column.
    """
    down_shape = (w_gate_up.shape[0], w_down.shape[1] if w_down.dim() == 3 else -1, inter)  # [E, H_r, I]
    check_moe_inputs(x, w_gate_up, w_down, topk_ids, topk_weights, down_shape)
    args = (x, w_gate_up, w_down, topk_ids, topk_weights, gather_act, inter, hidden)
    return _SHARDED_IMPLS[backend_for(x)](*args)
