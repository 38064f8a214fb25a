"""Triton fused mixture-of-experts (the CUDA path of `experts.py`): the forward and its autograd.

Math: `experts.py`'s. The kernels, the layout, the invariant (one reduction per weight shape, the dense
GEMM's) and their launch helpers are `core_triton.py`'s; the backward is `experts_triton_bwd.py`
(deterministic, no atomics; gu and act recomputed with the forward's configuration, so they are the
forward's bits). Legend: T = tokens, H = hidden, E = experts, I = expert intermediate size, k =
experts per token, n = T * k entries, P = rows of the expert-grouped layout.
"""

import torch

from ..autograd_utils import backward_without_autocast
from ..checks import check_moe_inputs
from .align_triton import Layout, align
from .core_triton import MoeConfig, combine, forward_configs, gate_up, grouped_gemm, interpreted
from .experts_triton_bwd import moe_backward

__all__ = ["MoeConfig", "forward_configs", "fused_moe_sharded_triton", "fused_moe_triton"]


def _forward(x, w_gate_up, w_down, topk_ids, topk_weights, gather_act=None, sizes=None):
    """(out [T, H_r], layout, gate_up configuration): the last two for the backward. Unsharded by
    default; a tensor-parallel rank (`experts.fused_moe_sharded`) passes its `gather_act` (the activation
    columns of every rank, between the two grouped GEMMs) and the whole layer's `sizes` (I, H), which
    choose the configurations."""
    n_experts = w_gate_up.shape[0]
    n_tokens, top_k = topk_ids.shape
    inter, hidden = sizes or (w_gate_up.shape[1] // 2, w_gate_up.shape[2])
    cfg_gate_up, cfg_down = forward_configs(hidden, inter, x.dtype)
    layout = align(topk_ids, n_experts, cfg_gate_up.block_m)
    act, _ = gate_up(x, w_gate_up, layout, cfg_gate_up, top_k, store_gu=False)  # [P, I_r]
    if gather_act is not None:
        act = gather_act(act)  # [P, I]
    cols = w_down.shape[1]  # H, or the rank's H_r
    y = torch.empty(n_tokens * top_k, cols, dtype=torch.float32, device=x.device)  # [n, H_r]
    grouped_gemm(act, w_down, w_down.stride(), cols, inter, y, layout, cfg_down,
                 a_by_token=False, out_by_entry=True, top_k=top_k)  # fmt: skip
    return combine(y, topk_weights.reshape(-1), topk_ids, n_experts, x.dtype), layout, cfg_gate_up


def fused_moe_sharded_triton(x, w_gate_up, w_down, topk_ids, topk_weights, gather_act, inter, hidden):
    """`experts.fused_moe_sharded` (one tensor-parallel rank's output columns [T, H_r])."""
    return _forward(x, w_gate_up, w_down, topk_ids, topk_weights, gather_act, (inter, hidden))[0]


class _FusedMoeTritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, topk_ids, topk_weights):
        out, layout, cfg_gate_up = _forward(x, w_gate_up, w_down, topk_ids, topk_weights)
        ctx.save_for_backward(x, w_gate_up, w_down, topk_ids, topk_weights, *layout[:4])
        ctx.block_m, ctx.cfg_gate_up = layout.block_m, cfg_gate_up
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        x, w_gate_up, w_down, topk_ids, topk_weights, *layout = ctx.saved_tensors
        need_x, need_wgu, need_wd, _, need_w = ctx.needs_input_grad
        dx, d_wgu, d_wd, d_w = moe_backward(
            grad_out,
            x,
            w_gate_up,
            w_down,
            topk_ids,
            topk_weights,
            Layout(*layout, ctx.block_m),
            ctx.cfg_gate_up,
            (need_x, need_wgu, need_wd, need_w),
        )
        return dx, d_wgu, d_wd, None, d_w


def fused_moe_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """[T, H] in x.dtype; the arguments and math of `experts.fused_moe`. CUDA tensors (CPU tensors only
    under TRITON_INTERPRET=1). Differentiable w.r.t. x, both weights and topk_weights."""
    check_moe_inputs(x, w_gate_up, w_down, topk_ids, topk_weights)
    if x.device.type != "cuda" and not interpreted():
        raise ValueError(
            f"fused_moe_triton needs CUDA tensors, got {x.device} (set TRITON_INTERPRET=1 on CPU)"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w_gate_up, w_down, topk_weights)):
        return _FusedMoeTritonFunction.apply(x, w_gate_up, w_down, topk_ids, topk_weights)
    return _forward(x, w_gate_up, w_down, topk_ids, topk_weights)[0]
