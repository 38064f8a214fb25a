"""The DeepSeek bench stand-ins (moonlight-16b-a3b-shape, deepseek-v2-lite-shape): config and tokenizer only,
the published config.json's fields, and our DecoderConfig builds from each with the sizes the bench's KV
cache and MoE depend on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from transformers import AutoConfig

from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_shapes import BUILTIN_MODELS, CONFIG_ONLY_SHAPES
from vexact_vllm.tiny_model import builtin_model

# name: (architecture, scoring, norm_topk_prob, routed_scaling_factor, correction bias, vocabulary, dense MLP,
# the softmax scale: D^-0.5, times YaRN's mscale(40, 0.707)^2 for V2-Lite)
EXPECTED = {
    "moonlight-16b-a3b-shape": ("DeepseekV3ForCausalLM", "sigmoid", True, 2.446, True, 163840, 11264, 192**-0.5),
    "deepseek-v2-lite-shape": (
        "DeepseekV2ForCausalLM", "softmax", False, 1.0, False, 102400, 10944,
        192**-0.5 * (0.1 * 0.707 * math.log(40.0) + 1.0) ** 2,
    ),
}  # fmt: skip


def test_the_shapes_are_config_only_builtins():
    for name in EXPECTED:
        assert name in BUILTIN_MODELS and name in CONFIG_ONLY_SHAPES
        with pytest.raises(ValueError, match="--load-format dummy"):
            builtin_model(name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shape_config_builds_our_decoder_config(name, tmp_path, monkeypatch):
    arch, scoring, norm, scale, bias, vocab, dense, softmax_scale = EXPECTED[name]
    monkeypatch.setenv("VEXACT_VLLM_CACHE", str(tmp_path))
    path = Path(builtin_model(name, weights=False))
    assert not (path / "model.safetensors").exists() and (path / "tokenizer.json").is_file()
    hf = AutoConfig.from_pretrained(path)
    assert hf.architectures == [arch] and hf.torch_dtype is not None
    config = DecoderConfig.from_hf(hf)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (27, 2048, 16, 16)  # fmt: skip
    assert (config.vocab_size, config.intermediate_size, config.tie_word_embeddings) == (vocab, dense, False)
    mla = config.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        None, 512, 128, 64, 128)  # fmt: skip
    assert config.head_dim == 192
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (64, 6, 1408, 2816)  # fmt: skip
    assert moe.sparse_layers == tuple(range(1, 27))  # first_k_dense_replace 1
    assert (moe.scoring, moe.norm_topk_prob, moe.routed_scaling_factor, moe.correction_bias) == (scoring, norm, scale, bias)  # fmt: skip
    assert (moe.n_group, moe.topk_group) == (1, 1)
    assert config.softmax_scale == pytest.approx(softmax_scale, rel=1e-12)
