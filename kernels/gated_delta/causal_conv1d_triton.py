"""Triton depthwise causal conv1d + SiLU with a cached conv state (the CUDA path of `causal_conv1d.py`).

Math, as in `causal_conv1d.py`: per token and channel, acc = bias, then acc += w[c, j] * x[tap j]
for the W taps oldest first (fp32), y = acc / (1 + exp(-acc)) rounded once to x's dtype. A tap before
the call's first row of its sequence reads the sequence's conv state (or 0 at a sequence's start).

Invariant: program (token, channel block) computes its token alone, from its own W taps, in one
order: a token's bits do not depend on the call's other rows, on where the call starts (the state
holds the raw inputs before it) or on the grid. The state update runs after the conv, as its own
launch (program per sequence and channel block: reads, then writes, its own slot only).

Backward (training: no state): `causal_conv1d_triton_bwd.py`, Triton kernels, deterministic; not
batch-invariant (DESIGN rule 7).
"""

import torch
import triton
import triton.language as tl

from .causal_conv1d_triton_bwd import conv_backward
from .checks import check_conv_inputs
from .rules import per_row_sequences, stateful, token_sequences

# Channels per program: tiles the elementwise work only (no reduction crosses channels).
_BLOCK_C = 256


@triton.jit(do_not_specialize=["n_tokens"])  # the batch must not select another kernel
def _conv_fwd_kernel(
    X, W, BIAS, Y, STATE, SEQ, POS, READ,
    n_tokens, stride_x, stride_y, stride_s, C,
    WIDTH: tl.constexpr,  # conv taps: fixed by the weight
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,  # _BLOCK_C
):  # fmt: skip
    """Program (token t, channel block): acc = bias; acc += w_j * x_j for j oldest to newest; SiLU."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    n = tl.load(SEQ + t)
    pos = tl.load(POS + t)
    slot = tl.load(READ + n).to(tl.int64)  # -1: no state (the sequence starts in this call)
    if HAS_BIAS:
        acc = tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        acc = tl.full([BLOCK_C], 0.0, tl.float32)
    zero = tl.full([BLOCK_C], 0, tl.int64)  # scalars in masks are broadcast first (the interpreter needs it)
    pos_c = zero + pos
    has_state = (zero + slot) >= 0
    for j in tl.static_range(WIDTH):
        back = WIDTH - 1 - j
        inside = pos_c >= back
        own = tl.load(X + (t - back) * stride_x + cols, mask=cmask & inside, other=0.0)
        row = WIDTH - 1 - back + pos  # the state row holding this tap when pos < back
        old = tl.load(
            STATE + slot * stride_s + row * C + cols, mask=cmask & ~inside & has_state, other=0.0
        )
        x = tl.where(inside, own, old).to(tl.float32)
        w = tl.load(W + cols * WIDTH + j, mask=cmask, other=0.0).to(tl.float32)
        acc += w * x
    y = tl.math.div_rn(acc, 1.0 + tl.exp(-acc))
    tl.store(Y + t * stride_y + cols, y.to(Y.dtype.element_ty), mask=cmask)


@triton.jit
def _conv_state_kernel(
    X, STATE, CU, READ, WRITE, stride_x, stride_s, C,
    WIDTH: tl.constexpr, ROWS: tl.constexpr,  # ROWS: next power of 2 >= WIDTH - 1
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program (sequence, channel block): the W - 1 last raw inputs (old state rows, then the call's
    rows) loaded first, then stored to the sequence's slot (none where WRITE is -1)."""
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    bos = tl.load(CU + n).to(tl.int64)
    length = tl.load(CU + n + 1).to(tl.int64) - bos
    read = tl.load(READ + n).to(tl.int64)
    write = tl.load(WRITE + n).to(tl.int64)
    rows = tl.arange(0, ROWS)
    src = length - (WIDTH - 1) + rows  # [ROWS]: position relative to the call's first row
    live = (rows < WIDTH - 1)[:, None] & cmask[None, :]
    own = tl.load(
        X + (bos + src)[:, None] * stride_x + cols[None, :], mask=live & (src >= 0)[:, None], other=0.0
    )
    old_rows = read * stride_s + (WIDTH - 1 + src)[:, None] * C + cols[None, :]
    has_state = (src * 0 + read) >= 0  # [ROWS]: the scalar broadcast first (the interpreter needs it)
    old = tl.load(STATE + old_rows, mask=live & ((src < 0) & has_state)[:, None], other=0.0)
    new = tl.where((src >= 0)[:, None], own, old)
    writes = (rows * 0 + write) >= 0  # [ROWS]
    tl.store(STATE + write * stride_s + rows[:, None] * C + cols[None, :], new, mask=live & writes[:, None])


def _forward(x, weight, bias, cu_seqlens, conv_state, slots, has_state):
    n_tokens, channels = x.shape
    width = weight.shape[1]
    n_seqs = cu_seqlens.shape[0] - 1
    weight = weight.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if conv_state is None:
        read = torch.full((n_seqs,), -1, dtype=torch.int64, device=x.device)
        state = x  # never read: every READ is -1
    else:
        read = torch.where(stateful(slots, has_state), slots.long(), -1)
        state = conv_state
    if n_tokens > 0:
        seq, pos = token_sequences(cu_seqlens, n_tokens)  # rows past the last sequence: seq N, no state
        read_rows = per_row_sequences(read, -1)
        grid = (n_tokens, triton.cdiv(channels, _BLOCK_C))
        _conv_fwd_kernel[grid](
            x, weight, bias if bias is not None else weight, y, state, seq, pos, read_rows,
            n_tokens, x.stride(0), y.stride(0), state.stride(0), channels,
            WIDTH=width, HAS_BIAS=bias is not None, BLOCK_C=_BLOCK_C, num_warps=4,
        )  # fmt: skip
    if conv_state is not None and n_seqs > 0:
        grid = (n_seqs, triton.cdiv(channels, _BLOCK_C))
        _conv_state_kernel[grid](
            x, conv_state, cu_seqlens, read, slots.long(), x.stride(0), conv_state.stride(0), channels,
            WIDTH=width, ROWS=triton.next_power_of_2(width - 1), BLOCK_C=_BLOCK_C, num_warps=4,
        )  # fmt: skip
    return y


class _CausalConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cu_seqlens):
        ctx.save_for_backward(x, weight, bias, cu_seqlens)
        return _forward(x, weight, bias, cu_seqlens, None, None, None)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens = ctx.saved_tensors
        dx, dw, db = conv_backward(dy, x, weight, bias, cu_seqlens)
        return dx, dw, db, None


def causal_conv1d_triton(x, weight, bias, cu_seqlens, conv_state=None, slots=None, has_state=None):
    """`causal_conv1d` on the Triton kernels: x [T, C], weight [C, W], bias [C] or None -> y [T, C]."""
    check_conv_inputs(x, weight, bias, cu_seqlens, conv_state, slots, has_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if needs_grad:
        if conv_state is not None:
            raise ValueError(
                "causal_conv1d with a conv_state is inference only: no input may need a gradient"
            )
        return _CausalConvFunction.apply(x, weight, bias, cu_seqlens)
    return _forward(x, weight, bias, cu_seqlens, conv_state, slots, has_state)
