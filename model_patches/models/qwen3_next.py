"""Qwen3-Next (`Qwen3NextForCausalLM`, Qwen3-Next-80B-A3B): the hybrid decoder of `model_patches.hybrid`
(Gated DeltaNet on the "linear_attention" layers, gated full attention with partial rotary on the others,
zero-centred norms) with Qwen3-Next's fused Gated DeltaNet projections and its MoE.

Gated DeltaNet projections (transformers' `fix_query_key_value_ordering`), r = HV / HK value heads per
key head, the outputs grouped by key head:
    in_proj_qkvz(x).view(T, HK, 2 DK + 2 r DV)  ->  q [DK], k [DK], v [r DV], z [r DV] of each key head
    in_proj_ba(x).view(T, HK, 2 r)              ->  b [r], a [r] of each key head
q, k and v are then gathered into the conv's channel order (all q, all k, all v); the two projections
run as one GEMM (`PackedLinear`). The rest of the layer is model_patches/gated_delta.py.

Feed-forward: on layer i, `moe.GatedSharedExpertMoeBlock` (softmax top-k with `norm_topk_prob`, plus the
sigmoid-gated shared expert) when i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0
(transformers' rule), the dense SwiGLU MLP otherwise. Multi-token-prediction weights (`mtp.*`) are not
part of the model: the vLLM loader skips them (vllm_wrapper.py), transformers ignores them.
"""

from __future__ import annotations

import torch

from ..config import DecoderConfig, LinearAttentionConfig, MoeConfig
from ..gated_delta import GatedDeltaNet
from ..hybrid import HybridDecoder, check_attention_gate, linear_attention_layers
from ..layers import MLP, Linear, PackedLinear
from ..moe import GatedSharedExpertMoeBlock, check_expert_tensors


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """`linear_attn` with the fused `in_proj_qkvz` / `in_proj_ba` (module docstring)."""

    def __init__(self, config: DecoderConfig, layer_idx: int, tp=None):
        super().__init__(config, layer_idx, tp)
        w, h = self.whole, config.hidden_size
        group = 2 * w.head_k_dim + 2 * (w.num_v_heads // w.num_k_heads) * w.head_v_dim  # rows per key head
        ba = 2 * (w.num_v_heads // w.num_k_heads)
        heads = (self.k_first, self.k_first + self.linear.num_k_heads)  # with tp: the rank's key heads' groups
        self.in_proj_qkvz = Linear(h, w.num_k_heads * group, tp=tp, rows=(heads[0] * group, heads[1] * group))
        self.in_proj_ba = Linear(h, w.num_k_heads * ba, tp=tp, rows=(heads[0] * ba, heads[1] * ba))
        self.in_proj = PackedLinear([self.in_proj_qkvz, self.in_proj_ba])

    def project(self, x: torch.Tensor):
        lin, t = self.linear, x.shape[0]
        hk, dk, dv, r = lin.num_k_heads, lin.head_k_dim, lin.head_v_dim, lin.num_v_heads // lin.num_k_heads
        qkvz, ba = self.in_proj(x).split(self.in_proj.sizes, dim=-1)
        qkvz = qkvz.view(t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)  # per key head
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)  # [T, C]
        b, a = ba.view(t, hk, 2 * r).split([r, r], dim=-1)
        return qkv, z.reshape(t, lin.num_v_heads, dv), b.reshape(t, -1), a.reshape(t, -1)


def sparse_layers(hf_config) -> tuple[int, ...]:
    """transformers' rule for which layers get the MoE block."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    if hf_config.num_experts <= 0:
        return ()
    return tuple(i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def decoder_fields(hf_config) -> dict:
    """What a Qwen3-Next config adds to the shared DecoderConfig."""
    check_attention_gate(hf_config)
    bias = bool(getattr(hf_config, "attention_bias", False))
    moe = None
    if hf_config.num_experts > 0:
        moe = MoeConfig(
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            norm_topk_prob=bool(hf_config.norm_topk_prob),
            sparse_layers=sparse_layers(hf_config),
            shared_intermediate_size=hf_config.shared_expert_intermediate_size,
        )
    linear = LinearAttentionConfig(
        layers=linear_attention_layers(hf_config),
        num_k_heads=hf_config.linear_num_key_heads,
        num_v_heads=hf_config.linear_num_value_heads,
        head_k_dim=hf_config.linear_key_head_dim,
        head_v_dim=hf_config.linear_value_head_dim,
        conv_kernel=hf_config.linear_conv_kernel_dim,
    )
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True, moe=moe, linear=linear)


class Qwen3NextDecoder(HybridDecoder):
    def linear_attention(self, config: DecoderConfig, layer_idx: int):
        return Qwen3NextGatedDeltaNet(config, layer_idx, self.tp)

    def mlp(self, config: DecoderConfig, layer_idx: int):
        if config.moe is not None and layer_idx in config.moe.sparse_layers:
            return GatedSharedExpertMoeBlock(config, self.tp)
        return MLP(config, self.tp)


def check_checkpoint(names: set[str], config: DecoderConfig) -> None:
    """Every expert's tensors on every sparse layer."""
    if config.moe is not None:
        check_expert_tensors(names, config)
