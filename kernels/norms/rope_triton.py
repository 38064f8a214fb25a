"""Triton rotary position embedding, NeoX "rotate_half" style, optionally after a per-head RMSNorm
of q and k (Qwen3's q_norm / k_norm): the CUDA path of `rope.py`, q and k in ONE launch.

Math, as in `rope.py`: with R = rot_dim, x1 = x[..., :R/2], x2 = x[..., R/2:R] in fp32 and
c, s = cache[position] split in halves (fp32 cos | sin),
    out[..., :R/2]  = x1 * c - x2 * s
    out[..., R/2:R] = x2 * c + x1 * s
cast to the input dtype; dims past R are copied unchanged. With `qk_norm` = (q_weight, k_weight,
eps), x is first each head's RMSNorm, rounded to the input dtype: exactly `rms_norm(q, q_weight,
eps)` (rms_norm_triton.py's row math: one [BLOCK] row, one tree sum, the same warp count, so the
same bits; the CUDA tests compare). The backward is the rotation by -theta (the same kernel with s
negated: dx1 = g1 * c + g2 * s, dx2 = g2 * c - g1 * s), then RMSNorm's own backward
(rms_norm_triton.rms_norm_backward) with the rstd the forward saved.

Program (token t, HEADS_PER_PROGRAM of the Hq + Hkv heads, cos/sin read once): each head's whole
row gives the norm's rstd; the halves are normalised in registers with the norm's element math
(x * rstd * w, rounded to the dtype: the bits rms_norm_triton stores), rotated and stored once.
One head a program, with a store, barrier and reload between the norm and the rotation, took 8.4 us
a layer (8B, 256-token decode) against stock's fused 5.0; this layout takes 4.4 us
(`HEADS_PER_PROGRAM`). Stock vLLM fuses the same ops (q/k norm with RoPE);
four launches per layer become one.

Invariant: the only reduction is the norm's sum of squares over one head row of D elements, whose
tree depends on D alone; the rest is elementwise per (token, head, dim). A token's bits never
depend on the batch. Positions are not range-checked on the host for CUDA tensors (that needs a
device sync, which breaks CUDA-graph capture): an out-of-range position trips `tl.device_assert`
under TRITON_DEBUG=1 and otherwise reads cache row 0, never memory outside the cache. CPU tensors
(the interpreter) are checked on the host.
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from ..autograd_utils import backward_without_autocast
from ..checks import check_rope_inputs
from .rms_norm_triton import block_for, rms_norm_backward, warps_for


@triton.jit
def _rope_kernel(
    Q,
    K,
    QO,
    KO,
    QW,  # [D] q_norm weight (NORM only)
    KW,  # [D] k_norm weight (NORM only)
    Q_RSTD,  # [T, Hq] fp32 (NORM only): the norm's rstd, for the backward
    K_RSTD,  # [T, Hkv] fp32 (NORM only)
    POS,
    CACHE,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_c,
    n_q_heads,
    n_kv_heads,
    max_positions,
    eps,
    HALF: tl.constexpr,  # rot_dim / 2: fixed by the model
    HEAD_DIM: tl.constexpr,  # D: fixed by the model
    BLOCK_D: tl.constexpr,  # rms_norm_triton.block_for(D): the norm's row block (its tree)
    BLOCK_HALF: tl.constexpr,  # next_pow2(HALF)
    BLOCK_PASS: tl.constexpr,  # next_pow2(D - rot_dim), 1 if none
    NORM: tl.constexpr,  # RMSNorm each head first
    INVERSE: tl.constexpr,  # backward: rotate by -theta
    HEADS: tl.constexpr,  # heads a program (speed only: each head's math is the same)
):
    """Program (t, j): cos/sin of t's position once, then heads j * HEADS .. (j + 1) * HEADS - 1 of
    the Hq + Hkv, each by `_rope_head`."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    in_range = (pos >= 0) & (pos < max_positions)
    tl.device_assert(in_range, "rope: position out of the cache's range")
    pos = tl.where(in_range, pos, 0)  # never read outside the cache
    d = tl.arange(0, BLOCK_HALF)
    half_ok = d < HALF
    c = tl.load(CACHE + pos * stride_c + d, mask=half_ok, other=0.0)
    s = tl.load(CACHE + pos * stride_c + HALF + d, mask=half_ok, other=0.0)
    if INVERSE:
        s = -s
    for i in tl.static_range(HEADS):
        h = tl.program_id(1) * HEADS + i
        if h < n_q_heads:
            _rope_head(Q + t * stride_qt + h * stride_qh, QO + t * stride_qot + h * stride_qoh, QW,
                       Q_RSTD + t * n_q_heads + h, c, s, eps, HALF, HEAD_DIM, BLOCK_D, BLOCK_HALF, BLOCK_PASS, NORM)
        elif h < n_q_heads + n_kv_heads:
            hk = h - n_q_heads
            _rope_head(K + t * stride_kt + hk * stride_kh, KO + t * stride_kot + hk * stride_koh, KW,
                       K_RSTD + t * n_kv_heads + hk, c, s, eps, HALF, HEAD_DIM, BLOCK_D, BLOCK_HALF, BLOCK_PASS, NORM)


@triton.jit
def _rope_head(
    x_base, y_base, w_ptr, rstd_ptr, c, s, eps,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """One head's row: 1. (NORM) its rstd from the whole row; 2. the halves (NORM: normalised in
    registers, rounded to the dtype) rotated by (c, s) and stored; 3. the tail past rot_dim (NORM:
    normalised) stored."""
    d = tl.arange(0, BLOCK_HALF)
    half_ok = d < HALF
    x1 = tl.load(x_base + d, mask=half_ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF + d, mask=half_ok, other=0.0).to(tl.float32)
    if NORM:  # rms_norm_triton._rms_norm_fwd_kernel's one-chunk row: its tree, its element math
        cols = tl.arange(0, BLOCK_D)
        x = tl.load(x_base + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.math.div_rn(tl.reduce(x * x, 0, _sum_combine), HEAD_DIM * 1.0) + eps)
        tl.store(rstd_ptr, rstd)
        w1 = tl.load(w_ptr + d, mask=half_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=half_ok, other=0.0).to(tl.float32)
        x1 = (x1 * rstd * w1).to(y_base.dtype.element_ty).to(tl.float32)  # the norm's output, rounded
        x2 = (x2 * rstd * w2).to(y_base.dtype.element_ty).to(tl.float32)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    tl.store(y_base + d, y1.to(y_base.dtype.element_ty), mask=half_ok)
    tl.store(y_base + HALF + d, y2.to(y_base.dtype.element_ty), mask=half_ok)
    if HEAD_DIM > 2 * HALF:  # the tail past rot_dim: copied (NORM: normalised)
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        p_ok = p < HEAD_DIM
        tail = tl.load(x_base + p, mask=p_ok, other=0.0)
        if NORM:
            w_tail = tl.load(w_ptr + p, mask=p_ok, other=0.0).to(tl.float32)
            tail = (tail.to(tl.float32) * rstd * w_tail).to(y_base.dtype.element_ty)
        tl.store(y_base + p, tail, mask=p_ok)


# Heads a program: speed only (every head runs the same one-row code, see `_rope_head`). H100, q/k
# norm + RoPE of the 8B shape (40 heads), us for 1 / 2 / 4 / 8 heads a program:
# T = 16: 2.08 / 2.29 / 2.95 / 4.62; T = 256: 7.60 / 5.17 / 4.37 / 5.13; T = 8,192: 199 / 101 / 81 / 83.
# So HEADS_PER_PROGRAM, halved while the launch would have fewer than _FEW_PROGRAMS programs.
HEADS_PER_PROGRAM = 4
_FEW_PROGRAMS = 1024


def _heads_for(n_tokens: int, n_heads: int) -> int:
    heads = HEADS_PER_PROGRAM
    while heads > 1 and n_tokens * triton.cdiv(n_heads, heads) < _FEW_PROGRAMS:
        heads //= 2
    return heads


def _launch(q, k, positions, cache, norm=None, inverse=False):
    """q [T, Hq, D], k [T, Hkv, D] (last dim contiguous) -> (new contiguous q, k, rstd_q, rstd_k);
    norm = (q_weight, k_weight, eps) or None (then the rstds are None)."""
    n_tokens, n_q, head_dim = q.shape
    n_kv = k.shape[1]
    half = cache.shape[1] // 2
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rstd_q = rstd_k = None
    if norm is not None:
        rstd_q = torch.empty(n_tokens, n_q, dtype=torch.float32, device=q.device)
        rstd_k = torch.empty(n_tokens, n_kv, dtype=torch.float32, device=q.device)
    if n_tokens == 0 or n_q + n_kv == 0:
        return q_out, k_out, rstd_q, rstd_k
    q_w, k_w, eps = norm if norm is not None else (q, k, 0.0)  # dummies without a norm
    block_d = block_for(head_dim)
    heads = _heads_for(n_tokens, n_q + n_kv)
    _rope_kernel[(n_tokens, triton.cdiv(n_q + n_kv, heads))](
        q, k, q_out, k_out, q_w, k_w,
        rstd_q if norm is not None else q_out, rstd_k if norm is not None else k_out,
        positions, cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cache.stride(0), n_q, n_kv, cache.shape[0], float(eps),
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - 2 * half, 1)),
        NORM=norm is not None,
        INVERSE=inverse,
        HEADS=heads,
        num_warps=warps_for(block_d),  # the norm's warp count: part of its tree
    )  # fmt: skip
    return q_out, k_out, rstd_q, rstd_k


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, cache, q_weight, k_weight, eps):
        norm = (q_weight, k_weight, eps) if q_weight is not None else None
        q_out, k_out, rstd_q, rstd_k = _launch(q, k, positions, cache, norm)
        if norm is None:
            ctx.save_for_backward(positions, cache)
        else:
            ctx.save_for_backward(positions, cache, q, k, q_weight, k_weight, rstd_q, rstd_k)
        ctx.norm = norm is not None
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in (q_out, k_out)]  # for a missing gradient
        return q_out, k_out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_q, grad_k):
        positions, cache, *saved = ctx.saved_tensors
        grads = [
            torch.zeros(shape, dtype=dtype, device=device) if g is None else _rows(g)
            for g, (shape, dtype, device) in zip((grad_q, grad_k), ctx.out_meta)
        ]
        dq, dk, _, _ = _launch(*grads, positions, cache, inverse=True)
        if not ctx.norm:
            return dq, dk, None, None, None, None, None
        q, k, q_weight, k_weight, rstd_q, rstd_k = saved
        dq, dwq = rms_norm_backward(dq, q, q_weight, rstd_q.reshape(-1), None)
        dk, dwk = rms_norm_backward(dk, k, k_weight, rstd_k.reshape(-1), None)
        return dq, dk, None, None, dwq, dwk, None


def _rows(g: torch.Tensor) -> torch.Tensor:
    """A gradient with a contiguous last dim (what the kernel reads)."""
    return g if g.stride(-1) == 1 else g.contiguous()


def apply_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at positions [T] with the fp32 cache [P, rot_dim];
    with qk_norm = (q_weight [D], k_weight [D], eps), RMSNorm each head first (see above)."""
    check_rope_inputs(q, k, positions, cache, qk_norm)
    positions = positions.contiguous()
    q_w, k_w, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
    params = (q, k) if qk_norm is None else (q, k, q_w, k_w)
    if torch.is_grad_enabled() and any(t.requires_grad for t in params):
        return _RopeFunction.apply(q, k, positions, cache, q_w, k_w, float(eps))
    return _launch(q, k, positions, cache, qk_norm)[:2]
