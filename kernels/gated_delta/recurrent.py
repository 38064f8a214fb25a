"""Batch-invariant gated delta rule (Gated DeltaNet's recurrence): one recurrent algorithm for the
training forward, prefill, chunked prefill and decode.

Math, per sequence and v head (fp32; q_hat, k_hat, g, beta as in rules.py; the state S
is [DK, DV], stored transposed as [DV, DK] so that every sum over d_k runs along a contiguous row):
    S_0  = the sequence's state (0 at its start)
    S'   = exp(g_t) * S_{t-1}
    u_t  = v_t - S'^T k_hat_t                 (sum over d_k)
    S_t  = S' + k_hat_t (beta_t * u_t)^T
    o_t  = S_t^T q_hat_t                      (sum over d_k), rounded to v's dtype
This is S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T, o_t = S_t^T q_t, in the
order of transformers' `torch_recurrent_gated_delta_rule` and vLLM's recurrent kernel.

Invariant: a token's output and the state after it are a fixed sequence of fp32 operations on the
state before it and the token's own inputs: elementwise ops and one sum over d_k per row (a
`reduction.row_sum` here, one `tl.sum` of a fixed tile in the Triton kernel). The state crosses calls
in fp32, unrounded, so a token has the same bits whether it is decoded (one token from the cache),
prefilled in any chunking, or trained in a packed batch; and whatever the batch. The torch path
(CPU) and the Triton kernel (CUDA) agree only to rounding: both sides of the contract use one.

Entry points (T packed tokens, N sequences, cu_seqlens [N + 1]):
- `gated_delta_rule`: training (and any call that wants the final states back): from zero or
  given initial states [N, HV, DV, DK]; returns (o [T, HV, DV], final states [N, HV, DV, DK] fp32);
  differentiable (backward: autograd of this path on CPU, a reverse-recurrence kernel on CUDA).
- `gated_delta_rule_cached`: inference: the state cache [S, HV, DV, DK] fp32 is read at each
  sequence's slot (or 0 where `has_state` is False) and overwritten with its state after the call.
"""

import torch

from ..dispatch import backend_for
from ..reduction import row_sum
from .checks import check_gated_delta_inputs, check_slots, check_state
from .rules import gates, normalized_qk, stateful


def recurrence_torch(q_hat, k_hat, v, g, beta, cu_seqlens, h0):
    """o [T, HV, DV] fp32 and final states [N, HV, DV, DK] fp32 of the recurrence (module docstring).

    q_hat, k_hat: fp32 [T, HK, DK]; v [T, HV, DV]; g, beta fp32 [T, HV]; h0 [N, HV, DV, DK] fp32 or
    None. Step t advances every sequence still running at its position t; a finished sequence keeps
    its state (`torch.where` copies bits), so a sequence's bits do not depend on the others."""
    n_tokens, hk, dk = q_hat.shape
    hv, dv = v.shape[1], v.shape[2]
    n_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]  # [N]
    heads = torch.arange(hv, device=v.device) // (hv // hk)  # the k head of each v head
    state = torch.zeros(n_seqs, hv, dv, dk, device=v.device) if h0 is None else h0  # [N, HV, DV, DK]
    steps = int(lengths.max()) if n_seqs else 0
    outs = []
    for t in range(steps):
        live = (t < lengths)[:, None, None, None]  # [N, 1, 1, 1]
        rows = (cu[:-1] + t).clamp(max=max(n_tokens - 1, 0))  # [N]: the token at position t
        q_t = q_hat[rows][:, heads]  # [N, HV, DK]
        k_t = k_hat[rows][:, heads]
        decayed = state * torch.exp(g[rows])[:, :, None, None]  # S'
        u = v[rows].float() - row_sum(decayed * k_t[:, :, None, :])  # [N, HV, DV]
        delta = u * beta[rows][:, :, None]
        new = decayed + delta[..., None] * k_t[:, :, None, :]  # [N, HV, DV, DK]
        outs.append(row_sum(new * q_t[:, :, None, :]))  # [N, HV, DV]
        state = torch.where(live, new, state)
    if not outs:
        return torch.zeros(n_tokens, hv, dv, device=v.device), state
    seq = torch.repeat_interleave(torch.arange(n_seqs, device=v.device), lengths, output_size=n_tokens)
    pos = torch.arange(n_tokens, device=v.device) - cu[seq]
    o = torch.stack(outs).reshape(steps * n_seqs, hv, dv)[pos * n_seqs + seq]  # [T, HV, DV]
    return o, state


def gated_delta_rule_torch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state=None):
    q_hat, k_hat = normalized_qk(q, k)
    g, beta = gates(a, b, A_log, dt_bias)
    o, final = recurrence_torch(q_hat, k_hat, v, g, beta, cu_seqlens, initial_state)
    return o.to(v.dtype), final


def _gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state=None):
    from .recurrent_triton import gated_delta_rule_triton  # imported on first use: no Triton on CPU

    return gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)


def gated_delta_rule_cached_torch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, state_cache, slots, has_state):
    idx = slots.long()
    h0 = torch.where(stateful(slots, has_state)[:, None, None, None], state_cache[idx.clamp(min=0)], 0.0)
    o, final = gated_delta_rule_torch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, h0)  # h0: [N, HV, DV, DK]
    keep = idx >= 0  # -1: no slot
    state_cache[idx[keep]] = final[keep]
    return o


def _gated_delta_rule_cached_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, state_cache, slots, has_state):
    from .recurrent_triton import gated_delta_rule_cached_triton

    return gated_delta_rule_cached_triton(
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, state_cache, slots, has_state
    )


_IMPLS = {"torch": gated_delta_rule_torch, "triton": _gated_delta_rule_triton}
_CACHED_IMPLS = {"torch": gated_delta_rule_cached_torch, "triton": _gated_delta_rule_cached_triton}


def gated_delta_rule(
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
    """(o [T, HV, DV] in v's dtype, final states [N, HV, DV, DK] fp32) of packed sequences.

    q, k: [T, HK, DK] post-conv (not normalised); v: [T, HV, DV]; a, b: [T, HV] (the pre-activation
    gate inputs); A_log, dt_bias: [HV]; cu_seqlens: int [N + 1]; initial_state: fp32 [N, HV, DV, DK]
    (the transpose of transformers' [.., DK, DV] state) or None for zeros. Differentiable in every
    floating input."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    if initial_state is not None:
        check_state("initial_state", initial_state, n_seqs, v, k)
    return _IMPLS[backend_for(v)](q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)


def gated_delta_rule_cached(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_cache: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
) -> torch.Tensor:
    """o [T, HV, DV] of a prefill, chunked-prefill or decode step; the state cache is updated in place.

    Inputs as `gated_delta_rule`; state_cache: fp32 [S, HV, DV, DK] (each slot contiguous, the slots at
    any stride); slots: int [N] distinct (-1: no slot, the sequence's state is neither read nor written,
    as for a CUDA graph's padded request); has_state: bool [N] (False: the sequence starts in this call,
    from a zero state). Inference only."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    check_state("state_cache", state_cache, None, v, k, slot_strided=True)
    check_slots(slots, has_state, n_seqs, state_cache.shape[0], padded=True)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, a, b, A_log, dt_bias, state_cache)):
        raise ValueError("gated_delta_rule_cached is inference only: no input may need a gradient")
    return _CACHED_IMPLS[backend_for(v)](
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, state_cache, slots, has_state
    )
