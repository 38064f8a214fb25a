"""Batch-invariant depthwise causal conv1d + SiLU with a cached conv state (Gated DeltaNet's q|k|v conv).

Math, per token t at position p of its sequence and channel c (fp32, taps oldest first):
    acc = fp32(bias_c) (0 without bias)
    acc = acc + fp32(w[c, j]) * fp32(x[p - (W - 1) + j, c])     for j = 0 .. W - 1
    y   = (acc / (1 + exp(-acc))).to(x.dtype)                     SiLU, rounded once
An input before the call's first row comes from the sequence's conv state (its W - 1 last raw inputs,
`conv_state[slot]`, when `has_state`), else it is 0 (a sequence's start). With a state, the call
leaves the sequence's W - 1 last raw inputs (state rows, then the call's rows) in `conv_state[slot]`.

Invariant: a token's output is W products added in one order onto the bias, elementwise over
channels: the same bits whether the token is decoded alone (its taps from the state), prefilled in
any chunking, or sits in a packed training batch. The state keeps raw inputs, never conv outputs.

Differences from transformers' torch fallback (`causal_conv1d_fn` / `_update`): it runs `F.conv1d`
in the weight dtype and rounds the conv output to bf16 before SiLU; here SiLU takes the fp32 sum and
rounds once, as the `causal_conv1d` CUDA kernels (transformers' hub kernel, vLLM) do. Layouts: x is
[T, C] (transformers: [B, C, L]); the state is [S, W - 1, C] (transformers and vLLM: [.., C, W - 1]).
The conv of the state's inputs gets no gradient (training starts every sequence at 0).
"""

import torch

from ..dispatch import backend_for
from .checks import check_conv_inputs
from .rules import per_row_sequences, stateful, token_sequences


class _SiLU(torch.autograd.Function):
    """a / (1 + exp(-a)) with the NaN-free gradient s (1 + a (1 - s)), s = 1 / (1 + exp(-a))."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a / (1.0 + torch.exp(-a))

    @staticmethod
    def backward(ctx, grad):
        (a,) = ctx.saved_tensors
        s = 1.0 / (1.0 + torch.exp(-a))
        return grad * s * (1.0 + a * (1.0 - s))


def conv_taps_torch(x, conv_state, slots, has_state, seq, pos, width):
    """The W tap inputs of every token, [W, T, C] in x's dtype (tap 0 oldest): rows of the call where
    the position allows, else state rows (or 0)."""
    n_tokens = x.shape[0]
    if conv_state is not None:  # each row's slot and whether it reads it (padding rows, seq N: none)
        row_slot = per_row_sequences(slots.long().clamp(min=0), 0)[seq]
        row_reads = per_row_sequences(stateful(slots, has_state), False)[seq][:, None]
    taps = []
    for j in range(width):
        back = width - 1 - j  # how many rows before the token
        inside = (pos >= back)[:, None]  # [T, 1]
        own = x[(torch.arange(n_tokens, device=x.device) - back).clamp(min=0)]  # [T, C]
        if conv_state is None:
            before = torch.zeros_like(own)
        else:
            row = (width - 1 - back + pos).clamp(min=0, max=width - 2)  # state row of an earlier input
            before = torch.where(row_reads, conv_state[row_slot, row], torch.zeros_like(own))  # [T, C]
        taps.append(torch.where(inside, own, before))
    return torch.stack(taps)


def next_conv_state_torch(x, cu_seqlens, conv_state, slots, has_state, width):
    """[N, W - 1, C]: each sequence's W - 1 last raw inputs after the call (state rows, then the call's)."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]  # [N]
    rows = torch.arange(width - 1, device=x.device)
    src = (
        lengths[:, None] - (width - 1) + rows[None, :]
    )  # [N, W - 1]: position relative to the call's first row
    own = x[(cu[:-1, None] + src).clamp(min=0, max=max(x.shape[0] - 1, 0))]  # [N, W - 1, C]
    old = conv_state[slots.long().clamp(min=0)[:, None], (width - 1 + src).clamp(min=0, max=width - 2)]
    old = torch.where(stateful(slots, has_state)[:, None, None], old, torch.zeros_like(old))
    if x.shape[0] == 0:
        return old
    return torch.where((src >= 0)[:, :, None], own, old)


def causal_conv1d_torch(x, weight, bias, cu_seqlens, conv_state=None, slots=None, has_state=None):
    width = weight.shape[1]
    seq, pos = token_sequences(cu_seqlens, x.shape[0])
    taps = conv_taps_torch(x, conv_state, slots, has_state, seq, pos, width)  # [W, T, C]
    w32 = weight.float()
    acc = bias.float().expand(x.shape) if bias is not None else torch.zeros(x.shape, device=x.device)
    for j in range(width):
        acc = acc + w32[:, j] * taps[j].float()  # [T, C]
    y = _SiLU.apply(acc).to(x.dtype)
    if conv_state is not None:
        new_state = next_conv_state_torch(x, cu_seqlens, conv_state, slots, has_state, width)
        keep = slots >= 0  # -1: no slot
        conv_state[slots.long()[keep]] = new_state[keep]
    return y


def _causal_conv1d_triton(x, weight, bias, cu_seqlens, conv_state=None, slots=None, has_state=None):
    from .causal_conv1d_triton import causal_conv1d_triton  # imported on first use: no Triton on CPU

    return causal_conv1d_triton(x, weight, bias, cu_seqlens, conv_state, slots, has_state)


_IMPLS = {"torch": causal_conv1d_torch, "triton": _causal_conv1d_triton}


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    has_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of packed sequences: x [T, C], weight [C, W], bias [C] or None,
    cu_seqlens int [N + 1] -> y [T, C] in x.dtype.

    Training: no state (every sequence starts at position 0; gradients for x, weight, bias).
    Inference (prefill, chunked prefill, decode: one row per sequence): conv_state [S, W - 1, C] in
    x's dtype (each slot contiguous, the slots at any stride), slots int [N] (each sequence's slot; -1:
    none, the sequence's state is neither read nor written, as for a CUDA graph's padded request),
    has_state bool [N] (False: the sequence starts here); the slots are read, then hold the W - 1 last
    inputs."""
    check_conv_inputs(x, weight, bias, cu_seqlens, conv_state, slots, has_state)
    if (
        conv_state is not None
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (x, weight, bias))
    ):
        raise ValueError("causal_conv1d with a conv_state is inference only: no input may need a gradient")
    return _IMPLS[backend_for(x)](x, weight, bias, cu_seqlens, conv_state, slots, has_state)
