"""The hybrid decoder of Qwen3-Next and Qwen3.5: Gated DeltaNet layers (gated_delta.py) interleaved with
gated full attention, zero-centred RMSNorms throughout.

Layer i is a Gated DeltaNet layer (`linear_attn`) when the config's `layer_types[i]` is
"linear_attention" (3 of every 4 by default) and a `GatedSelfAttention` layer (`self_attn`) when it is
"full_attention"; the family file gives the Gated DeltaNet's projections and each layer's feed-forward
block. Every hidden-state norm (`input_layernorm`, `post_attention_layernorm`, the final `norm`) and
the attention's q/k norms are `ZeroCentredRMSNorm`s (weight w applied as 1 + w); the Gated DeltaNet's
gated norm is a plain one.

`GatedSelfAttention` (transformers' Qwen3NextAttention / Qwen3_5Attention). T = tokens, Hq / Hkv =
query / key-value heads, D = head_dim (256), R = the rotated dims (partial_rotary_factor x D: 64):
    q_gate = q_proj(x).view(T, Hq, 2 D);  q, gate = q_gate[..., :D], q_gate[..., D:]   (per head: q, then its gate)
    k, v   = k_proj(x), v_proj(x)                                       [T, Hkv, D]
    q, k   = rope(q_norm(q), k_norm(k)) on their first R dims           (one kernel, kernels.apply_rope)
    out    = attend(q, k, v, D^-1/2)                                    position-anchored, as every family
    out    = out * sigmoid(gate)                                        fp32, rounded once (layers.sigmoid_gate)
    out    = o_proj(out)                                                [T, H]
q/k/v run as one GEMM (`PackedLinear`), as in `layers.SelfAttention`. Qwen3.5's rotary embedding is
multimodal (`mrope_section`: the rotated dims split over time, height and width positions); a text
token's three positions are one and the same, where it is the plain rotation used here. Requests with
images or video are refused (vexact_vllm/request_validation.py).
"""

from __future__ import annotations

from torch import nn

from vexact_vllm.kernels import apply_rope

from .attention_context import AttentionContext
from .config import DecoderConfig, UnsupportedModelError
from .layers import (
    Decoder,
    DecoderLayer,
    Linear,
    PackedLinear,
    RotaryCache,
    ZeroCentredRMSNorm,
    gathered_linear,
    sigmoid_gate,
)
from .tensor_parallel import TensorParallel, kv_heads


class GatedSelfAttention(nn.Module):
    """See the module docstring. Its attention geometry, as `layers.SelfAttention` exposes it:
    `num_heads`, `num_kv_heads`, `head_dim` and `value_head_dim` (D)."""

    def __init__(self, config: DecoderConfig, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.value_head_dim, self.scale = self.head_dim, config.attention_scale
        h, d, bias = config.hidden_size, self.head_dim, config.qkv_bias
        kv_rows = None
        if tp is not None:  # as layers.SelfAttention: the rank's query heads (q and gate rows) and their kv heads
            first, self.num_kv_heads = kv_heads(config.num_heads, config.num_kv_heads, tp)
            self.num_heads //= tp.size
            kv_rows = (first * d, (first + self.num_kv_heads) * d)
        self.q_proj = Linear(h, config.num_heads * 2 * d, bias, tp)
        self.k_proj = Linear(h, config.num_kv_heads * d, bias, tp, kv_rows)
        self.v_proj = Linear(h, config.num_kv_heads * d, bias, tp, kv_rows)
        self.qkv_proj = PackedLinear([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj = Linear(config.num_heads * d, h, config.o_bias, tp)
        self.q_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)

    def forward(self, x, positions, rope: RotaryCache, attn: AttentionContext):
        t, d = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q_gate = q_gate.view(t, self.num_heads, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:]  # [T, Hq, D] each, views
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        qk_norm = (self.q_norm.scale(), self.k_norm.scale(), self.q_norm.eps)
        q, k = apply_rope(q, k, positions, rope.get(x.device), qk_norm)
        out = attn.attend(self.layer_idx, q, k, v, self.scale)  # [T, Hq, D]
        return gathered_linear(self.o_proj, sigmoid_gate(out, gate).reshape(t, self.num_heads * d), self.tp)  # [T, H]


def linear_attention_layers(hf_config) -> tuple[int, ...]:
    """The Gated DeltaNet layers of a Qwen3-Next / Qwen3.5 config (`layer_types`); any other layer type
    than the two is refused."""
    layer_types = list(hf_config.layer_types)
    unknown = sorted({t for t in layer_types if t not in ("linear_attention", "full_attention")})
    if unknown or len(layer_types) != hf_config.num_hidden_layers:
        raise UnsupportedModelError(
            f"layer_types {layer_types} must list num_hidden_layers ({hf_config.num_hidden_layers}) entries, each "
            "'linear_attention' or 'full_attention'"
        )
    return tuple(i for i, t in enumerate(layer_types) if t == "linear_attention")


def check_attention_gate(hf_config) -> None:
    """The full-attention layers always gate their output, as transformers' Qwen3NextAttention and
    Qwen3_5Attention do (q_proj holds each head's query and its gate); `attn_output_gate: false`, a field
    only stock vLLM reads, is refused."""
    if not getattr(hf_config, "attn_output_gate", True):
        raise UnsupportedModelError(
            "attn_output_gate=false is not supported by vexact-vllm: the Qwen3-Next / Qwen3.5 attention gates "
            "its output, as transformers' model does (q_proj holds each head's query and its gate); serve a "
            "checkpoint whose attention is gated (drop attn_output_gate from config.json)"
        )


class HybridDecoder(Decoder):
    """Gated DeltaNet layers at `config.linear.layers`, `GatedSelfAttention` elsewhere, zero-centred
    norms. A family subclasses it with its `linear_attention` (its Gated DeltaNet class) and `mlp`."""

    norm_class = ZeroCentredRMSNorm

    def layer(self, config: DecoderConfig, layer_idx: int) -> DecoderLayer:
        mlp = self.mlp(config, layer_idx)
        if layer_idx in config.linear.layers:
            mixer = self.linear_attention(config, layer_idx)
            return DecoderLayer(config, layer_idx, mlp, self.tp, mixer, self.norm_class, "linear_attn")
        return DecoderLayer(config, layer_idx, mlp, self.tp, self.attention(config, layer_idx), self.norm_class)

    def attention(self, config: DecoderConfig, layer_idx: int) -> nn.Module:
        return GatedSelfAttention(config, layer_idx, self.tp)

    def linear_attention(self, config: DecoderConfig, layer_idx: int) -> nn.Module:
        raise NotImplementedError


def is_state_layer(layer: nn.Module) -> bool:
    """A decoder layer whose token mixer carries a recurrent state (Gated DeltaNet), not a KV cache."""
    return getattr(layer, "mixer_name", None) == "linear_attn"

