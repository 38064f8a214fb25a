"""Triton backward of the causal conv1d + SiLU (training: no conv state): deterministic (no atomics), not
batch-invariant (DESIGN rule 7). Forward in `causal_conv1d.py`; per token t at position p of its
sequence and channel c (x_j = the input j taps back, 0 before the sequence):
    acc = bias + sum_j w_j x[p - (W - 1) + j],  s = 1 / (1 + exp(-acc)),  da = dy s (1 + acc (1 - s))
    dx[t] = sum_j w_j da[t + W - 1 - j]        (the later tokens of the same sequence that read t)
    dw_j  = sum_t da[t] x[p - (W - 1) + j],    db = sum_t da[t]
Two launches over (token block, channel block) programs: 1. da (fp32) and each block's partial dw, db
(a fixed-shape sum over its tokens); 2. dx from da. The host adds the blocks' partials with a torch sum
(fixed order).
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from .rules import token_sequences

# Tokens and channels per program.
BLOCK_T = 32
BLOCK_C = 128


@triton.jit(do_not_specialize=["n_tokens"])
def _conv_bwd_da_kernel(
    X, W, BIAS, DY, POS, DA, DW_PART, DB_PART, n_tokens, stride_x, stride_dy, C,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program (token block, channel block): da of its tokens, and its partial dw [WIDTH, BLOCK_C], db."""
    tb = tl.program_id(0)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = (rows < n_tokens)[:, None] & (cols < C)[None, :]
    pos = tl.load(POS + rows, mask=rows < n_tokens, other=0)
    if HAS_BIAS:
        acc = tl.broadcast_to(tl.load(BIAS + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :], [BLOCK_T, BLOCK_C])
    else:
        acc = tl.full([BLOCK_T, BLOCK_C], 0.0, tl.float32)
    for j in tl.static_range(WIDTH):  # 1. the forward's sum, taps oldest first
        back = WIDTH - 1 - j
        inside = live & (pos >= back)[:, None]
        x = tl.load(X + (rows - back)[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        acc += tl.load(W + cols * WIDTH + j, mask=cols < C, other=0.0).to(tl.float32)[None, :] * x
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-acc))
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=live, other=0.0).to(tl.float32)
    da = tl.where(live, dy * s * (1.0 + acc * (1.0 - s)), 0.0)
    tl.store(DA + rows[:, None] * C + cols[None, :], da, mask=live)
    for j in tl.static_range(WIDTH):  # 2. the block's share of dw, db
        back = WIDTH - 1 - j
        x = tl.load(X + (rows - back)[:, None] * stride_x + cols[None, :], mask=live & (pos >= back)[:, None],
                    other=0.0).to(tl.float32)  # fmt: skip
        tl.store(DW_PART + (tb * C + cols) * WIDTH + j, tl.reduce(da * x, 0, _sum_combine), mask=cols < C)
    tl.store(DB_PART + tb * C + cols, tl.reduce(da, 0, _sum_combine), mask=cols < C)


@triton.jit(do_not_specialize=["n_tokens"])
def _conv_bwd_dx_kernel(
    DA, W, EOS, DX, n_tokens, C, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program (token block, channel block): dx[t] = sum_j w_j da[t + W - 1 - j] within t's sequence."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = (rows < n_tokens)[:, None] & (cols < C)[None, :]
    eos = tl.load(EOS + rows, mask=rows < n_tokens, other=0)
    dx = tl.full([BLOCK_T, BLOCK_C], 0.0, tl.float32)
    for j in tl.static_range(WIDTH):
        later = rows + WIDTH - 1 - j  # the token that reads t as its tap j
        da = tl.load(DA + later[:, None] * C + cols[None, :], mask=live & (later < eos)[:, None], other=0.0)
        dx += tl.load(W + cols * WIDTH + j, mask=cols < C, other=0.0).to(tl.float32)[None, :] * da
    tl.store(DX + rows[:, None] * C + cols[None, :], dx, mask=live)


def conv_backward(dy, x, weight, bias, cu_seqlens):
    """(dx, dweight, dbias or None) in the inputs' dtypes of the training conv (no state)."""
    n_tokens, channels = x.shape
    width = weight.shape[1]
    device = x.device
    seq, pos = token_sequences(cu_seqlens, n_tokens)
    eos = cu_seqlens.long()[seq + 1]
    blocks = triton.cdiv(max(n_tokens, 1), BLOCK_T)
    da = torch.empty(n_tokens, channels, dtype=torch.float32, device=device)
    dw_part = torch.zeros(blocks, channels, width, dtype=torch.float32, device=device)
    db_part = torch.zeros(blocks, channels, dtype=torch.float32, device=device)
    dx = torch.empty(n_tokens, channels, dtype=torch.float32, device=device)
    weight = weight.contiguous()
    dy = dy.contiguous()
    if n_tokens:
        grid = (blocks, triton.cdiv(channels, BLOCK_C))
        _conv_bwd_da_kernel[grid](
            x, weight, bias if bias is not None else weight, dy, pos, da, dw_part, db_part, n_tokens,
            x.stride(0), dy.stride(0), channels, WIDTH=width, HAS_BIAS=bias is not None, BLOCK_T=BLOCK_T,
            BLOCK_C=BLOCK_C, num_warps=4,
        )  # fmt: skip
        _conv_bwd_dx_kernel[grid](da, weight, eos, dx, n_tokens, channels, WIDTH=width, BLOCK_T=BLOCK_T,
                                  BLOCK_C=BLOCK_C, num_warps=4)  # fmt: skip
    dw = dw_part.sum(0)  # the token blocks' partials, a fixed-order torch sum
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx.to(x.dtype), dw.to(weight.dtype), db
