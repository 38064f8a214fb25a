"""Attention contexts: the one thing that differs between training and inference.

The shared model calls `ctx.attend(layer_idx, q, k, v, scale)`; the context decides where keys and
values come from. `PackedAttention` (training) reads them from the packed batch described by
`cu_seqlens`; the vLLM side (`vexact_vllm.attention`) writes them to the paged KV cache first and
reads them back from there. Both end in the same position-anchored kernel core, so a query at
absolute position p reduces over the same key tiles in the same order on both sides.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vexact_vllm.kernels import varlen_attention


class AttentionContext(Protocol):
    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], causal per sequence."""
        ...


class PackedAttention:
    """Training: sequences packed back to back; sequence b holds rows cu_seqlens[b]:cu_seqlens[b+1]."""

    def __init__(self, cu_seqlens: torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0:
            raise ValueError("cu_seqlens must be a 1-D tensor [B+1] starting at 0")
        self.cu_seqlens = cu_seqlens

    def attend(self, layer_idx, q, k, v, scale):
        return varlen_attention(q, k, v, self.cu_seqlens, scale)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed rows: a new sequence starts wherever the position resets to 0 (the padding-free
    convention of transformers, verl and VeOmni)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed position_ids must start each sequence at 0")
    end = torch.tensor([pos.numel()], device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)
