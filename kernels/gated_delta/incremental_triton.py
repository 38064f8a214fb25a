"""Design C on Triton (the CUDA path of `incremental.py`): the training op with its autograd, and the
cached step that sends each sequence's rows to the step kernel (`incremental_step_triton.py`: the rows that
complete its partial chunk, or its decode row) and the rest, which start on a chunk boundary, to the chunk
kernels (`incremental_chunk_triton.py`). Both give a row the same bits (`incremental_tiles_triton.py`).

Backward (`incremental_triton_bwd.py`): the forward's scratch is recomputed, the chunks' gradients are
taken in reverse (fp32), and autograd of the torch rules carries them to q, k, a, b, A_log, dt_bias
(as design A's backward does); deterministic (DESIGN rule 7).
"""

import torch

from . import incremental_cache as layout
from .checks import check_gated_delta_inputs, check_slots, check_state
from .incremental_cache import check_decode_only
from .incremental_chunk_triton import chunk_forward
from .incremental_step_triton import step_forward
from .incremental_triton_bwd import chunk_backward
from .rules import gates, normalized_qk


def _check_gate_strides(a, b):
    for name, t in (("a", a), ("b", b)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state, store_t=False):
    """(o, states after each sequence's last full chunk, the chunk kernels' scratch)."""
    n_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    ids = torch.arange(n_seqs, device=v.device)
    if initial_state is None:
        final = torch.zeros(n_seqs, v.shape[1], v.shape[2], q.shape[2], dtype=torch.float32, device=v.device)
        h0, read = final, torch.full_like(ids, -1)
    else:
        final, h0, read = initial_state.clone(), initial_state.contiguous(), ids
    o = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    scratch = chunk_forward(q, k, v, a, b, A_log, dt_bias, cu[:-1], cu[1:], h0, read, final, ids, o, store_t=store_t)
    return o, final, scratch


class _IncrementalFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state):
        o, final, _ = _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
        ctx.save_for_backward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
        return o, final

    @staticmethod
    def backward(ctx, do, d_final):
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state = ctx.saved_tensors
        _, _, scratch = _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state, store_t=True)
        leaves = [t.detach().requires_grad_() for t in (q, k, a, b, A_log, dt_bias)]
        with torch.enable_grad():
            q_hat, k_hat = normalized_qk(leaves[0], leaves[1])
            g, beta = gates(*leaves[2:])
        if d_final is None:
            d_final = torch.zeros(cu_seqlens.shape[0] - 1, v.shape[1], v.shape[2], q.shape[2], device=v.device)
        cu = cu_seqlens.long()
        dq_hat, dk_hat, dv, dg, dbeta, dh0 = chunk_backward(v, do, d_final.contiguous(), scratch, cu[:-1], cu[1:])
        torch.autograd.backward([q_hat, k_hat, g, beta], [dq_hat, dk_hat, dg, dbeta])
        dq, dk, da, db, d_a_log, d_dt_bias = (t.grad for t in leaves)
        return dq, dk, dv.to(v.dtype), da, db, d_a_log, d_dt_bias, None, (dh0 if initial_state is not None else None)


def incremental_gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state=None):
    """`incremental.incremental_gated_delta_rule` on the Triton kernels."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    _check_gate_strides(a, b)
    if initial_state is not None:
        check_state("initial_state", initial_state, n_seqs, v, k)
    tensors = (q, k, v, a, b, A_log, dt_bias) + (() if initial_state is None else (initial_state,))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _IncrementalFunction.apply(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
    o, final, _ = _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
    return o, final


def incremental_gated_delta_rule_cached_triton(
    q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache, slots, has_state, decode_only=False
):
    """`incremental.incremental_gated_delta_rule_cached` on the Triton kernels. decode_only (one row a
    sequence): the step kernel alone, no host read (CUDA graphs); otherwise one host read for the split."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    _check_gate_strides(a, b)
    check_slots(slots, has_state, n_seqs, cache.check(k, v))
    check_decode_only(decode_only, q, cu_seqlens)
    cu = cu_seqlens.long()
    idx = slots.long()
    held = torch.where(has_state, cache.rows[idx].long(), 0)
    head = torch.ones_like(idx) if decode_only else layout.step_split(cu, held)
    read = torch.where(has_state, idx, -1)
    o = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    step_forward(q, k, v, a, b, A_log, dt_bias, o, cache, cu[:-1], head, held, idx, read)
    if not decode_only and bool((head < cu[1:] - cu[:-1]).any()):  # rows left for the chunk kernels
        read = torch.where(has_state | (head > 0), idx, -1)
        chunk_forward(q, k, v, a, b, A_log, dt_bias, cu[:-1] + head, cu[1:], cache.state, read, cache.state, idx, o,
                      cache=cache, cache_slot=idx)  # fmt: skip
    cache.rows[idx] = ((held + cu[1:] - cu[:-1]) % layout.CHUNK).to(torch.int32)
    return o
