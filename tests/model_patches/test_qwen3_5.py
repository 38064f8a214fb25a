"""Qwen3-Next and Qwen3.5 (dense, MoE, and the language model of the vision-language checkpoints) as
families (model_patches/models/qwen3_next.py, qwen3_5.py, hybrid.py, gated_delta.py): the parameters
transformers builds, logits and gradients against transformers in float32 (accuracy: tolerances), the
packed/alone invariance (torch.equal), the refused options."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from vexact_vllm.model_patches import PackedBatch, UnsupportedModelError
from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_patches.families import BY_MODEL_TYPE
from vexact_vllm.model_patches.gated_delta import GatedDeltaNet, state_dtypes, state_shapes
from vexact_vllm.model_patches.hybrid import GatedSelfAttention
from vexact_vllm.model_patches.models import build_decoder
from vexact_vllm.model_patches.moe import GatedSharedExpertMoeBlock
from vexact_vllm.model_patches.tensor_parallel import TensorParallel
from vexact_vllm.model_patches.trainers import transformers_hooks

ARCHS = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]
VOCAB = 448
LOGIT_RTOL = 1e-5
GRAD_RTOL = 1e-3
# A_log and dt_bias: their gradient sums the decay's effect over every later token, some entries near
# zero; ours in fp32 (the chunked rule's torch path on CPU) gives them within 2e-6 to 8e-3 of float64,
# depending on the random checkpoint (transformers' own fp32 chunked form: 3e-4 to 1e-3).
GATE_GRAD_RTOL = 1e-2


def _config(arch: str, **fields):
    family = BY_MODEL_TYPE[arch]
    return family.hf_config_class()(**{**family.tiny, "vocab_size": VOCAB, **fields})


def _rel(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> a float32 checkpoint saved by transformers, every norm weight drawn (zero-centred ones
    around 0, the gated norms' around 1), so the norms' weights are tested too."""
    paths = {}
    for arch in ARCHS:
        model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        paths[arch] = tmp_path_factory.mktemp(arch)
        model.save_pretrained(paths[arch])
    return paths


def _load(path, vexact: bool, dtype=torch.float32):
    if vexact:
        with transformers_hooks.installed():
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_parameters_and_layers_are_transformers(arch):
    """Every parameter transformers' model holds, by name and shape; the layer kinds where its layer_types say."""
    config = _config(arch)
    stock = AutoModelForCausalLM.from_config(config)
    ours = build_decoder(DecoderConfig.from_hf(config))
    theirs = {n.removeprefix("model."): tuple(t.shape) for n, t in stock.state_dict().items() if n.startswith("model.")}
    assert {n: tuple(t.shape) for n, t in ours.state_dict().items()} == theirs
    kinds = [type(layer.mixer).__mro__[1] if isinstance(layer.mixer, GatedDeltaNet) else type(layer.mixer)
             for layer in ours.layers]  # fmt: skip
    assert kinds == [GatedDeltaNet, GatedSelfAttention, GatedDeltaNet, GatedSelfAttention]
    moe = [isinstance(layer.mlp, GatedSharedExpertMoeBlock) for layer in ours.layers]
    assert moe == {"qwen3_next": [True, False, True, True], "qwen3_5_text": [False] * 4,
                   "qwen3_5_moe_text": [True] * 4}[arch]  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_gradients_match_transformers(checkpoints, arch):
    """Ours in float32 against transformers in float64 (its chunked algorithm on the whole sequences,
    ours chunks anchored at multiples of 64): logits, the loss, and the gradients of the packed log-probs."""
    stock, vexact = _load(checkpoints[arch], False, torch.float64), _load(checkpoints[arch], True)
    assert type(vexact).__name__ == f"Vexact{BY_MODEL_TYPE[arch].architecture}"
    stock_params = dict(stock.named_parameters())
    for name, p in vexact.named_parameters():
        assert torch.equal(p.double(), stock_params[name]), name
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = stock(ids, labels=ids), vexact(ids, labels=ids)
    assert _rel(out.logits, ref.logits) < LOGIT_RTOL, _rel(out.logits, ref.logits)
    assert abs(out.loss.item() - ref.loss.item()) < 1e-5 * abs(ref.loss.item())

    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 70)]
    ref_loss = 0.0
    for seq in seqs:
        t = torch.tensor([seq])
        logp = torch.log_softmax(stock(t).logits[0, :-1], dim=-1)
        ref_loss = ref_loss + logp.gather(1, t[0, 1:, None]).sum()
    ref_loss.backward()
    loss = vexact.packed_log_probs(PackedBatch.from_sequences(seqs)).sum()
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    ours = dict(vexact.named_parameters())
    mixer = "in_proj_qkvz" if arch == "qwen3_next" else "in_proj_qkv"
    names = [f"model.layers.0.linear_attn.{mixer}.weight", "model.layers.2.linear_attn.conv1d.weight",
             "model.layers.0.linear_attn.A_log", "model.layers.2.linear_attn.dt_bias",
             "model.layers.0.linear_attn.norm.weight", "model.layers.2.linear_attn.out_proj.weight",
             "model.layers.1.self_attn.q_proj.weight", "model.layers.3.self_attn.k_norm.weight",
             "model.layers.1.input_layernorm.weight", "model.norm.weight"]  # fmt: skip
    if arch != "qwen3_5_text":
        names += ["model.layers.0.mlp.gate.weight", "model.layers.2.mlp.experts.gate_up_proj",
                  "model.layers.3.mlp.shared_expert.down_proj.weight", "model.layers.0.mlp.shared_expert_gate.weight"]
    for name in names:
        tol = GATE_GRAD_RTOL if name.endswith(("A_log", "dt_bias")) else GRAD_RTOL
        assert _rel(ours[name].grad.double(), stock_params[name].grad) < tol, name
    for name, p in vexact.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sequence_alone_equals_it_in_a_packed_batch(checkpoints, arch, dtype):
    """The contract's trainer half: each sequence's log-probs alone and packed with others, torch.equal."""
    vexact = _load(checkpoints[arch], True, dtype)
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 66, 130)]
    with torch.no_grad():
        packed = vexact.packed_log_probs(PackedBatch.from_sequences(seqs))
        start = 0
        for seq in seqs:
            alone = vexact.packed_log_probs(PackedBatch.from_sequences([seq]))
            assert torch.equal(alone, packed[start : start + len(seq)])
            start += len(seq)


def test_vision_language_checkpoint_serves_its_language_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (language model under model.language_model, a vision
    tower under model.visual) builds the vexact class from its text config; text-only logits match the
    checkpoint's own model."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {**BY_MODEL_TYPE["qwen3_5_text"].tiny, "vocab_size": VOCAB}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=4,
                  temporal_patch_size=1, num_position_embeddings=16)  # fmt: skip
    stock = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).float().eval()
    stock.save_pretrained(tmp_path)
    assert DecoderConfig.from_hf(stock.config).linear.layers == (0, 2)
    vexact = _load(tmp_path, True)
    assert type(vexact).__name__ == "VexactQwen3_5ForConditionalGeneration"
    theirs = dict(stock.named_parameters())
    for name, p in vexact.named_parameters():
        stock_name = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        assert torch.equal(p, theirs[stock_name]), name
    ids = torch.randint(0, VOCAB, (1, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _rel(vexact(ids).logits, stock(input_ids=ids).logits) < LOGIT_RTOL


def test_state_layout():
    """The per-sequence states of a Gated DeltaNet layer: design C's boundary state, partial-chunk rows
    (63 of them) and rounded boundary state, the conv's raw inputs; fp32 first."""
    linear = DecoderConfig.from_hf(_config("qwen3_5_text")).linear
    assert state_shapes(linear) == ((4, 32, 32), (63, 4, 64), (63, 4), (63, 4), (4, 32, 32),
                                    (3, 2 * 2 * 32 + 4 * 32), (63, 2, 32), (63, 4, 32), (63, 4, 32))  # fmt: skip
    assert state_dtypes(torch.bfloat16) == (torch.float32,) * 4 + (torch.bfloat16,) * 5


def test_unknown_layer_types_ungated_attention_and_head_splits_are_refused():
    config = _config("qwen3_5_text")
    config.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="sliding"):
        DecoderConfig.from_hf(config)
    whole = DecoderConfig.from_hf(_config("qwen3_5_text"))
    rank = state_shapes(whole.linear.shard(2))  # a rank's states: its key heads and their value heads
    assert rank[0] == rank[4] == (2, 32, 32) and rank[5] == (3, 2 * 1 * 32 + 2 * 32) and rank[6] == (63, 1, 32)
    tp = TensorParallel(0, 4, lambda x: x)
    with pytest.raises(UnsupportedModelError, match="does not divide the 2 linear-attention key heads"):
        build_decoder(whole, tp)
    for arch in ARCHS:  # transformers' attention always gates its output; stock vLLM's reads this field
        with pytest.raises(UnsupportedModelError, match="attn_output_gate"):
            DecoderConfig.from_hf(_config(arch, attn_output_gate=False))
        assert DecoderConfig.from_hf(_config(arch, attn_output_gate=True)).linear is not None
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        DecoderConfig.from_hf(BY_MODEL_TYPE["qwen3"].hf_config_class()(
            **{**BY_MODEL_TYPE["qwen3"].tiny, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                   "partial_rotary_factor": 0.5}}))  # fmt: skip


def test_multimodal_rotary_fields_are_text_positions():
    """Qwen3.5's published configs carry M-RoPE fields: a text token's three positions are one, so the
    decoder reads the plain rotation (the fields kept as information); a family that rotates whole heads
    by one position refuses them."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
            "mrope_interleaved": True}  # fmt: skip
    config = DecoderConfig.from_hf(_config("qwen3_5_text", rope_parameters=dict(rope)))
    assert config.rope_scaling is None and config.rotary_dim == 16 and config.rope_theta == 1e7
    assert config.extra == {"mrope_section": [3, 3, 2], "mrope_interleaved": True}
    qwen3 = BY_MODEL_TYPE["qwen3"]
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        DecoderConfig.from_hf(qwen3.hf_config_class()(**{**qwen3.tiny, "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 4, 4]}}))  # fmt: skip
