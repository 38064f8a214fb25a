"""DeepSeek's multi-head latent attention (MLA), with K and V decompressed per head before attending.

Legend: T = tokens, H = hidden size, Hr = this rank's heads (all of them without tp), Dn =
qk_nope_head_dim, Dr = qk_rope_head_dim, D = Dn + Dr (the q/k head size), Dv = v_head_dim, C =
kv_lora_rank, Q = q_lora_rank. Parameter names are Hugging Face's (transformers' DeepseekV3Attention):
    q      = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with Q set           [T, Hr * D]
    q_nope, q_rot = split(q.view(T, Hr, D), [Dn, Dr])
    latent, k_rot = split(kv_a_proj_with_mqa(x), [C, Dr])                           [T, C], [T, Dr]
    kv     = kv_b_proj(kv_a_layernorm(latent)).view(T, Hr, Dn + Dv)
    k_nope, v = split(kv, [Dn, Dv])
    rope_interleave: q_rot, k_rot = their even dims, then their odd dims           (a gather: exact)
    q_rot, k_rot = apply_rope(q_rot, k_rot as one head, positions)                 NeoX halves, fp32, rounded once
    q = cat(q_nope, q_rot), k = cat(k_nope, k_rot on every head)                   [T, Hr, D]
    out = o_proj(attend(q, k, v, scale))                                           [T, Hr, Dv] -> [T, H]
The rotary table holds YaRN's attention factor (kernels/norms/rope.py); `scale` is DecoderConfig.attention_scale
(D^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2, as transformers' `yarn_apply_mscale`).

The attention context gets q/k of D dims and v of Dv (kernels.attention.causal: one position-anchored
reduction for both sizes), so training and every engine step attend over the same decompressed keys
and values; the vLLM cache holds them per head (K at D, V at Dv). `attn.attend` returns [T, Hr, Dv].

Tensor parallelism (tensor_parallel.py): q_proj / q_b_proj and kv_b_proj are column-sharded by heads
(each rank computes its heads' rows with the full reduction), the latent path (q_a_proj,
kv_a_proj_with_mqa, both norms) is replicated, the heads' outputs are gathered before the rank's
o_proj columns, whose output is gathered: all-gathers only, as in `layers.SelfAttention`.

Every op is a shared kernel (linear, rms_norm, apply_rope, attention) or an exact data movement
(split, gather of the interleaved dims, cat, expand), so the block keeps the decoder's invariants.
"""

from __future__ import annotations

import torch
from torch import nn

from vexact_vllm.kernels import apply_rope

from .attention_context import AttentionContext
from .config import DecoderConfig
from .layers import Linear, RMSNorm, RotaryCache
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
    """See the module docstring. `num_heads`, `num_kv_heads` (equal: K and V are per head), `head_dim`
    (D) and `value_head_dim` (Dv) are this rank's, as `layers.SelfAttention` exposes them."""

    def __init__(self, config: DecoderConfig, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        mla = config.mla
        self.layer_idx, self.tp = layer_idx, tp
        self.nope, self.rope_dim, self.value_head_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.head_dim, self.kv_lora_rank, self.interleave = config.head_dim, mla.kv_lora_rank, mla.rope_interleave
        self.scale = config.attention_scale
        heads = config.num_heads
        if tp is not None:
            kv_heads(heads, heads, tp)  # refuses a size that does not divide the heads
            heads //= tp.size
        self.num_heads = self.num_kv_heads = heads
        h, bias = config.hidden_size, mla.attention_bias
        q_size = config.num_heads * self.head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(h, q_size, bias, tp)
        else:
            self.q_a_proj = Linear(h, mla.q_lora_rank, bias)  # replicated
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_size, False, tp)
        self.kv_a_proj_with_mqa = Linear(h, mla.kv_lora_rank + self.rope_dim, bias)  # replicated
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, config.num_heads * (self.nope + self.value_head_dim), False, tp)
        o_in = config.num_heads * self.value_head_dim
        self.o_proj = Linear(o_in, h, bias, tp)
        self.sizes = (o_in, h)

    def forward(self, x, positions, rope: RotaryCache, attn: AttentionContext):
        t, heads = x.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(t, heads, self.head_dim).split([self.nope, self.rope_dim], dim=-1)  # [T, Hr, Dn|Dr]
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [T, C|Dr]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(t, heads, self.nope + self.value_head_dim)
        k_nope, v = kv.split([self.nope, self.value_head_dim], dim=-1)  # [T, Hr, Dn], [T, Hr, Dv]
        k_rot = k_rot.view(t, 1, self.rope_dim)  # [T, 1, Dr]: one rotary key head shared by all
        if self.interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = apply_rope(q_rot, k_rot, positions, rope.get(x.device))
        q = torch.cat([q_nope, q_rot], dim=-1)  # [T, Hr, D]
        k = torch.cat([k_nope, k_rot.expand(t, heads, self.rope_dim)], dim=-1)  # [T, Hr, D]
        out = attn.attend(self.layer_idx, q, k, v, self.scale)  # [T, Hr, Dv]
        out = out.reshape(t, heads * self.value_head_dim)
        if self.tp is None:
            return self.o_proj(out)
        return self.tp.gather(self.o_proj(self.tp.gather(out, self.sizes[0])), self.sizes[1])  # [T, H]
