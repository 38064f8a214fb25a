"""The built-in shape stand-ins: Qwen3-1.7B's config exactly, and seeded weights written through the
same streaming path (checked on a small variant: the real one is ~3.4 GB)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from vexact_vllm.model_shapes import BUILTIN_MODELS, QWEN3_1_7B_SHAPE, SHAPES
from vexact_vllm.tiny_model import (
    CACHE_VERSION,
    build_qwen3_shape,
    builtin_model,
    qwen3_shape_config,
    qwen3_shapes,
    qwen3_state_dict,
)

SMALL = dict(QWEN3_1_7B_SHAPE, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1024)  # fmt: skip


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VEXACT_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _check_1_7b(cfg) -> None:
    assert cfg.architectures == ["Qwen3ForCausalLM"] and cfg.model_type == "qwen3"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (2048, 6144, 28)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (16, 8, 128)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (151936, 40960)
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert cfg.rms_norm_eps == 1e-6
    assert str(cfg.dtype).removeprefix("torch.") == "bfloat16"


def test_qwen3_1_7b_config():
    cfg = qwen3_shape_config(QWEN3_1_7B_SHAPE, special_id=0)
    _check_1_7b(cfg)
    shapes = qwen3_shapes(cfg)
    params = sum(math.prod(s) for s in shapes.values())
    assert "lm_head.weight" not in shapes  # tied
    assert 1.70e9 < params < 1.73e9  # Qwen3-1.7B: 1.72B with the tied embedding counted once
    assert shapes["model.layers.27.self_attn.k_proj.weight"] == (1024, 2048)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)


def test_builtin_1_7b_config_only(tmp_path):
    """Without weights (bench's dummy load format): config, generation config and tokenizer only."""
    path = builtin_model("qwen3-1.7b-shape", weights=False)
    assert isinstance(path, str)  # what LLM(...) takes: vLLM calls str methods on it
    path = Path(path)
    assert path == tmp_path / "cache" / f"qwen3-1.7b-shape-config-{CACHE_VERSION}"
    assert not (path / "model.safetensors").exists()
    _check_1_7b(AutoConfig.from_pretrained(path))
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) < 151936
    assert builtin_model("qwen3-1.7b-shape", weights=False) == str(path)  # reused


def test_small_shape_weights_deterministic(tmp_path):
    a = build_qwen3_shape(SMALL, tmp_path / "a", seed=3)
    b = build_qwen3_shape(SMALL, tmp_path / "b", seed=3)
    c = build_qwen3_shape(SMALL, tmp_path / "c", seed=4)
    data = (a / "model.safetensors").read_bytes()
    assert data == (b / "model.safetensors").read_bytes()
    assert data != (c / "model.safetensors").read_bytes()

    # The streamed file holds the same tensors the tiny qwen3's in-memory path draws.
    sd = load_file(a / "model.safetensors")
    with safe_open(a / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    ref = qwen3_state_dict(qwen3_shape_config(SMALL, 0), 3, torch.bfloat16)
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd)
    for name, t in sd.items():
        assert t.dtype == torch.bfloat16
        if "norm" in name:
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            assert abs(t.float().std().item() - 0.02) < 0.003, name

    cfg = json.loads((a / "config.json").read_text())
    assert cfg["vocab_size"] == 1024 and cfg["rope_parameters"]["rope_theta"] == 1e6
    model, info = AutoModelForCausalLM.from_pretrained(a, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.tensor([AutoTokenizer.from_pretrained(a).encode("The capital of France is")])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_builtin_names():
    assert BUILTIN_MODELS == ("tiny-qwen3", "tiny-qwen2", "tiny-llama", "tiny-qwen3-moe", "tiny-deepseek-v3",
                              "tiny-deepseek-v2-lite", "tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe",
                              "qwen3-1.7b-shape", "qwen3-8b-shape", "qwen3-30b-a3b-shape", "moonlight-16b-a3b-shape",
                              "deepseek-v2-lite-shape", "qwen3.5-4b-shape", "qwen3.5-35b-a3b-shape")
    with pytest.raises(ValueError, match="--load-format dummy"):
        builtin_model("qwen3-30b-a3b-shape")
    assert SHAPES["qwen3-8b-shape"]["hidden_size"] == 4096 and not SHAPES["qwen3-8b-shape"]["tie_word_embeddings"]
    with pytest.raises(ValueError, match="unknown built-in model"):
        builtin_model("qwen3-32b-shape")


def test_moe_shape_config_only(tmp_path, monkeypatch):
    from vexact_vllm.model_patches.config import DecoderConfig

    monkeypatch.setenv("VEXACT_VLLM_CACHE", str(tmp_path))
    path = Path(builtin_model("qwen3-30b-a3b-shape", weights=False))
    assert not (path / "model.safetensors").exists()
    config = DecoderConfig.from_hf(AutoConfig.from_pretrained(path))
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (128, 8, 768)
    assert config.moe.sparse_layers == tuple(range(48)) and config.num_kv_heads == 4
