"""VexactForCausalLM against stock transformers, both in float32: logits (packed and padded batches)
and gradients. These are accuracy tests of one model against another implementation, so (and only
here) a tolerance is allowed; the bitwise contract lives in test_packed_invariance.py."""

import pytest
import torch

from vexact_vllm.model_patches import PackedBatch, UnsupportedModelError, VexactForCausalLM

ARCHS = ["qwen3", "qwen2", "llama", "qwen3_moe"]
VOCAB = 448
LOGIT_RTOL = 1e-4  # max |diff| relative to the largest |logit|
GRAD_RTOL = 1e-3  # max |diff| relative to the largest |grad| of that parameter
# A few parameters per arch (Hugging Face names, the same on both sides).
GRAD_PARAMS = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
               "model.layers.1.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight", "model.norm.weight"]
GRAD_PARAMS_EXTRA = {
    "qwen3": ["model.layers.2.self_attn.k_norm.weight", "model.layers.0.self_attn.q_norm.weight"],
    "qwen2": ["model.layers.1.self_attn.q_proj.bias", "model.layers.2.self_attn.v_proj.bias"],
    "llama": ["lm_head.weight", "model.layers.2.self_attn.o_proj.weight"],
    "qwen3_moe": ["model.layers.0.mlp.gate.weight", "model.layers.3.mlp.experts.gate_up_proj",
                  "model.layers.2.mlp.experts.down_proj", "lm_head.weight"],
}


def random_ids(shape, seed):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    diff = (actual - expected).abs().max().item()
    return diff, diff / expected.abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_parameters_match_stock(load_model, arch):
    stock, vexact = load_model(arch, torch.float32, False), load_model(arch, torch.float32, True)
    assert isinstance(vexact, VexactForCausalLM) and not isinstance(stock, VexactForCausalLM)
    stock_params, vexact_params = dict(stock.named_parameters()), dict(vexact.named_parameters())
    assert stock_params.keys() == vexact_params.keys()
    for name, p in stock_params.items():
        assert torch.equal(vexact_params[name], p), name
    tied = arch not in ("llama", "qwen3_moe")
    assert (vexact.lm_head.weight is vexact.model.embed_tokens.weight) == tied
    assert vexact.decoder_config.tie_word_embeddings == tied


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(load_model, arch):
    stock, vexact = load_model(arch, torch.float32, False), load_model(arch, torch.float32, True)
    ids = random_ids((2, 37), seed=1)
    with torch.no_grad():
        ref = stock(ids, labels=ids)
        out = vexact(ids, labels=ids)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (2, 37, VOCAB)
    diff, rel = _rel_diff(out.logits, ref.logits)
    print(f"{arch} logits: max abs diff {diff:.3g}, relative {rel:.3g}")
    assert rel < LOGIT_RTOL, f"{arch}: max |logit diff| {diff:.3g} (relative {rel:.3g})"
    assert abs(out.loss.item() - ref.loss.item()) < 1e-4 * abs(ref.loss.item()), (out.loss, ref.loss)


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_logits_match_transformers(load_model, arch):
    """Row 0 full, row 1 right-padded, row 2 left-padded; compared on the valid positions only."""
    stock, vexact = load_model(arch, torch.float32, False), load_model(arch, torch.float32, True)
    length = 29
    ids = random_ids((3, length), seed=2)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, 17:] = 0  # right padding: 17 tokens
    mask[2, :9] = 0  # left padding: 20 tokens
    ids = torch.where(mask.bool(), ids, torch.zeros_like(ids))
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # stock counts positions from the first real token
    with torch.no_grad():
        ref = stock(ids, attention_mask=mask, position_ids=position_ids).logits
        out = vexact(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert out.shape == ref.shape
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))  # padding rows come back as zeros
    diff, rel = _rel_diff(out[valid], ref[valid])
    print(f"{arch} padded logits: max abs diff {diff:.3g}, relative {rel:.3g}")
    assert rel < LOGIT_RTOL, f"{arch} padded: max |logit diff| {diff:.3g} (relative {rel:.3g})"
    # a padded row gives the same logits as that sequence alone (accuracy vs stock, unpadded)
    with torch.no_grad():
        alone = stock(ids[2:, 9:]).logits[0]
    diff, rel = _rel_diff(out[2, 9:], alone)
    assert rel < LOGIT_RTOL, f"{arch} left-padded vs alone: {diff:.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_match_transformers(load_model, arch):
    """loss = sum over sequences and positions of log p(next token); gradients of a few parameters."""
    stock, vexact = load_model(arch, torch.float32, False), load_model(arch, torch.float32, True)
    seqs = [random_ids((n,), seed=10 + n).tolist() for n in (19, 31)]

    ref_loss = 0.0
    for seq in seqs:
        ids = torch.tensor([seq])
        logp = torch.log_softmax(stock(ids).logits[0, :-1].float(), dim=-1)  # [n-1, V]
        ref_loss = ref_loss + logp.gather(1, ids[0, 1:, None]).sum()
    ref_loss.backward()

    batch = PackedBatch.from_sequences(seqs)
    loss = vexact.packed_log_probs(batch).sum()
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-4 * abs(ref_loss.item()), (loss.item(), ref_loss.item())

    stock_params, vexact_params = dict(stock.named_parameters()), dict(vexact.named_parameters())
    for name in GRAD_PARAMS + GRAD_PARAMS_EXTRA[arch]:
        expected, actual = stock_params[name].grad, vexact_params[name].grad
        assert actual is not None and actual.shape == expected.shape, name
        diff, rel = _rel_diff(actual, expected)
        print(f"{arch} grad {name}: max abs diff {diff:.3g}, relative {rel:.3g}")
        assert rel < GRAD_RTOL, f"{arch} {name}: max |grad diff| {diff:.3g} (relative {rel:.3g})"
    for name, p in vexact.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert bool(torch.isfinite(p.grad).all()), f"{name} has a non-finite gradient"
        assert p.grad.abs().max() > 0, f"{name} has an all-zero gradient"


def test_float16_refused_at_forward(load_model):
    model = load_model("qwen3", torch.float16, True)
    with pytest.raises(UnsupportedModelError, match="bfloat16"):
        model(random_ids((1, 5), seed=0))


def test_forward_requires_input_ids(load_model):
    model = load_model("qwen3", torch.float32, True)
    with pytest.raises(ValueError, match="input_ids"):
        model(inputs_embeds=torch.zeros(1, 5, 128))
