"""Qwen2: biases on the q, k and v projections (never on o_proj), plain RoPE (rope_theta, typically
1e6), no q/k norm; small sizes tie lm_head to embed_tokens; every layer the dense SwiGLU MLP.
Everything else is the shared pre-norm decoder of `model_patches.layers`."""

from ..layers import Decoder


def decoder_fields(hf_config) -> dict:
    """What a Qwen2 config adds to the shared DecoderConfig."""
    return dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)


class Qwen2Decoder(Decoder):
    pass
