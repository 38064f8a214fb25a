"""How vLLM's hybrid cache spends KV blocks on a Gated DeltaNet model (Qwen3-Next, Qwen3.5): the
attention block size it settles on and the blocks a request holds, so that the check's preemption
composition can size a cache that must preempt (rollout.preemption_plan).

vLLM keeps the state layers' pages and the attention layers' pages in one pool of equal pages. It
raises the attention block size until an attention layer's page (block_size x K and V x KV heads x
head_dim x dtype bytes) holds a state layer's page (one slot of its state tensors:
model_patches/gated_delta.state_shapes / state_dtypes, a rank's heads), and groups the layers of each
kind into groups of one size (the smaller kind's layer count; the larger's when the two are within
1.5x), one page per layer of a group a block. A request then holds, per attention group, a block per
block_size tokens, and per state group one block whatever its length (vLLM's mamba cache mode "none"
keeps the latest state only). A block size asked for that already holds the state page is kept, so
the check asks for this one (a multiple of 64, vexact's attention and Gated DeltaNet chunk alike).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HybridBlocks:
    block_size: int  # tokens of an attention block, one page of the shared pool
    attention_groups: int  # blocks a request holds per block_size tokens
    state_groups: int  # blocks a request holds for its states, whatever its length

    def request_blocks(self, tokens: int) -> int:
        """Blocks a request holding `tokens` tokens takes from the pool."""
        return self.attention_groups * -(-tokens // self.block_size) + self.state_groups


def hybrid_blocks(model_path: str, dtype: str, tensor_parallel: int = 1, least: int = 64) -> HybridBlocks | None:
    """The geometry above for the checkpoint at `model_path` served in `dtype` on `tensor_parallel`
    ranks, with a block size of at least `least` tokens; None for a model without state layers."""
    from transformers import AutoConfig

    from vexact_vllm.model_patches.config import DecoderConfig
    from vexact_vllm.model_patches.gated_delta import state_dtypes, state_shapes

    config = DecoderConfig.from_hf(AutoConfig.from_pretrained(model_path))
    if config.linear is None:
        return None
    model_dtype = getattr(torch, dtype)
    shapes, dtypes = state_shapes(config.linear.shard(tensor_parallel)), state_dtypes(model_dtype)
    state_page = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    kv_heads = max(config.num_kv_heads // tensor_parallel, 1)  # vLLM replicates KV heads past their count
    per_token = 2 * kv_heads * config.head_dim * model_dtype.itemsize
    block = 64 * max(-(-state_page // (64 * per_token)), -(-least // 64))
    n_state = len(config.linear.layers)
    n_attention = config.num_layers - n_state
    size = min(n_state, n_attention)
    if max(n_state, n_attention) < 1.5 * size:
        size = max(n_state, n_attention)
    return HybridBlocks(block, -(-n_attention // size), -(-n_state // size))
