"""Qwen2: biases on the q, k and v projections (never on o_proj), plain RoPE (rope_theta, typically
1e6), no q/k norm; small sizes tie lm_head to embed_tokens. Everything else is the shared pre-norm
decoder of `model_patches.layers`."""

from ..config import DecoderConfig
from ..layers import DecoderModel


class Qwen2Model(DecoderModel):
    model_type = "qwen2"

    def __init__(self, config: DecoderConfig):
        if not config.qkv_bias or config.o_bias or config.qk_norm:
            raise ValueError("Qwen2 has q/k/v biases, no o_proj bias and no q/k norm")
        super().__init__(config)
