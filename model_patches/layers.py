"""The small vocabulary the shared model definitions are built from.

Every module here calls one op of `vexact_vllm.kernels` and holds parameters under Hugging Face's
names, so a checkpoint (or verl's weight sync) loads without renaming. Nothing here knows whether it
runs in vLLM or in a trainer: attention gets its keys and values from the `AttentionContext`.
"""

from __future__ import annotations

import torch
from torch import nn

from vexact_vllm.kernels import add_rms_norm, apply_rope, linear, rms_norm, rope_cache, silu_and_mul

from .attention_context import AttentionContext
from .config import DecoderConfig


class Linear(nn.Module):
    """y = x W^T (+ b) with the batch-invariant GEMM; weight [out, in] as in nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the residual stream kept in the model dtype."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)  # a gather: exact


class RotaryCache:
    """cos|sin table [max_positions, head_dim] (fp32), built once per device, never a buffer, so
    meta-device construction and FSDP leave it alone."""

    def __init__(self, config: DecoderConfig):
        self.args = (config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = rope_cache(*self.args).to(device)
        return self._by_device[device]


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        h, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, b)
        self.up_proj = Linear(h, i, b)
        self.down_proj = Linear(i, h, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # [T, 2I]
        return self.down_proj(silu_and_mul(gate_up))


class SelfAttention(nn.Module):
    """Grouped-query self-attention. T = tokens, Hq/Hkv = query/kv heads, D = head_dim.

    Family options come from the config: q/k/v bias (Qwen2, Llama attention_bias), o bias (Llama
    attention_bias), per-head q/k RMSNorm before RoPE (Qwen3)."""

    def __init__(self, config: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = self.head_dim**-0.5
        h, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(h, q_size, config.qkv_bias)
        self.k_proj = Linear(h, kv_size, config.qkv_bias)
        self.v_proj = Linear(h, kv_size, config.qkv_bias)
        self.o_proj = Linear(q_size, h, config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, positions, rope, attn: AttentionContext):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, positions, rope)
        out = attn.attend(self.layer_idx, q, k, v, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so each norm fuses the add."""

    def __init__(self, config: DecoderConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, positions, rope, attn: AttentionContext):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, positions, rope, attn)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm. Inputs are packed: input_ids [T], positions [T]."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryCache(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary.get(x.device)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, rope, attn)
        x, _ = self.norm.add(x, residual)
        return x  # [T, H]
