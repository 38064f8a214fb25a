"""Qwen3 (dense): RMSNorm over each head of q and k before RoPE (`self_attn.q_norm`,
`self_attn.k_norm`, weight [head_dim]); head_dim set explicitly in the config (it need not be
hidden_size / num_heads); no q/k/v bias unless `attention_bias`; small sizes tie lm_head to
embed_tokens. Everything else is the shared pre-norm decoder of `model_patches.layers`."""

from ..config import DecoderConfig
from ..layers import DecoderModel


class Qwen3Model(DecoderModel):
    model_type = "qwen3"

    def __init__(self, config: DecoderConfig):
        if not config.qk_norm:
            raise ValueError("Qwen3 needs q/k RMSNorm (DecoderConfig.qk_norm)")
        super().__init__(config)
