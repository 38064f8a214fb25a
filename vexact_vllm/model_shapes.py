"""The built-in models' names and the real models' shapes they stand in for, importing nothing heavy
(the CLI's --model help lists BUILTIN_MODELS; tiny_model.py builds them).

- `tiny-<family>`: one tiny random checkpoint per family (tiny_model.build_tiny_model);
- SHAPES: a real model's architecture and shapes with random weights drawn by us (Qwen3 dense);
- CONFIG_ONLY_SHAPES: `(model_type, fields)` of models too large to write: config and tokenizer only,
  for the bench with vLLM's dummy weights (`--load-format dummy`). Fields are the published config.json's
  (`rope_parameters` when the rotary embedding is not the default one at `rope_theta`); for a
  vision-language family (Qwen3.5) its text_config's.
"""

from __future__ import annotations

from vexact_vllm.model_patches.families import FAMILIES

# Random-weight stand-ins for real models: same architecture and shapes, the tiny tokenizer.
QWEN3_1_7B_SHAPE = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
)  # fmt: skip
QWEN3_8B_SHAPE = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
)  # fmt: skip
# Qwen3-30B-A3B: 48 layers, every one sparse, 128 experts of 768, top-8; a benchmark stand-in only
# (config and tokenizer; its 61 GB of weights are never built: vLLM's dummy weights serve the bench).
QWEN3_30B_A3B_SHAPE = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip
# Moonlight-16B-A3B (moonshotai's published config.json; DeepSeek-V3's architecture): 27 layers, the first
# dense, 64 experts of 1408 top-6 plus 2 shared, sigmoid routing in one group, no q LoRA, MLA 128 + 64 / 128
# over a 512 latent, rope theta 5e4 without scaling. Config only, like the Qwen3-30B-A3B stand-in.
MOONLIGHT_16B_A3B_SHAPE = dict(
    hidden_size=2048, intermediate_size=11264, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, vocab_size=163840, tie_word_embeddings=False, max_position_embeddings=8192,
    rope_theta=50_000.0, rms_norm_eps=1e-5, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
    n_shared_experts=2, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
    routed_scaling_factor=2.446, topk_method="noaux_tc", scoring_func="sigmoid",
)  # fmt: skip
# DeepSeek-V2-Lite (deepseek-ai's published config.json): Moonlight's layout with softmax greedy routing
# (no renormalisation, scale 1), the dense MLP at 10944, YaRN x40 over 4096 positions (mscale 0.707).
DEEPSEEK_V2_LITE_SHAPE = dict(
    hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, vocab_size=102400, tie_word_embeddings=False, max_position_embeddings=163840,
    rms_norm_eps=1e-6, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=1.0,
    topk_method="greedy", scoring_func="softmax",
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
)  # fmt: skip
# Qwen3.5's hybrid decoder (Gated DeltaNet on 3 of every 4 layers, gated full attention with heads of 256
# of which 64 rotate, rope theta 1e7), written in the layout Qwen publishes (Qwen3_5ForConditionalGeneration:
# these fields are the text_config's, M-RoPE sections in its rope parameters, a vision_config beside it; the
# vision tower is never built: vexact serves the text model, stock runs its language model only, so stock
# vLLM, which has no text-only Qwen3.5 architecture, runs the same checkpoint). The dense one at Qwen3.5-4B's
# size: hidden 2560, 32 layers, 16 query / 4 key-value heads of 256, Gated DeltaNet 16 key and 32 value heads
# of 128, dense MLP 9216, tied embeddings. Config only.
_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                 "mrope_section": [11, 11, 10], "mrope_interleaved": True}  # fmt: skip
QWEN3_5_4B_SHAPE = dict(
    hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
    head_dim=256, vocab_size=248320, tie_word_embeddings=True, max_position_embeddings=262144, rms_norm_eps=1e-6,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, rope_parameters=_QWEN3_5_ROPE,
)  # fmt: skip
# Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults): hidden 2048, 40 layers, 16 / 2 heads of 256,
# 256 experts of 512 top-8 plus a gated shared expert of 512 on every layer; ~70 GB in bf16, one H200.
QWEN3_5_35B_A3B_SHAPE = dict(
    hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    vocab_size=248320, tie_word_embeddings=False, max_position_embeddings=262144, rms_norm_eps=1e-6,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, rope_parameters=_QWEN3_5_ROPE,
)  # fmt: skip
SHAPES = {"qwen3-1.7b-shape": QWEN3_1_7B_SHAPE, "qwen3-8b-shape": QWEN3_8B_SHAPE}
CONFIG_ONLY_SHAPES = {  # name: (model_type, fields)
    "qwen3-30b-a3b-shape": ("qwen3_moe", QWEN3_30B_A3B_SHAPE),
    "moonlight-16b-a3b-shape": ("deepseek_v3", MOONLIGHT_16B_A3B_SHAPE),
    "deepseek-v2-lite-shape": ("deepseek_v2", DEEPSEEK_V2_LITE_SHAPE),
    "qwen3.5-4b-shape": ("qwen3_5", QWEN3_5_4B_SHAPE),
    "qwen3.5-35b-a3b-shape": ("qwen3_5_moe", QWEN3_5_35B_A3B_SHAPE),
}
BUILTIN_MODELS = (*(f.tiny_name for f in FAMILIES if f.tiny is not None), *SHAPES, *CONFIG_ONLY_SHAPES)
# The built-in models that have weights (what `vexact-vllm check` can run): all but the config-only shapes.
MODELS_WITH_WEIGHTS = tuple(name for name in BUILTIN_MODELS if name not in CONFIG_ONLY_SHAPES)
