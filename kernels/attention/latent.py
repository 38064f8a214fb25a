"""The latent layout of DeepSeek's MLA in the attention kernels, and its training backward.

The latent (model_patches/mla.py): one key head per token whose row holds C latent dims then R rotary
dims, and values that are the key row's first C dims (the same cells, a view: `values_in_keys`). The
forward runs the shared core (`core_triton.attend_tile`: one load of a key row serves both products;
the score is the latent dot chained with the rotary dot), through the same entry points as every
other attention, so training, prefill, chunked prefill and decode keep one reduction order.

`latent_attention_backward` (training only: correct and deterministic, not batch-invariant) recomputes
the probabilities from the forward's log-sum-exp, a sequence and a block of queries at a time, and
sums the one key head's gradient over every query head and query in a fixed order (the elementwise
passes between the products in `latent_scores_triton.py` where its kernels run, torch ops elsewhere):
with s = scale q.k, p = exp(s - lse), D_i = sum_c dO_i O_i,
    dV_j = sum_{i,h} p_ij dO_i,   dP_ij = dO_i . V_j,   dS_ij = p_ij (dP_ij - D_i) scale,
    dQ_i = sum_j dS_ij K_j,       dK_j = sum_{i,h} dS_ij Q_i
(causal: j <= i within a sequence). Every product is one matrix product with fp32 results, whose
operands are the inputs' dtype (bf16 / fp16: p and dS are rounded to it first, as FlashAttention's
backward and `varlen_triton_bwd` do; on CUDA cuBLAS's tensor cores write fp32 straight out) or fp32.
The values' gradient reaches the key row's first C dims through the view, so the caller's latent
tensor gets dK + (dV, 0).
"""

from __future__ import annotations

import math

import torch

# Largest [queries, heads, keys] fp32 block of probabilities formed at once (elements): memory only. A
# block's products reach its last query's keys only. Fewer, larger blocks are faster: on the H200 at 16
# heads, blocks of at most 256 queries (less of the causal square computed) took 16.7 ms for 8 x 1k
# tokens against 7.0 in one block a sequence (not profiled; likely the host's launches of the small products).
_BLOCK_ELEMENTS = 1 << 26
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def values_in_keys(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether v is the first cells of k's rows in one key head (the latent): the same storage,
    strides and leading shape, fewer dims."""
    return (
        k.shape[-2] == 1
        and v.shape[:-1] == k.shape[:-1]
        and v.shape[-1] < k.shape[-1]
        and v.data_ptr() == k.data_ptr()
        and v.stride() == k.stride()
    )


def latent_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens, scale):
    """(dq [T, Hq, C + R], dk [T, 1, C + R], dv [T, 1, C]) of the latent attention over packed
    sequences; lse [T, Hq] in log2 units (the forward's)."""
    n_tokens, n_heads, dim = q.shape
    c = v.shape[-1]
    dq = torch.zeros(n_tokens, n_heads, dim, dtype=torch.float32, device=q.device)
    dk = torch.zeros(n_tokens, dim, dtype=torch.float32, device=q.device)
    dv = torch.zeros(n_tokens, c, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds, bounds[1:]):
        if hi > lo:
            _sequence_backward(grad_out[lo:hi], q[lo:hi], k[lo:hi, 0], out[lo:hi], lse[lo:hi], scale,
                               dq[lo:hi], dk[lo:hi], dv[lo:hi])  # fmt: skip
    return dq.to(q.dtype), dk[:, None].to(k.dtype), dv[:, None].to(v.dtype)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a @ b of operands in one dtype: bf16 / fp16 on CUDA through cuBLAS's fp32 output (fp32
    accumulation on tensor cores), else the operands' values in fp32."""
    if a.is_cuda and a.dtype in _LOW_PRECISION:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _scores_kernels(device: torch.device):
    """The elementwise passes' Triton kernels (`latent_scores_triton`) on CUDA; None elsewhere (torch ops).
    Imported on first use: importing the kernels must not import Triton (a CPU install may lack it)."""
    if device.type != "cuda":
        return None
    from . import latent_scores_triton

    return latent_scores_triton


def _sequence_backward(do, q, kv, out, lse, scale, dq, dk, dv):
    """One sequence (positions 0 .. L - 1), query blocks in order; writes dq, accumulates dk, dv."""
    length, n_heads, dim = q.shape
    c = dv.shape[-1]
    operand = q.dtype if q.dtype in _LOW_PRECISION else torch.float32  # the products' operand dtype
    scores = _scores_kernels(q.device)
    kv = kv.to(operand)  # [L, C + R]
    delta = (do.float() * out.float()).sum(-1)  # [L, H]
    step = max(1, _BLOCK_ELEMENTS // (n_heads * length))
    pos = torch.arange(length, device=q.device)
    for i0 in range(0, length, step):
        i1 = min(length, i0 + step)
        keys = kv[:i1]  # causal: no query of the block reaches past i1 - 1
        qb = q[i0:i1].reshape(-1, dim).to(operand)  # [Q H, C + R], rows (query, head)
        dob = do[i0:i1].reshape(-1, c).to(operand)  # [Q H, C]
        p = _mm(qb, keys.T)  # [Q H, K]: s, then p in place
        if scores is not None:
            p_op = scores.probabilities_(p, lse[i0:i1].reshape(-1).contiguous(), i0, n_heads, scale, operand)
        else:
            pv = p.view(i1 - i0, n_heads, i1)
            pv.mul_(scale).sub_(lse[i0:i1, :, None] * math.log(2.0)).exp_()
            pv.masked_fill_(pos[None, None, :i1] > pos[i0:i1, None, None], 0.0)  # causal
            p_op = p.to(operand)
        dv[:i1] += _mm(p_op.T, dob)
        ds = _mm(dob, keys[:, :c].T)  # [Q H, K]: dP, then dS = p (dP - D) scale
        d_rows = delta[i0:i1].reshape(-1)
        if scores is not None:
            ds = scores.score_gradients_(ds, p, d_rows.contiguous(), scale, operand)
        else:
            ds = ds.sub_(d_rows[:, None]).mul_(p).mul_(scale).to(operand)
        dq[i0:i1] = _mm(ds, keys).view(i1 - i0, n_heads, dim)
        dk[:i1] += _mm(ds.T, qb)
