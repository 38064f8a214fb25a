"""Triton rotary position embedding, NeoX "rotate_half" style (the CUDA path of `rope.py`).

Math, as in `rope.py`: with R = rot_dim, x1 = x[..., :R/2], x2 = x[..., R/2:R] in fp32 and
c, s = cache[position] split in halves (fp32 cos | sin),
    out[..., :R/2]  = x1 * c - x2 * s
    out[..., R/2:R] = x2 * c + x1 * s
cast to the input dtype; dims past R are copied unchanged. The backward is the rotation by -theta
(the same kernel with s negated): dx1 = g1 * c + g2 * s, dx2 = g2 * c - g1 * s.

Invariant: purely elementwise per (token, head, dim); no reduction. Each output element is the
same few fp32 operations on its own inputs, so a token's bits never depend on the batch.
Positions are not range-checked on the host for CUDA tensors (that needs a device sync, which
breaks CUDA-graph capture): an out-of-range position trips `tl.device_assert` under
TRITON_DEBUG=1 and otherwise reads cache row 0, never memory outside the cache. CPU tensors (the
interpreter) are checked on the host.
"""

import torch
import triton
import triton.language as tl

from ._autograd import backward_without_autocast
from .rope import _check

# Heads per program (at most); only tiles the elementwise work.
_MAX_HEADS_PER_PROGRAM = 16


@triton.jit
def _rope_kernel(
    X,
    Y,
    POS,
    CACHE,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_yh,
    stride_c,
    n_heads,
    max_positions,
    HALF: tl.constexpr,  # rot_dim / 2: fixed by the model
    HEAD_DIM: tl.constexpr,  # D: fixed by the model
    BLOCK_HALF: tl.constexpr,  # next_pow2(HALF)
    BLOCK_PASS: tl.constexpr,  # next_pow2(D - rot_dim), 1 if none
    BLOCK_H: tl.constexpr,  # heads per program
    INVERSE: tl.constexpr,  # backward: rotate by -theta
):
    """Program (token t, head block): 1. cos/sin of t's position; 2. rotate; 3. copy the tail."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    pos = tl.load(POS + t).to(tl.int64)
    in_range = (pos >= 0) & (pos < max_positions)
    tl.device_assert(in_range, "rope: position out of the cache's range")
    pos = tl.where(in_range, pos, 0)  # never read outside the cache
    c = tl.load(CACHE + pos * stride_c + d, mask=d < HALF, other=0.0)
    s = tl.load(CACHE + pos * stride_c + HALF + d, mask=d < HALF, other=0.0)
    if INVERSE:
        s = -s
    mask = (heads < n_heads)[:, None] & (d < HALF)[None, :]  # [BLOCK_H, BLOCK_HALF]
    x_base = X + t * stride_xt + heads[:, None] * stride_xh
    y_base = Y + t * stride_yt + heads[:, None] * stride_yh
    x1 = tl.load(x_base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c[None, :] - x2 * s[None, :]
    y2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(y_base + d[None, :], y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_base + HALF + d[None, :], y2.to(Y.dtype.element_ty), mask=mask)
    if HEAD_DIM > 2 * HALF:
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        p_mask = (heads < n_heads)[:, None] & (p < HEAD_DIM)[None, :]
        tail = tl.load(x_base + p[None, :], mask=p_mask, other=0.0)
        tl.store(y_base + p[None, :], tail, mask=p_mask)


def _launch(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x: [T, H, D] (last dim contiguous) -> new contiguous [T, H, D] in x.dtype."""
    n_tokens, n_heads, head_dim = x.shape
    half = cache.shape[1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_tokens == 0 or n_heads == 0:
        return y
    block_h = min(triton.next_power_of_2(n_heads), _MAX_HEADS_PER_PROGRAM)
    grid = (n_tokens, triton.cdiv(n_heads, block_h))
    _rope_kernel[grid](
        x,
        y,
        positions,
        cache,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
        cache.stride(0),
        n_heads,
        cache.shape[0],
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - 2 * half, 1)),
        BLOCK_H=block_h,
        INVERSE=inverse,
        num_warps=4,
    )
    return y


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, cache):
        ctx.save_for_backward(positions, cache)
        return _launch(q, positions, cache, False), _launch(k, positions, cache, False)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_q, grad_k):
        positions, cache = ctx.saved_tensors
        dq = _launch(grad_q, positions, cache, True) if ctx.needs_input_grad[0] else None
        dk = _launch(grad_k, positions, cache, True) if ctx.needs_input_grad[1] else None
        return dq, dk, None, None


def apply_rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at positions [T] with the fp32 cache [P, rot_dim]."""
    _check(q, k, positions, cache)
    positions = positions.contiguous()
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RopeFunction.apply(q, k, positions, cache)
    return _launch(q, positions, cache, False), _launch(k, positions, cache, False)
