"""The gated delta rule (design C of docs/architecture.md "Gated DeltaNet"): chunks anchored at multiple-of-CHUNK positions everywhere, and a
decode step that computes only its own row of the current chunk, with the chunk computation's arithmetic.

Math, per sequence, v head and chunk of C = CHUNK rows (q_hat, k_hat, g, beta as in rules.py; dt = the
input dtype, to which every product's operands are rounded; S^T = the fp32 state at the chunk's start,
[DV, DK], the transpose of transformers' [DK, DV]; rows past the sequence are zeros), for rows i, j of the chunk:
    G_i   = sum_{j <= i} g_j                                   one sum over the C gate slots
    x_j   = dt(beta_j v_j),  y_j = dt(beta_j exp(G_j) k_j)
    A_ij  = beta_i (k_i . k_j) exp(G_i - G_j)                  j < i, else 0
    T     = (I + A)^-1                                         the torch path: T_i = e_i - sum_{l < i} A_il T_l,
                                                               rows in order; the kernels, per row tile b:
                                                               T_bb = L_b = (I + A_bb)^-1 (rows in order),
                                                               T_b,<b = -L_b (A_b,<b T_<b)
    U_i   = dt(T_i x),  W_i = dt(T_i y)                         (T_i rounded to dt)
    V'_i  = dt(U_i - W_i dt(S))                                the chunk's delta values
    o_i   = dt(q_i exp(G_i)) dt(S) + sum_{j <= i} dt((q_i . k_j) exp(G_i - G_j)) V'_j
    S    <- exp(G_{C-1}) S + sum_j dt(exp(G_{C-1} - G_j) k_j) V'_j^T      when the chunk is full
This is the recurrence S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,
o_t = S_t^T q_t, regrouped by chunks (the WY form flash-linear-attention uses), up to
rounding; the chunk's state pass is the only sequential part of training and prefill.

Invariant: row i's values read rows j > i only through exact zeros (the masks of A and of the causal
product, and T_i, whose columns past i are 0). So a decode step at chunk position p that holds rows
0 .. p - 1 in the cache (`incremental_cache.IncrementalCache`: k, x, g, beta, T rows, V' rows and the
boundary state) computes row p with the same operations on the same operands, zero rows past p: the
same bits as row p of any prefill or training chunk. A step costs one row of each product, not the
chunk. The state after a chunk is the same product of the same full
tiles whether one prefill or 64 decode steps filled it. The torch path (`incremental_torch.py`: every
product a fixed-order row sum) and the Triton kernels (`incremental_chunk_triton.py`,
`incremental_decode_triton.py`, launched by `incremental_triton.py`: fixed-shape tiles, the decode step
padding its row into the chunk kernels' row tile) agree only to rounding.

Entry points (T packed tokens, N sequences, cu_seqlens [N + 1]):
- `incremental_gated_delta_rule`: training: from zero or given boundary states [N, HV, DV, DK] at each
  sequence's first row; returns (o [T, HV, DV], the state after each sequence's last full chunk);
  differentiable (autograd of the torch path on CPU, `incremental_triton_bwd.py` on CUDA).
- `incremental_gated_delta_rule_cached`: prefill, chunked prefill and decode over an IncrementalCache.
"""

import torch

from ..dispatch import backend_for
from .checks import check_gated_delta_inputs, check_slots, check_state
from .incremental_cache import IncrementalCache, StepSplit, check_context_lens, check_decode_only
from .incremental_torch import cached_torch, chunk_forward


def _training_torch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state=None):
    cu = cu_seqlens.long()
    h0 = initial_state
    if h0 is None:
        h0 = torch.zeros(cu.shape[0] - 1, v.shape[1], v.shape[2], q.shape[2], device=v.device)
    o, state, _, _ = chunk_forward(q, k, v, a, b, A_log, dt_bias, cu[:-1], cu[1:], h0)
    return o, state


def _training_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state=None):
    from .incremental_triton import incremental_gated_delta_rule_triton  # no Triton on CPU

    return incremental_gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)


def _cached_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache, slots, has_state, context_lens, decode_only=False,
                   split=None):  # fmt: skip
    from .incremental_triton import incremental_gated_delta_rule_cached_triton

    return incremental_gated_delta_rule_cached_triton(
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache, slots, has_state, context_lens, decode_only, split
    )


def _cached_torch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache, slots, has_state, context_lens, decode_only=False,
                  split=None):  # fmt: skip
    return cached_torch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache, slots, has_state, context_lens)


_IMPLS = {"torch": _training_torch, "triton": _training_triton}
_CACHED_IMPLS = {"torch": _cached_torch, "triton": _cached_triton}


def incremental_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, HV, DV] in v's dtype, states [N, HV, DV, DK] fp32 after each sequence's last full chunk)
    of packed sequences, chunks anchored at each sequence's first row.

    q, k: [T, HK, DK] post-conv (not normalised); v: [T, HV, DV]; a, b: [T, HV] (the pre-activation
    gate inputs); A_log, dt_bias: [HV]; cu_seqlens: int [N + 1]; initial_state: fp32 [N, HV, DV, DK]
    boundary states (a sequence resumed at a chunk boundary) or None for zeros. Differentiable in
    every floating input."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    if initial_state is not None:
        check_state("initial_state", initial_state, n_seqs, v, k)
    return _IMPLS[backend_for(v)](q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)


def incremental_gated_delta_rule_cached(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cache: IncrementalCache,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    context_lens: torch.Tensor,
    decode_only: bool = False,
    split: StepSplit | None = None,
) -> torch.Tensor:
    """o [T, HV, DV] of a prefill, chunked-prefill or decode step; the cache slots are updated in place.

    slots: int [N] distinct (-1: no slot, for a sequence with no rows: a CUDA graph's padded request);
    has_state: bool [N] (False: the sequence starts here, from a zero state; True: it continues from
    its slot: the boundary state and the last context_lens % CHUNK rows of a partial chunk);
    context_lens: int [N], the sequence's tokens before this call; decode_only: every sequence has one
    row (CUDA: no host read, as CUDA graphs need); split: the step's `StepSplit` (`split_step`, made once a
    step from host copies of cu_seqlens, context_lens and has_state: then no layer reads the host; None:
    each call reads them once). Inference only."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens, padding_rows=True)
    check_slots(slots, has_state, n_seqs, cache.check(k, v), padded=True)
    check_context_lens(context_lens, n_seqs)
    check_decode_only(decode_only, q, cu_seqlens)
    tensors = (q, k, v, a, b, A_log, dt_bias, *cache.tensors())
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("incremental_gated_delta_rule_cached is inference only: no input may need a gradient")
    return _CACHED_IMPLS[backend_for(v)](
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache, slots, has_state, context_lens, decode_only, split
    )
