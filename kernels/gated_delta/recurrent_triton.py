"""Triton gated delta rule, one recurrent kernel for training, prefill and decode (the CUDA path of
`recurrent.py`).

Math, as in `recurrent.py` (fp32; the state tile is S^T, rows v, columns k): per token,
    q_hat = q * rsqrt(sum q^2 + eps) * scale,  k_hat = k * rsqrt(sum k^2 + eps)
    g = -exp(A_log) * softplus(a + dt_bias),   beta = round_to_b_dtype(1 / (1 + exp(-b)))
    S' = exp(g) S;  u = v - sum_k S' k_hat;  S = S' + (beta u) k_hat^T;  o = sum_k S q_hat
with the formulas of rules.py evaluated in-kernel.

Invariant: program (v tile, sequence x v head) keeps its [BLOCK_V, BLOCK_K] fp32 state tile in
registers and walks its sequence's tokens in order. Every sum over d_k is one `tl.reduce` of a
tile whose shape (BLOCK_V, BLOCK_K) and warp count depend on (DK, DV) alone (`recurrent_config`), so
its order is fixed; training, prefill, chunked prefill and decode launch this one kernel with the
same constexprs (where the state comes from and goes to are runtime indices: -1 reads zeros and
writes nothing), and the state crosses calls in fp32. A token's bits therefore depend on nothing but
its sequence's inputs up to it: not on the batch, the chunking or the call.

Backward (`recurrent_triton_bwd.py`): the inputs of the recurrence are recomputed by the torch
rules (autograd carries their gradient back to q, k, a, b, A_log, dt_bias), a reverse-recurrence
kernel gives the recurrence's gradient; deterministic (DESIGN rule 7).
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from .checks import check_gated_delta_inputs, check_slots, check_state
from .recurrent_triton_bwd import recurrence_backward
from .rules import L2NORM_EPS, SOFTPLUS_THRESHOLD, gates, normalized_qk, qk_scale, stateful

# v rows of the state tile per program, and warps per program: they fix the layout of the tile,
# hence the order of every sum over d_k, so they are one value per (DK, DV) for every call.
BLOCK_V = 32
WARPS = 1


def recurrent_config(d_k: int, d_v: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, num_warps) of the recurrent kernels for head dims (d_k, d_v)."""
    return triton.next_power_of_2(d_k), min(BLOCK_V, triton.next_power_of_2(d_v)), WARPS


@triton.jit
def gate_values(A, B, a_row, b_row, decay, dt_bias, SOFTPLUS_MAX: tl.constexpr):
    """(g, beta) of one token and v head (fp32; beta rounded to B's dtype first)."""
    x = tl.load(A + a_row).to(tl.float32) + dt_bias
    soft = tl.where(x > SOFTPLUS_MAX, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_MAX))))
    b = tl.load(B + b_row).to(tl.float32)
    beta = tl.math.div_rn(1.0, 1.0 + tl.exp(-b)).to(B.dtype.element_ty).to(tl.float32)
    return -decay * soft, beta


@triton.jit
def l2_normalized(x, eps):
    """x * rsqrt(sum x^2 + eps) of a [BLOCK_K] fp32 vector (one tree sum of the fixed block)."""
    return x * tl.rsqrt(tl.reduce(x * x, 0, _sum_combine) + eps)


@triton.jit(do_not_specialize=["n_seqs"])  # the batch must not select another kernel
def _recurrent_fwd_kernel(
    Q, K, V, A, B, A_LOG, DT_BIAS, OUT, H0, HT, CU, READ, WRITE,
    n_seqs, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_ot, stride_oh, stride_h0, stride_ht, HV, RATIO, scale, eps,
    DK: tl.constexpr, DV: tl.constexpr,  # head dims (masks)
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,  # `recurrent_config`: fixed by (DK, DV)
    SOFTPLUS_MAX: tl.constexpr,
):  # fmt: skip
    """Program (v tile, sequence x v head): 1. state tile from H0[READ[n]] (or 0); 2. the tokens in
    order: normalise q, k, gates, decay, delta update, output; 3. state tile to HT[WRITE[n]]."""
    iv = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // RATIO
    bos = tl.load(CU + n).to(tl.int64)
    eos = tl.load(CU + n + 1).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = ok < DK
    mv = ov < DV
    tile = (hv * DV + ov[:, None]).to(tl.int64) * DK + ok[None, :]  # [BLOCK_V, BLOCK_K] in one head's state
    read = tl.load(READ + n).to(tl.int64)
    live = mv[:, None] & mk[None, :]
    h = tl.load(H0 + read * stride_h0 + tile, mask=live & ((ok * 0 + read)[None, :] >= 0), other=0.0)
    decay = tl.exp(tl.load(A_LOG + hv).to(tl.float32))
    dt_bias = tl.load(DT_BIAS + hv).to(tl.float32)
    for t in range(bos, eos):
        q = tl.load(Q + t * stride_qt + hk * stride_qh + ok, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(K + t * stride_kt + hk * stride_kh + ok, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(V + t * stride_vt + hv * stride_vh + ov, mask=mv, other=0.0).to(tl.float32)
        q = l2_normalized(q, eps) * scale
        k = l2_normalized(k, eps)
        g, beta = gate_values(A, B, t * stride_at + hv, t * stride_bt + hv, decay, dt_bias, SOFTPLUS_MAX)
        h = h * tl.exp(g)
        u = v - tl.reduce(h * k[None, :], 1, _sum_combine)  # [BLOCK_V]
        h = h + (u * beta)[:, None] * k[None, :]
        o = tl.reduce(h * q[None, :], 1, _sum_combine)
        tl.store(OUT + t * stride_ot + hv * stride_oh + ov, o.to(OUT.dtype.element_ty), mask=mv)
    write = tl.load(WRITE + n).to(tl.int64)
    tl.debug_barrier()  # every thread has read its tile of the slot before any writes it back
    tl.store(HT + write * stride_ht + tile, h, mask=live & ((ok * 0 + write)[None, :] >= 0))


def _launch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, h0, read, ht, write):
    """o [T, HV, DV] in v's dtype; the state after each sequence written to ht[write[n]]."""
    n_tokens, hk, d_k = q.shape
    hv, d_v = v.shape[1], v.shape[2]
    n_seqs = cu_seqlens.shape[0] - 1
    o = torch.empty(n_tokens, hv, d_v, dtype=v.dtype, device=v.device)
    block_k, block_v, warps = recurrent_config(d_k, d_v)
    if n_seqs == 0:
        return o
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()  # [HV], read at the v head's index
    grid = (triton.cdiv(d_v, block_v), n_seqs * hv)
    _recurrent_fwd_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, o, h0, ht, cu_seqlens, read, write,
        n_seqs, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0), o.stride(0), o.stride(1), h0.stride(0), ht.stride(0), hv, hv // hk, qk_scale(d_k), L2NORM_EPS,
        DK=d_k, DV=d_v, BLOCK_K=block_k, BLOCK_V=block_v, SOFTPLUS_MAX=SOFTPLUS_THRESHOLD, num_warps=warps,
    )  # fmt: skip
    return o


def _check_gate_strides(a, b):
    for name, t in (("a", a), ("b", b)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state):
    n_seqs = cu_seqlens.shape[0] - 1
    seq_ids = torch.arange(n_seqs, dtype=torch.int64, device=v.device)
    final = torch.empty(n_seqs, v.shape[1], v.shape[2], q.shape[2], dtype=torch.float32, device=v.device)
    if initial_state is None:
        h0, read = final, torch.full_like(seq_ids, -1)
    else:
        h0, read = initial_state, seq_ids
    o = _launch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, h0, read, final, seq_ids)
    return o, final


class _GatedDeltaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state):
        o, final = _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
        ctx.save_for_backward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
        return o, final

    @staticmethod
    def backward(ctx, do, d_final):
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state = ctx.saved_tensors
        leaves = [t.detach().requires_grad_() for t in (q, k, a, b, A_log, dt_bias)]
        with torch.enable_grad():
            q_hat, k_hat = normalized_qk(leaves[0], leaves[1])
            g, beta = gates(*leaves[2:])
        dq_hat, dk_hat, dv, dg, dbeta, dh0 = recurrence_backward(
            q_hat.detach(),
            k_hat.detach(),
            v,
            g.detach(),
            beta.detach(),
            do,
            d_final,
            initial_state,
            cu_seqlens,
            recurrent_config(q.shape[2], v.shape[2]),
        )
        torch.autograd.backward([q_hat, k_hat, g, beta], [dq_hat, dk_hat, dg, dbeta])
        dq, dk, da, db, d_a_log, d_dt_bias = (t.grad for t in leaves)
        return dq, dk, dv.to(v.dtype), da, db, d_a_log, d_dt_bias, None, dh0


def gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state=None):
    """`recurrent.gated_delta_rule` on the Triton kernels: (o [T, HV, DV], final states [N, HV, DV, DK])."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    _check_gate_strides(a, b)
    if initial_state is not None:
        check_state("initial_state", initial_state, n_seqs, v, k)
    tensors = (q, k, v, a, b, A_log, dt_bias) + (() if initial_state is None else (initial_state,))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _GatedDeltaFunction.apply(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
    return _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)


def gated_delta_rule_cached_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, state_cache, slots, has_state):
    """`recurrent.gated_delta_rule_cached` on the Triton kernel: o [T, HV, DV]; the cache updated in place."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    _check_gate_strides(a, b)
    check_state("state_cache", state_cache, None, v, k, slot_strided=True)
    check_slots(slots, has_state, n_seqs, state_cache.shape[0], padded=True)
    read = torch.where(stateful(slots, has_state), slots.long(), -1)
    return _launch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, state_cache, read, state_cache, slots.long())
