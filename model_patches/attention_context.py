"""Attention contexts: the one thing that differs between training and inference.

The shared model calls `ctx.attend(layer_idx, q, k, v, scale)`; the context decides where keys and
values come from. `PackedAttention` (training) reads them from the packed batch described by
`cu_seqlens`; the vLLM side (`vexact_vllm.attention`) writes them to the paged KV cache first and
reads them back from there. Both end in the same position-anchored kernel core, so a query at
absolute position p reduces over the same key tiles in the same order on both sides.

A recurrent (state) layer, Gated DeltaNet, calls `ctx.sequences(layer_idx, ...)` instead: the call's
sequences (`Sequences`) and, at inference, the layer's cached states (gated_delta.py uses them;
vexact_vllm/state_cache.py provides them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vexact_vllm.kernels import varlen_attention


class AttentionContext(Protocol):
    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], causal per sequence."""
        ...


    def sequences(self, layer_idx: int, num_rows: int, device: torch.device) -> Sequences:
        """The call's sequences for state layer `layer_idx`, whose input has `num_rows` rows on `device`
        (and, at inference, the layer's cached states)."""
        ...


@dataclass
class Sequences:
    """What a state layer (Gated DeltaNet) gets from its context. N = sequences of the call, T = rows.

    Training: every sequence starts at position 0, `states` is None. Inference: each sequence continues
    from the state in its cache slot (`has_state`; False: it starts in this call), the layer's state
    tensors `states` (their layout is the layer's: gated_delta.py) are read and updated in place, and
    `context_lens` says how many of its tokens the state already holds."""

    cu_seqlens: torch.Tensor  # int32 [N + 1]: sequence b's rows are cu_seqlens[b]:cu_seqlens[b + 1]
    num_tokens: int | None = None  # rows that are tokens (None: all); rows past them (padding) get zeros
    states: tuple[torch.Tensor, ...] | None = None  # this layer's cache, [slots, ...] each
    slots: torch.Tensor | None = None  # int32 [N]: each sequence's cache slot
    has_state: torch.Tensor | None = None  # bool [N]: the slot holds the sequence's earlier tokens
    context_lens: torch.Tensor | None = None  # int32 [N]: tokens of the sequence before this call
    decode_only: bool = False  # every sequence has one row (the kernels then read nothing on the host)
    split: object | None = None  # else the step's StepSplit (kernels/gated_delta/incremental_cache.py), or None


class PackedAttention:
    """Training: sequences packed back to back; sequence b holds rows cu_seqlens[b]:cu_seqlens[b+1]."""

    def __init__(self, cu_seqlens: torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0:
            raise ValueError("cu_seqlens must be a 1-D tensor [B+1] starting at 0")
        self.cu_seqlens = cu_seqlens

    def attend(self, layer_idx, q, k, v, scale):
        return varlen_attention(q, k, v, self.cu_seqlens, scale)

    def sequences(self, layer_idx, num_rows, device):
        return Sequences(self.cu_seqlens)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed rows: a new sequence starts wherever the position resets to 0 (the padding-free
    convention of transformers, verl and VeOmni)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed position_ids must start each sequence at 0")
    end = torch.tensor([pos.numel()], device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)
