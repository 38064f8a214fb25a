"""DeepSeek-V3 and V2 as families (model_patches/models/deepseek_v3.py, mla.py, moe.SharedExpertsMoeBlock):
the parameters and layers transformers builds, logits and gradients against transformers in float32
(accuracy: tolerances), the packed/alone invariance (torch.equal), the refused options, the fp32
correction bias, the MLA rotary layout."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from vexact_vllm.model_patches import PackedBatch, UnsupportedModelError, VexactForCausalLM
from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_patches.families import BY_MODEL_TYPE
from vexact_vllm.model_patches.mla import MlaAttention, deinterleave
from vexact_vllm.model_patches.models import build_decoder
from vexact_vllm.model_patches.models.deepseek_v3 import check_checkpoint
from vexact_vllm.model_patches.moe import SharedExpertsMoeBlock

ARCHS = ["deepseek_v3", "deepseek_v2"]
VOCAB = 448
LOGIT_RTOL = 1e-4
GRAD_RTOL = 1e-3


def _config(arch: str, **fields):
    family = BY_MODEL_TYPE[arch]
    return family.hf_config_class()(**{**family.tiny, "vocab_size": VOCAB, **fields})


def _rel(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("q_lora_rank", [None, 48])
def test_parameters_and_layers_are_transformers(arch, q_lora_rank):
    """Every parameter and buffer transformers' model holds, by name and shape; MoE from first_k_dense_replace."""
    from transformers import AutoModelForCausalLM

    config = _config(arch, q_lora_rank=q_lora_rank, first_k_dense_replace=2)
    stock = AutoModelForCausalLM.from_config(config)
    ours = build_decoder(DecoderConfig.from_hf(config))
    theirs = {n.removeprefix("model."): tuple(t.shape) for n, t in stock.state_dict().items() if n.startswith("model.")}
    assert {n: tuple(t.shape) for n, t in ours.state_dict().items()} == theirs
    assert [isinstance(layer.mlp, SharedExpertsMoeBlock) for layer in ours.layers] == [False, False, True, True]
    assert all(isinstance(layer.self_attn, MlaAttention) for layer in ours.layers)
    bias = [b for n, b in ours.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(bias) == (2 if arch == "deepseek_v3" else 0) and all(b.dtype == torch.float32 for b in bias)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_gradients_match_transformers(load_model, arch):
    """float32 on both sides (the tiny checkpoint's bf16 weights and fp32 correction bias): logits,
    the loss, and a few parameters' gradients of the packed log-probs."""
    stock, vexact = load_model(arch, torch.float32, False), load_model(arch, torch.float32, True)
    assert isinstance(vexact, VexactForCausalLM)
    stock_params = dict(stock.named_parameters())
    for name, p in vexact.named_parameters():
        assert torch.equal(p, stock_params[name]), name
    if arch == "deepseek_v3":
        bias = vexact.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.dtype == torch.float32 and bias.abs().max() > 0
        assert torch.equal(bias, stock.model.layers[1].mlp.gate.e_score_correction_bias)
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = stock(ids, labels=ids), vexact(ids, labels=ids)
    assert _rel(out.logits, ref.logits) < LOGIT_RTOL, _rel(out.logits, ref.logits)
    assert abs(out.loss.item() - ref.loss.item()) < 1e-4 * abs(ref.loss.item())

    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 70)]
    ref_loss = 0.0
    for seq in seqs:
        t = torch.tensor([seq])
        logp = torch.log_softmax(stock(t).logits[0, :-1].float(), dim=-1)
        ref_loss = ref_loss + logp.gather(1, t[0, 1:, None]).sum()
    ref_loss.backward()
    loss = vexact.packed_log_probs(PackedBatch.from_sequences(seqs)).sum()
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-4 * abs(ref_loss.item())
    ours = dict(vexact.named_parameters())
    attn = "q_a_proj" if arch == "deepseek_v3" else "q_proj"
    for name in (f"model.layers.0.self_attn.{attn}.weight", "model.layers.2.self_attn.kv_b_proj.weight",
                 "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.3.self_attn.kv_a_layernorm.weight",
                 "model.layers.1.mlp.gate.weight", "model.layers.2.mlp.experts.gate_up_proj",
                 "model.layers.3.mlp.shared_experts.down_proj.weight", "model.layers.0.mlp.up_proj.weight"):  # fmt: skip
        assert _rel(ours[name].grad, stock_params[name].grad) < GRAD_RTOL, name
    for name, p in vexact.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sequence_alone_equals_it_in_a_packed_batch(load_model, arch, dtype):
    """The contract's trainer half: each sequence's log-probs alone and packed with others, torch.equal."""
    vexact = load_model(arch, dtype, True)
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 66, 130)]
    with torch.no_grad():
        packed = vexact.packed_log_probs(PackedBatch.from_sequences(seqs))
        start = 0
        for seq in seqs:
            alone = vexact.packed_log_probs(PackedBatch.from_sequences([seq]))
            assert torch.equal(alone, packed[start : start + len(seq)])
            start += len(seq)


def test_interleaved_rotary_dims_match_transformers():
    """De-interleaving then NeoX halves is transformers' interleaved rotation, dims in its layout."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    from vexact_vllm.kernels import apply_rope, rope_cache

    q, k = torch.randn(7, 3, 16), torch.randn(7, 1, 16)
    positions = torch.arange(7)
    table = rope_cache(16, 8, 10000.0)
    cos, sin = table[positions, :8], table[positions, 8:]
    emb_cos, emb_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # [1, T, 16]
    want_q, want_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb_cos, emb_sin)
    got_q, got_k = apply_rope(deinterleave(q), deinterleave(k), positions, table)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_softmax_scale_is_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    for arch in ARCHS:
        config = _config(arch)
        expected = DeepseekV3Attention(DeepseekV3Config(**_config("deepseek_v3").to_dict() | {
            "rope_parameters": config.rope_parameters, "qk_nope_head_dim": config.qk_nope_head_dim}), 0).scaling
        assert DecoderConfig.from_hf(config).attention_scale == expected


@pytest.mark.parametrize(
    "arch,field,value",
    [("deepseek_v2", "topk_method", "group_limited_greedy"), ("deepseek_v2", "scoring_func", "sigmoid"),
     ("deepseek_v3", "scoring_func", "softmax"), ("deepseek_v3", "topk_method", "greedy"),
     ("deepseek_v2", "norm_topk_prob", True), ("deepseek_v3", "moe_layer_freq", 2), ("deepseek_v3", "index_topk", 2048),
     ("deepseek_v3", "n_group", 3), ("deepseek_v3", "topk_group", 5)],
)  # fmt: skip
def test_unsupported_options_are_refused_by_name(arch, field, value):
    config = _config(arch)
    setattr(config, field, value)
    with pytest.raises(UnsupportedModelError, match=field if field not in ("n_group", "topk_group") else "n_group"):
        DecoderConfig.from_hf(config)


def test_fp8_checkpoints_are_refused_with_what_to_do():
    config = _config("deepseek_v3")
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(UnsupportedModelError, match="convert the checkpoint to bf16"):
        DecoderConfig.from_hf(config)
    decoder = DecoderConfig.from_hf(_config("deepseek_v3"))
    with pytest.raises(UnsupportedModelError, match="convert it to bf16"):
        check_checkpoint({"model.layers.0.self_attn.kv_b_proj.weight_scale_inv"}, decoder)
    with pytest.raises(UnsupportedModelError, match="expert 0 of layer 1"):
        check_checkpoint({"model.layers.0.self_attn.kv_b_proj.weight"}, decoder)


def test_v2_and_v3_configs_read_their_own_routing():
    v3, v2 = DecoderConfig.from_hf(_config("deepseek_v3")), DecoderConfig.from_hf(_config("deepseek_v2"))
    assert (v3.moe.scoring, v3.moe.n_group, v3.moe.topk_group, v3.moe.correction_bias) == ("sigmoid", 4, 2, True)
    assert (v2.moe.scoring, v2.moe.norm_topk_prob, v2.moe.correction_bias) == ("softmax", False, False)
    assert (v3.head_dim, v3.mla.v_head_dim, v3.rotary_dim) == (192, 128, 64)
    assert (v2.head_dim, v2.mla.v_head_dim, v2.num_kv_heads) == (128, 128, 4)
    assert v3.mla.rope_interleave and v2.mla.rope_interleave
    assert not DecoderConfig.from_hf(_config("deepseek_v3", rope_interleave=False)).mla.rope_interleave
    assert isinstance(DeepseekV2Config(), DeepseekV2Config)


def test_router_logits_without_an_auxiliary_loss(load_model):
    """transformers' DeepSeek returns the routers' logits and no auxiliary loss; so does the vexact class,
    and the logits stay those of the plain forward."""
    vexact = load_model("deepseek_v3", torch.float32, True)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, plain = vexact(ids, labels=ids, output_router_logits=True), vexact(ids, labels=ids)
    assert len(out.router_logits) == 3 and out.aux_loss is None
    assert torch.equal(out.logits, plain.logits) and torch.equal(out.loss, plain.loss)
