"""Qwen3.5, dense and MoE (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the language model of the
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` checkpoints, served text only):
the hybrid decoder of `model_patches.hybrid` (Gated DeltaNet on the "linear_attention" layers, gated
full attention with partial rotary on the others, zero-centred norms) with Qwen3.5's separate Gated
DeltaNet projections:
    in_proj_qkv(x)  [T, C]: q | k | v, the conv's channel order already
    in_proj_z(x)    [T, HV DV],  in_proj_b(x), in_proj_a(x)  [T, HV]
run as one GEMM (`PackedLinear`). The rest of the layer is model_patches/gated_delta.py.

Feed-forward: the dense SwiGLU MLP on every layer (Qwen3.5), or `moe.GatedSharedExpertMoeBlock` on every
layer (Qwen3.5-MoE: softmax top-k always renormalised, as transformers' Qwen3_5MoeTopKRouter, plus the
sigmoid-gated shared expert).

A vision-language checkpoint's config is read through its `text_config` (config.py); its weights
`model.language_model.*` load as `model.*` and its vision tower `model.visual.*` is skipped (the vLLM
loader, vllm_wrapper.py; transformers' own conversion for the training class, trainers/hf_causal_lm.py).
Requests with images or video are refused. Multi-token-prediction weights (`mtp.*`) are not part of
the model: the vLLM loader skips them, transformers ignores them.
"""

from __future__ import annotations

import torch

from ..config import DecoderConfig, LinearAttentionConfig, MoeConfig
from ..gated_delta import GatedDeltaNet
from ..hybrid import HybridDecoder, check_attention_gate, linear_attention_layers
from ..layers import MLP, Linear, PackedLinear
from ..moe import GatedSharedExpertMoeBlock, check_expert_tensors


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """`linear_attn` with the separate `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (module docstring)."""

    def __init__(self, config: DecoderConfig, layer_idx: int, tp=None):
        super().__init__(config, layer_idx, tp)
        w, h = self.whole, config.hidden_size  # with tp: the rank's channels and value heads of each
        self.in_proj_qkv = Linear(h, w.conv_dim, tp=tp, rows=self.channel_blocks())
        self.in_proj_z = Linear(h, w.num_v_heads * w.head_v_dim, tp=tp, rows=self.v_heads(w.head_v_dim))
        self.in_proj_b = Linear(h, w.num_v_heads, tp=tp, rows=self.v_heads(1))
        self.in_proj_a = Linear(h, w.num_v_heads, tp=tp, rows=self.v_heads(1))
        self.in_proj = PackedLinear([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def project(self, x: torch.Tensor):
        lin, t = self.linear, x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(self.in_proj.sizes, dim=-1)
        return qkv, z.reshape(t, lin.num_v_heads, lin.head_v_dim), b, a


def is_moe(hf_config) -> bool:
    return hf_config.model_type in ("qwen3_5_moe", "qwen3_5_moe_text")


def decoder_fields(hf_config) -> dict:
    """What a Qwen3.5 (text) config adds to the shared DecoderConfig."""
    check_attention_gate(hf_config)
    bias = bool(getattr(hf_config, "attention_bias", False))
    moe = None
    if is_moe(hf_config):
        moe = MoeConfig(
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            norm_topk_prob=True,
            sparse_layers=tuple(range(hf_config.num_hidden_layers)),
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


class Qwen3_5Decoder(HybridDecoder):
    def linear_attention(self, config: DecoderConfig, layer_idx: int):
        return Qwen3_5GatedDeltaNet(config, layer_idx, self.tp)

    def mlp(self, config: DecoderConfig, layer_idx: int):
        if config.moe is not None:
            return GatedSharedExpertMoeBlock(config, self.tp)
        return MLP(config, self.tp)


def check_checkpoint(names: set[str], config: DecoderConfig) -> None:
    """Every expert's tensors on every layer (MoE), under the language model's names."""
    if config.moe is not None:
        check_expert_tensors({n.replace("model.language_model.", "model.", 1) for n in names}, config)
