"""Llama (2, 3, 3.1, 3.2): RoPE with Llama 3's frequency scaling when `rope_type` is "llama3"
(factor, low/high_freq_factor, original_max_position_embeddings: see `kernels.rope.rope_cache`),
optional biases on all four attention projections (`attention_bias`) and on the MLP (`mlp_bias`),
no q/k norm, lm_head usually untied. Everything else is the shared pre-norm decoder of
`model_patches.layers`."""

from ..config import DecoderConfig
from ..layers import DecoderModel


class LlamaModel(DecoderModel):
    model_type = "llama"

    def __init__(self, config: DecoderConfig):
        if config.qk_norm:
            raise ValueError("Llama has no q/k norm")
        super().__init__(config)
