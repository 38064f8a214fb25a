"""Triton top-k routing (the CUDA paths of `routing.route` and `routing.route_grouped`): one
program per token row, one launch.

Math, per row of fp32 router logits z [E] (one program, BLOCK_E = next power of two >= E lanes):
    mx   = max(z)                                  exact in any order
    s    = sum of exp(z - mx)                      one tl.reduce over the BLOCK_E lanes: its tree is
                                                   fixed by (BLOCK_E, _NUM_WARPS), i.e. by E alone
    p    = exp(z - (mx + log(s)))                  fp32, as `routing` (p = exp(log_softmax))
    slot j = 0..k-1: the largest remaining p, ties to the lower expert id (the tie-break-left argmax
                     of Triton's own tl.argmax), then removed
    norm_topk_prob: s_k = ((w0 + w1) + w2) + ...   fp32 in slot order, w_j = div_rn(w_j, s_k)
Invariant: nothing reads another row, and no launch parameter depends on T (the grid only), so a
token's (weights, ids) are the same bits alone or in any batch. Versus the torch path (CPU): the same
definition, another order of the exp-sum, so the weights agree to rounding (as every op's backends).

Gradient (`route_triton` under autograd): p is written by the forward when the logits need a
gradient; the backward is torch on [T, E] (deterministic; training only):
    r_j = p[ids_j];  with norm  dr_j = (g_j - sum_i g_i w_i) / s_k,  else dr_j = g_j
    dp  = dr scattered to ids;  dz = p * (dp - sum_e dp_e p_e)      (softmax's Jacobian)

`route_grouped_triton` (DeepSeek-V3's rule, `routing` docstring), per row in one program:
    s = div_rn(1, 1 + exp(-z)),  c = s + b  (absent lanes -inf)
    group j (GROUP_SIZE consecutive lanes): m1 = its largest c (its lane l1: the lowest among ties),
                                            m2 = its largest c on another lane; score_j = m1 + m2
    TOPK_GROUP times: the best remaining group (ties to the lower group) is kept; c = -inf elsewhere
    slots j = 0..k-1 as above over c; w_j = s at the slot's lane; norm: div_rn(w_j, slot sum + 1e-20);
    w_j = w_j * scaling
Gradient: s stored by the forward when the logits need a gradient; torch on [T, E]:
    dr_j = scaling * g_j, with norm dr_j = (dr_j - sum_i dr_i w'_i) / (sum r + 1e-20)  (w' before scaling)
    ds = dr scattered to ids;  dz = ds * s * (1 - s)

Interpreter note: reductions are spelled with tl.reduce and Triton's own combine functions (see
`sampling/logprob_triton.py`), so TRITON_INTERPRET=1 runs this on CPU tensors in the tests.
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _argmax_combine_tie_break_left, _elementwise_max, _sum_combine

from ..autograd_utils import backward_without_autocast

_NUM_WARPS = 4  # fixed: with BLOCK_E (a function of E) it shapes the exp-sum's tree


@triton.jit
def _route_kernel(
    LOGITS,  # fp32 [T, E], unit stride in E
    WEIGHTS,  # fp32 [T, TOP_K]
    IDS,  # int64 [T, TOP_K]
    PROBS,  # fp32 [T, E] (written with STORE_P only)
    n_experts,
    stride_l,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    NORM: tl.constexpr,
    STORE_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    ok = lanes < n_experts
    z = tl.load(LOGITS + row * stride_l + lanes, mask=ok, other=float("-inf"))
    mx = tl.reduce(z, 0, _elementwise_max)
    s = tl.reduce(tl.where(ok, tl.exp(z - mx), 0.0), 0, _sum_combine)
    p = tl.exp(z - (mx + tl.log(s)))  # [BLOCK_E]; lanes past E: exp(-inf) = 0
    if STORE_P:
        tl.store(PROBS + row * n_experts + lanes, p, mask=ok)
    remaining = tl.where(ok, p, -1.0)  # probabilities are >= 0: a taken or absent lane never wins
    slots = tl.arange(0, BLOCK_K)
    weights = tl.full([BLOCK_K], 0.0, tl.float32)
    ids = tl.full([BLOCK_K], 0, tl.int32)
    total = tl.full([BLOCK_K], 0.0, tl.float32)  # every lane holds the same running sum
    for j in tl.static_range(TOP_K):
        best, lane = tl.reduce((remaining, lanes), 0, _argmax_combine_tie_break_left)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, lane, ids)
        if j == 0:
            total = total * 0.0 + best
        else:
            total = total + best
        remaining = tl.where(lanes == lane, -1.0, remaining)
    if NORM:
        weights = tl.math.div_rn(weights, total)
    out = row * TOP_K + slots
    tl.store(WEIGHTS + out, weights, mask=slots < TOP_K)
    tl.store(IDS + out, ids.to(tl.int64), mask=slots < TOP_K)


def _launch(logits: torch.Tensor, top_k: int, norm: bool, store_p: bool):
    n_tokens, n_experts = logits.shape
    weights = torch.empty(n_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n_tokens, top_k, dtype=torch.int64, device=logits.device)
    probs = torch.empty(n_tokens, n_experts, dtype=torch.float32, device=logits.device) if store_p else weights
    if n_tokens:
        _route_kernel[(n_tokens,)](
            logits, weights, ids, probs, n_experts, logits.stride(0),
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), NORM=norm, STORE_P=store_p,
            BLOCK_E=triton.next_power_of_2(n_experts), num_warps=_NUM_WARPS,
        )  # fmt: skip
    return weights, ids, (probs if store_p else None)


class _RouteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, norm):
        weights, ids, probs = _launch(logits, top_k, norm, store_p=True)
        ctx.save_for_backward(weights, ids, probs)
        ctx.norm = norm
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_weights, _grad_ids):
        weights, ids, probs = ctx.saved_tensors
        g = grad_weights.float()  # [T, k]
        if ctx.norm:
            raw = probs.gather(1, ids)  # [T, k]
            g = (g - (g * weights).sum(-1, keepdim=True)) / raw.sum(-1, keepdim=True)
        dp = torch.zeros_like(probs).scatter_(1, ids, g)  # [T, E]; a row's ids are distinct
        return probs * (dp - (dp * probs).sum(-1, keepdim=True)), None, None


def route_triton(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int64 [T, k]); inputs checked by `routing.route`. CUDA tensors
    (CPU tensors under TRITON_INTERPRET=1). Differentiable w.r.t. logits through the weights."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _RouteFunction.apply(logits, top_k, norm_topk_prob)
    weights, ids, _ = _launch(logits, top_k, norm_topk_prob, store_p=False)
    return weights, ids


@triton.jit
def _route_grouped_kernel(
    LOGITS,  # fp32 [T, E], unit stride in E
    BIAS,  # fp32 [E]: the choice-only correction bias
    WEIGHTS,  # fp32 [T, TOP_K]
    IDS,  # int64 [T, TOP_K]
    SCORES,  # fp32 [T, E] sigmoid scores (written with STORE_S only)
    n_experts,
    stride_l,
    scaling,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    N_GROUP: tl.constexpr,  # expert groups (consecutive lanes of GROUP_SIZE)
    TOPK_GROUP: tl.constexpr,  # groups kept
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two >= N_GROUP
    NORM: tl.constexpr,
    STORE_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    ok = lanes < n_experts
    z = tl.load(LOGITS + row * stride_l + lanes, mask=ok, other=0.0)
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-z))  # [BLOCK_E] sigmoid
    if STORE_S:
        tl.store(SCORES + row * n_experts + lanes, s, mask=ok)
    bias = tl.load(BIAS + lanes, mask=ok, other=0.0)
    choice = tl.where(ok, s + bias, float("-inf"))
    if TOPK_GROUP < N_GROUP:
        # 1. Each group's score: its two largest choice scores, added.
        group = lanes // GROUP_SIZE
        glanes = tl.arange(0, BLOCK_G)
        gscores = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            mine = ok & (group == g)
            m1, l1 = tl.reduce((tl.where(mine, choice, float("-inf")), lanes), 0, _argmax_combine_tie_break_left)
            m2 = tl.reduce(tl.where(mine & (lanes != l1), choice, float("-inf")), 0, _elementwise_max)
            gscores = tl.where(glanes == g, m1 + m2, gscores)
        # 2. The TOPK_GROUP best groups (ties to the lower group) stay; the others' experts are -inf.
        keep = tl.full([BLOCK_E], 0, tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            _best, gl = tl.reduce((gscores, glanes), 0, _argmax_combine_tie_break_left)
            keep = tl.where(group == gl, 1, keep)
            gscores = tl.where(glanes == gl, float("-inf"), gscores)
        choice = tl.where(keep == 1, choice, float("-inf"))
    # 3. Top k of the choice scores (ties to the lower id); weights from the unbiased scores.
    slots = tl.arange(0, BLOCK_K)
    weights = tl.full([BLOCK_K], 0.0, tl.float32)
    ids = tl.full([BLOCK_K], 0, tl.int32)
    total = tl.full([BLOCK_K], 0.0, tl.float32)  # every lane holds the same running sum
    taken = tl.full([BLOCK_E], 0, tl.int32)
    for j in tl.static_range(TOP_K):
        _best, lane = tl.reduce((tl.where(taken == 1, float("-inf"), choice), lanes), 0,
                                _argmax_combine_tie_break_left)  # fmt: skip
        w = tl.reduce(tl.where(lanes == lane, s, float("-inf")), 0, _elementwise_max)  # s at the lane: exact
        weights = tl.where(slots == j, w, weights)
        ids = tl.where(slots == j, lane, ids)
        if j == 0:
            total = total * 0.0 + w
        else:
            total = total + w
        taken = tl.where(lanes == lane, 1, taken)
    if NORM:
        weights = tl.math.div_rn(weights, total + 1e-20)
    weights = weights * scaling
    out = row * TOP_K + slots
    tl.store(WEIGHTS + out, weights, mask=slots < TOP_K)
    tl.store(IDS + out, ids.to(tl.int64), mask=slots < TOP_K)


def _launch_grouped(logits, bias, top_k, n_group, topk_group, norm, scaling, store_s):
    n_tokens, n_experts = logits.shape
    weights = torch.empty(n_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n_tokens, top_k, dtype=torch.int64, device=logits.device)
    scores = torch.empty(n_tokens, n_experts, dtype=torch.float32, device=logits.device) if store_s else weights
    if n_tokens:
        _route_grouped_kernel[(n_tokens,)](
            logits, bias.contiguous(), weights, ids, scores, n_experts, logits.stride(0), scaling,
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), N_GROUP=n_group, TOPK_GROUP=topk_group,
            GROUP_SIZE=n_experts // n_group, BLOCK_G=triton.next_power_of_2(n_group), NORM=norm, STORE_S=store_s,
            BLOCK_E=triton.next_power_of_2(n_experts), num_warps=_NUM_WARPS,
        )  # fmt: skip
    return weights, ids, (scores if store_s else None)


class _RouteGroupedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, n_group, topk_group, norm, scaling):
        weights, ids, scores = _launch_grouped(logits, bias, top_k, n_group, topk_group, norm, scaling, True)
        ctx.save_for_backward(ids, scores)
        ctx.norm, ctx.scaling = norm, scaling
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_weights, _grad_ids):
        ids, scores = ctx.saved_tensors
        g = grad_weights.float() * ctx.scaling  # [T, k]
        if ctx.norm:
            raw = scores.gather(1, ids)  # [T, k]
            denom = raw.sum(-1, keepdim=True) + 1e-20
            g = (g - (g * (raw / denom)).sum(-1, keepdim=True)) / denom
        ds = torch.zeros_like(scores).scatter_(1, ids, g)  # [T, E]; a row's ids are distinct
        return ds * scores * (1.0 - scores), None, None, None, None, None, None


def route_grouped_triton(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling):
    """(weights fp32 [T, k], ids int64 [T, k]) by DeepSeek-V3's rule; inputs checked by
    `routing.route_grouped`. Differentiable w.r.t. logits through the weights."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _RouteGroupedFunction.apply(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling)
    weights, ids, _ = _launch_grouped(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling, False)
    return weights, ids
