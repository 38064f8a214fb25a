"""Qwen3 (dense): RMSNorm over each head of q and k before RoPE (`self_attn.q_norm`,
`self_attn.k_norm`, weight [head_dim]); head_dim set explicitly in the config (it need not be
hidden_size / num_heads); with `attention_bias` a bias on q, k, v and o (Hugging Face's
Qwen3Attention); small sizes tie lm_head to embed_tokens; every layer the dense SwiGLU MLP.
Everything else is the shared pre-norm decoder of `model_patches.layers`."""

from ..layers import Decoder


def decoder_fields(hf_config) -> dict:
    """What a Qwen3 config adds to the shared DecoderConfig."""
    bias = bool(getattr(hf_config, "attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)


class Qwen3Decoder(Decoder):
    pass
