"""DeepSeek's multi-head latent attention (MLA) in the absorbed form, on both sides.

Legend: T = tokens, H = hidden size, Hr = this rank's heads (all of them without tp), Dn =
qk_nope_head_dim, Dr = qk_rope_head_dim, D = Dn + Dr (the q head size), Dv = v_head_dim, C =
kv_lora_rank, Q = q_lora_rank. Parameter names are Hugging Face's (transformers' DeepseekV3Attention):
    q      = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with Q set           [T, Hr * D]
    q_nope, q_rot = split(q.view(T, Hr, D), [Dn, Dr])
    latent, k_rot = split(kv_a_proj_with_mqa(x), [C, Dr])                           [T, C], [T, Dr]
    c      = kv_a_layernorm(latent)                                                  [T, C]
    rope_interleave: q_rot, k_rot = their even dims, then their odd dims           (a gather: exact)
    q_rot, k_rot = apply_rope(q_rot, k_rot as one head, positions)                 NeoX halves, fp32, rounded once
    W_UK[h], W_UV[h] = the rows of head h in kv_b_proj.weight.view(Hr, Dn + Dv, C): [Dn, C], [Dv, C]
    q_lat  = head_linear(q_nope, W_UK^T)        q_nope[h] @ W_UK[h] per head          [T, Hr, C]
    q      = cat(q_lat, q_rot)                                                       [T, Hr, C + Dr]
    kv     = cat(c, k_rot)                      one key head shared by every query head  [T, 1, C + Dr]
    o_lat  = attend(q, k = kv, v = kv[..., :C], scale)                              [T, Hr, C]
    out    = o_proj(head_linear(o_lat, W_UV))   o_lat[h] @ W_UV[h]^T per head         [T, Hr * Dv] -> [T, H]
Exact arithmetic gives Hugging Face's materialized attention (q_nope . (W_UK c) = (W_UK^T q_nope) . c,
sum_j p_j W_UV c_j = W_UV sum_j p_j c_j); the roundings differ, bounded by the accuracy tests against
float64 (tests/model_patches/test_deepseek.py). The rotary table holds YaRN's attention factor
(kernels/norms/rope.py); `scale` is DecoderConfig.attention_scale (D^-0.5 times YaRN's
mscale(factor, mscale_all_dim)^2, as transformers' `yarn_apply_mscale`), unchanged by the absorption.

Why absorbed everywhere: the attention context gets one key head of C + Dr and values that are the
key's first C dims, so the vLLM cache holds per token and layer only the latent and the rotary key,
stock vLLM's MLA cache (vexact_vllm/attention.py), and training, prefill, chunked prefill, decode and
prefix-cache hits all attend over that row with one position-anchored reduction. The absorption and
the up-projection are `kernels.head_linear` over views of `kv_b_proj.weight`: one reduction order per
weight shape, no copy, so verl's weight sync is seen at once and the gradient reaches the parameter.

Tensor parallelism (tensor_parallel.py): q_proj / q_b_proj and kv_b_proj are column-sharded by heads
(each rank computes its heads' rows with the full reduction; W_UK and W_UV are views of the rank's
rows), the latent path (q_a_proj, kv_a_proj_with_mqa, both norms) is replicated, so every rank holds
the whole latent (as stock vLLM); the heads' outputs are gathered before the rank's o_proj columns,
whose output is gathered: column blocks exchanged only (`TensorParallel.gather`), as in `layers.SelfAttention`.

Every op is a shared kernel (linear, head_linear, rms_norm, apply_rope, attention) or an exact data
movement (split, gather of the interleaved dims, cat, views), so the block keeps the decoder's invariants.
"""

from __future__ import annotations

import torch
from torch import nn

from vexact_vllm.kernels import apply_rope, head_linear

from .attention_context import AttentionContext
from .config import DecoderConfig
from .layers import Linear, RMSNorm, RotaryCache, gathered_linear
from .tensor_parallel import TensorParallel, kv_heads

# transformers' DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm are built without the
# config's rms_norm_eps (Moonlight's 1e-5 applies to the hidden-state norms only).
LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., 2n] (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek's interleaved rotary pairs
    in the NeoX halves `apply_rope` rotates (transformers' `apply_rotary_pos_emb_interleave` rotates the
    same pairs and returns them in this layout)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MlaAttention(nn.Module):
    """See the module docstring. Its attention geometry, as `layers.SelfAttention` exposes it:
    `num_heads` (Hr, this rank's), `num_kv_heads` 1 (the latent), `head_dim` C + Dr (the key row)
    and `value_head_dim` C (the latent the heads attend to)."""

    def __init__(self, config: DecoderConfig, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        mla = config.mla
        self.layer_idx, self.tp = layer_idx, tp
        self.nope, self.rope_dim, self.v_head_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_head_dim, self.kv_lora_rank, self.interleave = config.head_dim, mla.kv_lora_rank, mla.rope_interleave
        self.scale = config.attention_scale
        heads = config.num_heads
        if tp is not None:
            kv_heads(heads, heads, tp)  # refuses a size that does not divide the heads
            heads //= tp.size
        self.num_heads, self.num_kv_heads = heads, 1
        self.head_dim, self.value_head_dim = self.kv_lora_rank + self.rope_dim, self.kv_lora_rank
        h, bias = config.hidden_size, mla.attention_bias
        q_size = config.num_heads * self.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(h, q_size, bias, tp)
        else:
            self.q_a_proj = Linear(h, mla.q_lora_rank, bias)  # replicated
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_size, False, tp)
        self.kv_a_proj_with_mqa = Linear(h, mla.kv_lora_rank + self.rope_dim, bias)  # replicated
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, config.num_heads * (self.nope + self.v_head_dim), False, tp)
        o_in = config.num_heads * self.v_head_dim
        self.o_proj = Linear(o_in, h, bias, tp)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK^T [Hr, C, Dn], W_UV [Hr, Dv, C]): views of this rank's kv_b_proj.weight rows."""
        per_head = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, self.kv_lora_rank)
        return per_head[:, : self.nope].transpose(1, 2), per_head[:, self.nope :]

    def forward(self, x, positions, rope: RotaryCache, attn: AttentionContext):
        t, heads, rank = x.shape[0], self.num_heads, self.kv_lora_rank
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(t, heads, self.qk_head_dim).split([self.nope, self.rope_dim], dim=-1)  # [T, Hr, Dn|Dr]
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([rank, self.rope_dim], dim=-1)  # [T, C|Dr]
        c = self.kv_a_layernorm(latent)  # [T, C]
        k_rot = k_rot.view(t, 1, self.rope_dim)  # [T, 1, Dr]: one rotary key head shared by all
        if self.interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = apply_rope(q_rot, k_rot, positions, rope.get(x.device))
        w_uk_t, w_uv = self.absorbed_weights()
        q = torch.cat([head_linear(q_nope, w_uk_t), q_rot], dim=-1)  # [T, Hr, C + Dr]
        kv = torch.cat([c.view(t, 1, rank), k_rot], dim=-1)  # [T, 1, C + Dr]
        out = attn.attend(self.layer_idx, q, kv, kv[..., :rank], self.scale)  # [T, Hr, C]
        out = head_linear(out, w_uv).reshape(t, heads * self.v_head_dim)  # [T, Hr * Dv]
        return gathered_linear(self.o_proj, out, self.tp)  # [T, H]
