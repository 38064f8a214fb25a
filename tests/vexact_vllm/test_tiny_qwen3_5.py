"""The built-in hybrid checkpoints (tiny-qwen3.5, tiny-qwen3.5-moe, tiny-qwen3-next): Gated DeltaNet and
gated full attention layers of each kind, loadable by transformers with nothing missing; and the Qwen3.5
bench stand-ins (qwen3.5-4b-shape, qwen3.5-35b-a3b-shape): config and tokenizer only, in the layout Qwen
publishes (vision-language, the decoder in text_config), our DecoderConfig builds from each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.tiny_model import build_tiny_model, builtin_model

ARCHS = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
         "qwen3_next": "Qwen3NextForCausalLM"}  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-hybrid")
    return {arch: build_tiny_model(arch, path=root / arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_hybrid_checkpoints(built, arch):
    cfg = AutoConfig.from_pretrained(built[arch])
    assert cfg.architectures == [ARCHS[arch]]
    config = DecoderConfig.from_hf(cfg)
    assert config.linear.layers == (0, 2) and config.num_layers == 4  # two Gated DeltaNet, two full attention
    assert (config.head_dim, config.rotary_dim) == (64, 16)
    assert (config.linear.num_k_heads, config.linear.num_v_heads) == (2, 4)
    assert (config.moe is None) is (arch == "qwen3_5_text")
    sd = load_file(built[arch] / "model.safetensors")
    a_log = sd["model.layers.0.linear_attn.A_log"].float().exp()
    assert bool(((a_log > 0.0099) & (a_log < 16.01)).all()) and a_log.std() > 0
    model, info = AutoModelForCausalLM.from_pretrained(built[arch], dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def test_builtin_names_are_the_short_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("VEXACT_VLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Path(builtin_model("tiny-qwen3.5")).name.startswith("tiny-qwen3_5_text")


@pytest.mark.parametrize("name,arch,layers,moe", [
    ("qwen3.5-4b-shape", "Qwen3_5ForConditionalGeneration", 32, None),
    ("qwen3.5-35b-a3b-shape", "Qwen3_5MoeForConditionalGeneration", 40, (256, 8, 512))])
def test_qwen3_5_shapes_are_config_only(name, arch, layers, moe, tmp_path, monkeypatch):
    monkeypatch.setenv("VEXACT_VLLM_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="--load-format dummy"):
        builtin_model(name)
    path = Path(builtin_model(name, weights=False))
    assert not (path / "model.safetensors").exists() and (path / "tokenizer.json").is_file()
    hf = AutoConfig.from_pretrained(path)
    assert hf.architectures == [arch]  # the published layout: stock vLLM has no text-only Qwen3.5
    assert hf.vision_config.out_hidden_size == hf.text_config.hidden_size
    assert hf.text_config.rope_parameters["mrope_section"] == [11, 11, 10]
    config = DecoderConfig.from_hf(hf)
    assert (config.num_layers, config.head_dim, config.rotary_dim, config.vocab_size) == (layers, 256, 64, 248320)
    assert config.linear.layers == tuple(i for i in range(layers) if (i + 1) % 4)
    lin = config.linear
    assert (lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim, lin.conv_kernel) == (16, 32, 128, 128, 4)
    assert (config.moe and (config.moe.num_experts, config.moe.top_k, config.moe.shared_intermediate_size)) == moe
