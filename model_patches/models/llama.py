"""Llama (2, 3, 3.1, 3.2): RoPE with Llama 3's frequency scaling when `rope_type` is "llama3"
(factor, low/high_freq_factor, original_max_position_embeddings: see `kernels.norms.rope.rope_cache`),
optional biases on all four attention projections (`attention_bias`) and on the MLP (`mlp_bias`),
no q/k norm, lm_head usually untied; every layer the dense SwiGLU MLP. Everything else is the
shared pre-norm decoder of `model_patches.layers`."""

from ..layers import Decoder


def decoder_fields(hf_config) -> dict:
    """What a Llama config adds to the shared DecoderConfig."""
    bias = bool(getattr(hf_config, "attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), qk_norm=False)


class LlamaDecoder(Decoder):
    pass
