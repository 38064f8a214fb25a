"""Batch-invariant top-k routing of a mixture-of-experts layer (Qwen3-MoE's router).

Math, per token row t of fp32 router logits z [E] (T = tokens, E = experts, k = top_k):
    p      = exp(log_softmax(z))                  fp32, `kernels.logprob.log_softmax(logits, 1.0)`:
                                                  p[e] = exp(z[e] - lse), lse = max + log(sum of
                                                  exp(z - max)), the sum in a fixed block order
    order  = a STABLE descending sort of p        ties (equal probabilities) go to the lower expert id
    ids    = order[:k]                            slot j = 0..k-1 holds the j-th largest probability
    w[j]   = p[ids[j]]
    norm_topk_prob: s = ((w[0] + w[1]) + w[2]) + ...   (fp32, in slot order), w[j] = w[j] / s
                                                  (true fp32 division by a tensor)
    -> weights fp32 [T, k], ids int64 [T, k]

Backends: this torch composition on CPU (and in reference mode); on CUDA one Triton launch of the same
definition (`moe_routing_triton.py`: a row per program, the exp-sum in a tree fixed by E). They agree
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
"""

import torch

from .checks import check_dim, check_dtype, check_last_dim_contiguous
from .dispatch import backend_for
from .logprob import log_softmax


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


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int64 [T, k]) of fp32 router logits [T, E]; see the module docstring.

    Slot j of a row is its j-th most probable expert (ties: the lower id first). Differentiable
    w.r.t. logits through the weights.
    """
    _check(logits, top_k, norm_topk_prob)
    if backend_for(logits) == "triton":
        from .moe_routing_triton import route_triton  # imported on first use: no Triton on CPU

        return route_triton(logits, top_k, norm_topk_prob)
    n_tokens = logits.shape[0]
    if n_tokens == 0:
        return logits.new_zeros(0, top_k), torch.zeros(0, top_k, dtype=torch.int64, device=logits.device)
    probs = torch.exp(log_softmax(logits, 1.0))  # [T, E] fp32
    order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices  # [T, E]
    ids = order[:, :top_k].contiguous()  # [T, k]
    weights = probs.gather(1, ids)  # [T, k]
    if norm_topk_prob:
        total = weights[:, 0]
        for j in range(1, top_k):  # slot order, one fp32 addition at a time
            total = total + weights[:, j]
        weights = weights / total[:, None]
    return weights, ids
