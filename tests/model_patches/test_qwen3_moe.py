"""Qwen3-MoE as a family: which layers are sparse (Hugging Face's rule), refused router options,
checkpoints with per-expert names loaded and saved through transformers, the router's auxiliary
loss (Hugging Face's function on our logits) and the log-probs' independence of it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from vexact_vllm.model_patches import PackedBatch, UnsupportedModelError
from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_patches.moe import SparseMoeBlock, expert_rows, expert_tensor
from vexact_vllm.model_patches.trainers import transformers_hooks

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=100, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip


@pytest.mark.parametrize(("step", "dense"), [(1, []), (1, [0, 4]), (2, []), (3, [2])])
def test_sparse_layers_follow_hugging_faces_rule(step, dense):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeModel, Qwen3MoeSparseMoeBlock

    from vexact_vllm.model_patches.models import build_decoder

    config = Qwen3MoeConfig(**SMALL, decoder_sparse_step=step, mlp_only_layers=dense)
    hf = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in Qwen3MoeModel(config).layers]
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in build_decoder(DecoderConfig.from_hf(config)).layers]
    assert ours == hf and any(hf)


@pytest.mark.parametrize(("field", "value"), [("n_group", 4), ("scoring_func", "sigmoid"),
                                              ("routed_scaling_factor", 2.5), ("shared_expert_intermediate_size", 64)])
def test_router_options_it_cannot_keep_are_refused_by_name(field, value):
    config = Qwen3MoeConfig(**SMALL)
    setattr(config, field, value)
    with pytest.raises(UnsupportedModelError, match=field):
        DecoderConfig.from_hf(config)
    config = Qwen3MoeConfig(**SMALL)
    config.scoring_func = "softmax"  # neutral values pass
    assert DecoderConfig.from_hf(config).moe.top_k == 2


def test_expert_names():
    assert expert_tensor("model.layers.3.mlp.experts.17.up_proj.weight") == ("model.layers.3.mlp.experts.gate_up_proj", 17, "up_proj")
    assert expert_tensor("model.layers.3.mlp.experts.2.down_proj.weight") == ("model.layers.3.mlp.experts.down_proj", 2, "down_proj")
    assert expert_tensor("model.layers.3.mlp.gate.weight") is None
    stacked = torch.arange(2 * 6 * 3).reshape(2, 6, 3)
    assert torch.equal(expert_rows(stacked, 1, "gate_proj"), stacked[1, :3])
    assert torch.equal(expert_rows(stacked, 1, "up_proj"), stacked[1, 3:])


def test_a_checkpoint_missing_an_expert_tensor_is_refused_by_name():
    from vexact_vllm.model_patches.models.qwen3_moe import check_checkpoint

    config = DecoderConfig.from_hf(Qwen3MoeConfig(**SMALL))
    layers, experts = config.moe.sparse_layers, config.moe.num_experts
    names = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in layers for e in range(experts)
             for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    check_checkpoint(names, config)
    check_checkpoint({f"model.layers.{i}.mlp.experts.{p}" for i in layers for p in ("gate_up_proj", "down_proj")}, config)
    last = max(layers)
    with pytest.raises(UnsupportedModelError, match=f"expert {experts - 1} of layer {last} is missing its up_proj"):
        check_checkpoint(names - {f"model.layers.{last}.mlp.experts.{experts - 1}.up_proj.weight"}, config)


def test_per_expert_checkpoint_loads_and_saves_through_transformers(tiny_paths, load_model, tmp_path):
    names = set(json.loads((tiny_paths["qwen3_moe"] / "model.safetensors").read_bytes()[8:][
        : int.from_bytes((tiny_paths["qwen3_moe"] / "model.safetensors").read_bytes()[:8], "little")]))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names  # on disk: one tensor per expert
    assert "model.layers.1.mlp.down_proj.weight" in names  # layer 1 is dense (mlp_only_layers)
    vexact = load_model("qwen3_moe", torch.bfloat16, True)
    assert tuple(dict(vexact.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 128, 128)
    vexact.save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert type(stock).__name__ == "Qwen3MoeForCausalLM"
    ours = dict(vexact.named_parameters())
    for name, p in stock.named_parameters():
        assert torch.equal(p, ours[name]), name


def test_router_aux_loss_is_hugging_faces_and_leaves_log_probs_alone(load_model):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    stock, vexact = load_model("qwen3_moe", torch.float32, False), load_model("qwen3_moe", torch.float32, True)
    ids = torch.randint(0, 384, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = stock(ids, labels=ids, output_router_logits=True)
        out = vexact(ids, labels=ids, output_router_logits=True)
        plain = vexact(ids, labels=ids)
    assert len(out.router_logits) == 3 and out.router_logits[0].dtype == torch.float32  # layers 0, 2, 3
    assert torch.equal(out.aux_loss, load_balancing_loss_func(out.router_logits, 8, 2, None))
    assert abs(out.aux_loss.item() - ref.aux_loss.item()) < 1e-4 * abs(ref.aux_loss.item())
    assert torch.equal(out.loss, plain.loss + vexact.config.router_aux_loss_coef * out.aux_loss)
    assert torch.equal(out.logits, plain.logits)
    batch = PackedBatch.from_sequences(ids.tolist())
    with transformers_hooks.installed(), torch.no_grad():
        assert torch.equal(vexact.packed_log_probs(batch), vexact.packed_log_probs(batch))
