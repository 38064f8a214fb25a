"""The built-in tiny DeepSeek checkpoints: what each exercises (q LoRA or not, grouped sigmoid routing with
a non-zero fp32 correction bias or softmax greedy, shared experts, YaRN, a dense first layer, q/k and
v head sizes that differ), loadable by transformers with nothing missing."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from vexact_vllm.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-deepseek")
    return {arch: build_tiny_model(arch, path=root / arch) for arch in ("deepseek_v3", "deepseek_v2")}


def test_tiny_deepseek_v3(built):
    cfg = AutoConfig.from_pretrained(built["deepseek_v3"])
    assert cfg.architectures == ["DeepseekV3ForCausalLM"] and cfg.q_lora_rank == 48
    assert (cfg.n_group, cfg.topk_group, cfg.n_shared_experts, cfg.first_k_dense_replace) == (4, 2, 1, 1)
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_interleave
    assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim != cfg.v_head_dim
    sd = load_file(built["deepseek_v3"] / "model.safetensors")
    bias = sd["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    assert "model.layers.0.mlp.gate_proj.weight" in sd and "model.layers.1.mlp.shared_experts.up_proj.weight" in sd
    assert all(t.dtype == torch.bfloat16 for n, t in sd.items() if "correction_bias" not in n)
    model, info = AutoModelForCausalLM.from_pretrained(built["deepseek_v3"], dtype=torch.bfloat16,
                                                       output_loading_info=True)  # fmt: skip
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias)


def test_tiny_deepseek_v2_lite(built):
    cfg = AutoConfig.from_pretrained(built["deepseek_v2"])
    assert cfg.architectures == ["DeepseekV2ForCausalLM"] and cfg.q_lora_rank is None
    assert (cfg.topk_method, cfg.norm_topk_prob, cfg.n_shared_experts) == ("greedy", False, 2)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (64, 64, 128)  # stock's Hopper prefill takes it
    assert cfg.rope_parameters["mscale_all_dim"] == 0.707
    sd = load_file(built["deepseek_v2"] / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in sd and not any("correction_bias" in n for n in sd)
    model, info = AutoModelForCausalLM.from_pretrained(built["deepseek_v2"], dtype=torch.bfloat16,
                                                       output_loading_info=True)  # fmt: skip
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
