"""Under a trainer's bf16 autocast, a model holding fp32 master weights (VeOmni on one rank, plain
single-GPU training) computes exactly what the bf16 model computes: the rollout's numbers."""

import pytest
import torch

from tests.model_patches.trainers.test_hf_causal_lm import random_ids
from vexact_vllm.model_patches import PackedBatch, UnsupportedModelError
from vexact_vllm.model_patches.trainers.autocast import cast_parameters


def ppo_forward(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, temperature=0.7, shift_labels=torch.roll(ids, -1, dims=-1))


def test_bf16_autocast_over_fp32_weights_equals_the_bf16_model(load_model):
    bf16 = load_model("qwen3", torch.bfloat16, True)
    fp32 = load_model("qwen3", torch.float32, True)
    ids = random_ids((2, 9), seed=1)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a right-padded row
    want = ppo_forward(bf16, ids, mask)
    plain = ppo_forward(fp32, ids, mask)
    assert not torch.equal(plain.log_probs, want.log_probs)  # fp32 compute differs: the test can fail
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ppo_forward(fp32, ids, mask)
        logits = fp32(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got.log_probs, want.log_probs) and torch.equal(got.entropy, want.entropy)
    assert torch.equal(logits, bf16(input_ids=ids, attention_mask=mask).logits)
    assert all(p.dtype == torch.float32 for p in fp32.parameters())  # the masters are untouched


@pytest.mark.parametrize("backward_in_autocast", [False, True])
def test_gradients_reach_the_fp32_weights_as_the_bf16_models(load_model, backward_in_autocast):
    """The fp32 masters get the bf16 model's gradients, exactly, wherever the caller calls backward
    (the kernels' backwards turn autocast off as their forwards do: kernels/autograd_utils.py)."""
    bf16 = load_model("qwen3", torch.bfloat16, True)
    fp32 = load_model("qwen3", torch.float32, True)
    ids = random_ids((2, 7), seed=2)
    mask = torch.ones_like(ids)
    ppo_forward(bf16, ids, mask).log_probs.sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ppo_forward(fp32, ids, mask).log_probs.sum()
        if backward_in_autocast:
            loss.backward()
    if not backward_in_autocast:
        loss.backward()
    want = dict(bf16.named_parameters())
    for name, p in fp32.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, want[name].grad.float()), name


def test_float16_autocast_is_refused(load_model):
    fp32 = load_model("qwen3", torch.float32, True)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(UnsupportedModelError, match="bfloat16"):
        fp32(input_ids=random_ids((1, 5), seed=0))


def _packed(seqs):
    return PackedBatch.from_sequences(seqs)


def test_packed_log_probs_under_bf16_autocast_equal_the_bf16_models(load_model):
    """The trainer's direct entry point follows autocast as forward does: the bf16 model's log-probs,
    and the gradients that reach the fp32 masters are the bf16 model's, rounded up to fp32."""
    bf16 = load_model("qwen3", torch.bfloat16, True)
    fp32 = load_model("qwen3", torch.float32, True)
    batch = _packed([random_ids((n,), seed=10 + n).tolist() for n in (9, 4, 13)])
    want = bf16.packed_log_probs(batch, 0.7)
    want.sum().backward()
    plain = fp32.packed_log_probs(batch, 0.7)
    assert not torch.equal(plain, want)  # fp32 compute differs: the test can fail
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fp32.packed_log_probs(batch, 0.7)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    got.sum().backward()
    bf16_params = dict(bf16.named_parameters())
    for name, p in fp32.named_parameters():
        assert isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32, name  # the masters are back
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, bf16_params[name].grad.float()), name


def test_packed_log_probs_refuse_float16_autocast(load_model):
    fp32 = load_model("qwen3", torch.float32, True)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(UnsupportedModelError, match="bfloat16"):
        fp32.packed_log_probs(_packed([random_ids((5,), seed=0).tolist()]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_a_cast_the_bits_are_unchanged(load_model, dtype):
    """No autocast (or an autocast over parameters that already have its dtype): the same bits as
    the undecorated method, and autocast is off inside (a bf16 model under bf16 autocast)."""
    model = load_model("qwen3", dtype, True)
    batch = _packed([random_ids((n,), seed=n).tolist() for n in (7, 11)])
    with torch.no_grad():
        want = type(model).packed_log_probs.__wrapped__(model, batch, 0.7)
        assert torch.equal(model.packed_log_probs(batch, 0.7), want)
        if dtype == torch.bfloat16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(model.packed_log_probs(batch, 0.7), want)


def test_cast_parameters_restores_the_masters_on_error(load_model):
    """The casts are scoped: tied weights share one cast inside, and the very same fp32 Parameters
    come back even when the method raises."""
    fp32 = load_model("qwen3", torch.float32, True)
    before = {name: p for name, p in fp32.named_parameters(remove_duplicate=False)}
    with pytest.raises(RuntimeError, match="inside"), cast_parameters(fp32, torch.bfloat16):
        assert fp32.lm_head.weight.dtype == torch.bfloat16
        assert fp32.lm_head.weight is fp32.model.embed_tokens.weight  # still tied (qwen3 ties them)
        raise RuntimeError("inside")
    after = dict(fp32.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[n] is p for n, p in before.items())
