"""Truncated sampling (min-p, top-k, top-p) as one per-row log-prob threshold, batch-invariant.

The sampler keeps token v of row m for sampling iff log_probs[m, v] >= threshold[m]; the log-prob it
RETURNS is still the full-vocabulary tempered one (the trainer's value): truncation only narrows
which tokens can be drawn. Math, per row, in vLLM's order (min-p, then top-k, then top-p over what
is left):
    min-p:  keep v iff lp[v] >= max_v lp + log(min_p)                      (fp32, elementwise)
    top-k:  keep v iff lp[v] >= the k-th largest lp                        (an exact selection)
    top-p:  s_1 >= s_2 >= ... the kept values, sorted (exact); Q_j = floor(exp(s_j) * 2^40) as
            int64; keep j iff Q_1 + ... + Q_(j-1) < top_p * (Q_1 + Q_2 + ...)  (renormalised over
            the kept set); the threshold is the smallest kept s_j
    threshold = the largest of the three (-inf where an option is off)
Ties at a threshold are all kept (vLLM's top-k keeps them too). The first (largest) token is never
dropped, so a row always keeps its argmax.

Invariant: every step is a selection, an elementwise op or a sum of INTEGERS (exact, so its order
cannot matter), and each row reads only its own log-probs and options: a row's threshold is the
same alone, in any batch, on any backend. No floating-point sum whose order torch picks by shape
(a float cumsum or sum over the vocabulary would be: CUDA reductions split rows by launch size).
The top-p mass is quantised to 2^-40: tokens below 2^-40 probability weigh 0, which matters only
if the top-p boundary fell among them.
"""

from __future__ import annotations

import torch

from ..checks import check_dim, check_dtype, check_same_device

# Fixed-point scale of the top-p probabilities (int64 sums of probabilities <= 1 cannot overflow).
_P_SCALE = float(2**40)


def _check_option(name: str, t: torch.Tensor | None, n_rows: int, dtypes) -> None:
    if t is None:
        return
    check_dtype(name, t, dtypes)
    if tuple(t.shape) != (n_rows,):
        raise ValueError(f"{name} must have shape ({n_rows},), got {tuple(t.shape)}")


def truncation_threshold(
    log_probs: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    *,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """fp32 [M] threshold for fp32 log_probs [M, V] (see the module docstring).

    top_k: int [M], off where <= 0 or >= V; top_p: fp32 [M] in (0, 1], off where 1; min_p: fp32 [M]
    in [0, 1], off where 0. `max_top_k`: the largest active top_k if the caller knows it on the host
    (saves a device-to-host sync); computed from `top_k` otherwise.
    """
    check_dtype("log_probs", log_probs, (torch.float32,))
    check_dim("log_probs", log_probs, 2, "[M, V]")
    n_rows, vocab = log_probs.shape
    _check_option("top_k", top_k, n_rows, (torch.int32, torch.int64))
    _check_option("top_p", top_p, n_rows, (torch.float32,))
    _check_option("min_p", min_p, n_rows, (torch.float32,))
    check_same_device(log_probs=log_probs, top_k=top_k, top_p=top_p, min_p=min_p)
    thr = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=log_probs.device)  # [M]
    if n_rows == 0:
        return thr

    # 1. min-p: lp >= lp_max + log(min_p) (log(0) = -inf: off).
    if min_p is not None:
        lp_max = log_probs.amax(-1)  # exact
        thr = torch.maximum(thr, lp_max + torch.log(min_p))

    # 2. top-k: the k-th largest value (k clamped into [1, V]; rows with k off keep -inf).
    k_on = None
    if top_k is not None:
        k_on = (top_k > 0) & (top_k < vocab)
        if max_top_k is None:
            max_top_k = int(torch.where(k_on, top_k, 0).max())
    if top_p is None and (k_on is None or not max_top_k):
        return thr
    if k_on is not None and max_top_k:
        top_vals = torch.topk(log_probs, min(max_top_k, vocab), dim=-1).values  # [M, K] descending
        kth = top_vals.gather(1, (top_k.clamp(1, top_vals.shape[1]) - 1).long()[:, None])[:, 0]
        thr = torch.where(k_on, torch.maximum(thr, kth), thr)
    if top_p is None:
        return thr

    # 3. top-p over the values kept so far, in descending order.
    p_on = top_p < 1.0
    if k_on is not None and max_top_k and bool(torch.all(k_on | ~p_on)):
        sorted_vals = top_vals  # every top-p row has top-k on: its kept set lies in the top K
    else:
        sorted_vals = torch.sort(log_probs, dim=-1, descending=True).values  # [M, V]
    kept = sorted_vals >= thr[:, None]  # a prefix of each row
    q = torch.where(kept, torch.floor(torch.exp(sorted_vals) * _P_SCALE), 0.0).to(torch.int64)  # [M, C]
    total = q.sum(-1)  # [M] exact
    before = torch.cumsum(q, -1) - q  # exclusive prefix sums, exact
    keep = kept & (before.double() < top_p.double()[:, None] * total.double()[:, None])  # a prefix
    last = (keep.sum(-1) - 1).clamp_min(0)  # index of the smallest kept value
    thr_p = sorted_vals.gather(1, last[:, None])[:, 0]
    return torch.where(p_on, torch.maximum(thr, thr_p), thr)
