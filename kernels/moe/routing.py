"""Batch-invariant top-k routing of a mixture-of-experts layer: `route` (Qwen3-MoE's and DeepSeek-V2's
softmax router) and `route_grouped` (DeepSeek-V3's sigmoid router with its score-correction bias and
expert groups, below).

Math, per token row t of fp32 router logits z [E] (T = tokens, E = experts, k = top_k):
    p      = exp(log_softmax(z))                  fp32, `kernels.sampling.logprob.log_softmax(logits, 1.0)`:
                                                  p[e] = exp(z[e] - lse), lse = max + log(sum of
                                                  exp(z - max)), the sum in a fixed block order
    order  = a STABLE descending sort of p        ties (equal probabilities) go to the lower expert id
    ids    = order[:k]                            slot j = 0..k-1 holds the j-th largest probability
    w[j]   = p[ids[j]]
    norm_topk_prob: s = ((w[0] + w[1]) + w[2]) + ...   (fp32, in slot order), w[j] = w[j] / s
                                                  (true fp32 division by a tensor)
    -> weights fp32 [T, k], ids int64 [T, k]

Backends: this torch composition on CPU (and in reference mode); on CUDA one Triton launch of the same
definition (`routing_triton.py`: a row per program, the exp-sum in a tree fixed by E). They agree
to rounding only, as every op's backends: rollout and trainer must run the same one.

Why `log_softmax` and not a row-wise softmax written here (the torch path): it is the project's one fixed-order row
reduction with both backends (torch on CPU: 1024-long block sums then the blocks in order; Triton
on CUDA: one row per program, fixed block), differentiable on both. A torch `softmax`/`sum` on CUDA
picks its launch (and so its addition order) from the number of rows: a token's probabilities
would depend on the batch. The price: p = exp(z - lse) rather than exp(z - max) / sum, a relative
error of a few ulp of lse (tested against float64).

Invariant: everything after the log-softmax is elementwise (exp, division) or within the row (a
stable sort, whose result is unique for given values; a k-step sequential sum), so a token's
(weights, ids) are the same bits alone or in any batch, on either backend.

Differences from Hugging Face's `Qwen3MoeTopKRouter` (transformers 5), all deliberate:
1. logits: HF takes `F.linear` in the model dtype (bf16 logits, then upcast); here they are the fp32
   accumulator of the batch-invariant `linear(x, gate_weight, out_dtype=torch.float32)`, unrounded.
2. softmax: HF `softmax(dtype=float)` (exp(z - max) / sum, order chosen by the backend); here
   exp(log_softmax) with the fixed order above.
3. top-k: HF `torch.topk`, which promises no order among ties; here ties go to the lower id.
4. normalisation: HF `/= sum(dim=-1)` (vectorised sum order); here the sequential slot-order sum.
5. HF casts the weights to the logits' dtype (bf16) before the combine; here they stay fp32 (the
   fused MoE multiplies in fp32).
6. HF also returns the router logits (for its auxiliary loss); the model here computes them itself.

Gradient: autograd through the torch ops and `log_softmax` (correct and deterministic; ids carry
none). The sort selects; the gradient reaches logits through the gathered probabilities only.

`route_grouped` (DeepSeek-V3, Moonlight, Kimi-K2), per row z [E], bias b [E] fp32 (the checkpoint's
`e_score_correction_bias`), G = n_group groups of E / G consecutive experts, g = topk_group:
    s      = 1 / (1 + exp(-z))                    fp32 sigmoid, elementwise
    c      = s + b                                the choice scores: selection only, never a weight
    score of group j = the sum of the two largest c in the group (a + b: two terms, any order)
    groups = the g best groups, a stable descending sort (ties to the lower group); c = -inf in the
             others (transformers' `masked_fill(-inf)`: a masked expert is never chosen)
    ids    = the k largest c, a stable descending sort (ties to the lower expert id)
    w[j]   = s[ids[j]]                            the unbiased score
    norm_topk_prob: w[j] = w[j] / (((w[0] + w[1]) + ...) + 1e-20)   (slot order, then a true division)
    w[j]   = w[j] * routed_scaling_factor         (fp32, after the normalisation, as transformers does)
Everything is elementwise or within the row (a two-term sum, stable sorts, a k-term slot-order sum),
so a token's (weights, ids) are the same bits alone or in any batch. Differences from transformers'
`DeepseekV3TopkRouter`: torch.sigmoid there (a formula whose CPU bits depend on the element's place
in the tensor, reduction.py) against 1 / (1 + exp(-z)) here; torch.topk (no order among ties, and
slots in no set order) against the stable sorts; the k-term sum in slot order here. The ids and the
weights agree with transformers' up to those ties and a rounding of the sum.
"""

import torch

from ..checks import check_dim, check_dtype, check_last_dim_contiguous
from ..dispatch import backend_for
from ..sampling.logprob import log_softmax


def _check(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> None:
    check_dtype("logits", logits, (torch.float32,))
    check_dim("logits", logits, 2, "[T, E]")
    check_last_dim_contiguous("logits", logits)
    num_experts = logits.shape[1]
    if num_experts < 1:
        raise ValueError(f"logits must have at least one expert column, got shape {tuple(logits.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}] (the experts), got {top_k!r}")
    if not isinstance(norm_topk_prob, bool):
        raise ValueError(f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")


def _slot_sum(weights: torch.Tensor) -> torch.Tensor:
    """((w[:, 0] + w[:, 1]) + w[:, 2]) + ...: [T, k] -> [T], one fp32 addition at a time in slot order."""
    total = weights[:, 0]
    for j in range(1, weights.shape[1]):
        total = total + weights[:, j]
    return total


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int64 [T, k]) of fp32 router logits [T, E]; see the module docstring.

    Slot j of a row is its j-th most probable expert (ties: the lower id first). Differentiable
    w.r.t. logits through the weights.
    """
    _check(logits, top_k, norm_topk_prob)
    if backend_for(logits) == "triton":
        from .routing_triton import route_triton  # imported on first use: no Triton on CPU

        return route_triton(logits, top_k, norm_topk_prob)
    n_tokens = logits.shape[0]
    if n_tokens == 0:
        return logits.new_zeros(0, top_k), torch.zeros(0, top_k, dtype=torch.int64, device=logits.device)
    probs = torch.exp(log_softmax(logits, 1.0))  # [T, E] fp32
    order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices  # [T, E]
    ids = order[:, :top_k].contiguous()  # [T, k]
    weights = probs.gather(1, ids)  # [T, k]
    if norm_topk_prob:
        weights = weights / _slot_sum(weights)[:, None]
    return weights, ids


def check_grouping(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """ValueError unless E experts split into n_group groups of at least two (each group's score sums
    its two best experts) and the topk_group kept groups hold at least top_k experts."""
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_experts % n_group or (n_group > 1 and num_experts // n_group < 2):
        raise ValueError(
            f"n_group={n_group} must split the {num_experts} experts into equal groups of at least two experts"
        )
    if topk_group > n_group or topk_group * (num_experts // n_group) < top_k:
        raise ValueError(
            f"topk_group={topk_group} of n_group={n_group} groups must hold at least top_k={top_k} of the "
            f"{num_experts} experts"
        )


def route_grouped(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int64 [T, k]) of fp32 router logits [T, E] by DeepSeek-V3's rule (module
    docstring): sigmoid scores, `bias` fp32 [E] added for the choice only, the best `topk_group` of
    `n_group` expert groups, the top k experts there (slot j: the j-th largest choice score, ties to the
    lower id), weights the unbiased scores, normalised (`norm_topk_prob`), times `scaling` (the
    routed_scaling_factor). Differentiable w.r.t. logits through the weights."""
    _check(logits, top_k, norm_topk_prob)
    check_dtype("bias", bias, (torch.float32,))
    num_experts = logits.shape[1]
    if tuple(bias.shape) != (num_experts,) or bias.device != logits.device:
        raise ValueError(
            f"bias must be fp32 [{num_experts}] on {logits.device} (e_score_correction_bias), got "
            f"{tuple(bias.shape)} on {bias.device}"
        )
    check_grouping(num_experts, top_k, n_group, topk_group)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not scaling > 0:
        raise ValueError(f"scaling (routed_scaling_factor) must be a positive number, got {scaling!r}")
    if backend_for(logits) == "triton":
        from .routing_triton import route_grouped_triton  # imported on first use: no Triton on CPU

        return route_grouped_triton(logits, bias, top_k, n_group, topk_group, norm_topk_prob, float(scaling))
    n_tokens = logits.shape[0]
    if n_tokens == 0:
        return logits.new_zeros(0, top_k), torch.zeros(0, top_k, dtype=torch.int64, device=logits.device)
    scores = 1.0 / (1.0 + torch.exp(-logits))  # [T, E] fp32
    choice = scores.detach() + bias  # [T, E]
    if topk_group < n_group:
        size = num_experts // n_group
        top2 = torch.topk(choice.view(n_tokens, n_group, size), 2, dim=-1).values  # [T, G, 2]
        group_scores = top2[..., 0] + top2[..., 1]  # [T, G]
        kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros(n_tokens, n_group, dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if norm_topk_prob:
        weights = weights / (_slot_sum(weights) + 1e-20)[:, None]
    return weights * float(scaling), ids
