"""The vocabulary mask of the fused log-prob: the trainer's masked log-probs equal, bit for bit, the
rollout side's (verl's `monkey_patch_compute_logits` fills the full fp32 logits with -inf past the
tokenizer and at banned ids, then the sampler's `log_softmax`), on the torch path and the Triton
kernels (interpreter); -inf goes through the log-softmax and the backward without NaN."""

import importlib

import pytest
import torch

from vexact_vllm.kernels import linear, linear_token_log_probs, log_softmax, token_log_probs

logit_rules = importlib.import_module("vexact_vllm.kernels.sampling.logit_rules")
TEMPERATURES = (1.0, 0.7)


def _rollout_side(hidden, weight, tokens, temperature, valid, banned):
    """What the vLLM rollout computes under verl: compute_logits, verl's -inf fill, our sampler."""
    logits = linear(hidden, weight, out_dtype=torch.float32)  # [M, V]
    logits[..., valid:] = float("-inf")  # verl: ids >= len(tokenizer)
    logits.index_fill_(-1, banned, float("-inf"))  # verl: banned ids
    return log_softmax(logits, temperature).gather(1, tokens[:, None].long())[:, 0]


def _mask(vocab, valid, banned):
    mask = torch.arange(vocab) < valid
    mask[banned] = False
    return mask


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("vocab,valid", [(448, 384), (1500, 1029), (2100, 2100)])
def test_masked_fused_equals_rollout(temperature, vocab, valid):
    hidden = torch.randn(37, 64).to(torch.bfloat16)
    weight = (torch.randn(vocab, 64) * 0.5).to(torch.bfloat16)
    tokens = torch.randint(0, valid, (37,))
    banned = torch.tensor([3, valid // 2])
    tokens[torch.isin(tokens, banned)] = 4  # sampled tokens are never masked ones
    expected = _rollout_side(hidden, weight, tokens, temperature, valid, banned)
    got = linear_token_log_probs(hidden, weight, tokens, temperature, 8, vocab_mask=_mask(vocab, valid, banned))
    assert torch.equal(got, expected)
    assert torch.isfinite(got).all()
    if valid < vocab:  # the mask changes the normaliser
        assert not torch.equal(got, linear_token_log_probs(hidden, weight, tokens, temperature, 8))


def test_masked_token_is_minus_inf_and_unmasked_call_unchanged():
    hidden, weight = torch.randn(5, 16), torch.randn(40, 16)
    tokens = torch.tensor([0, 39, 1, 38, 2])
    got = linear_token_log_probs(hidden, weight, tokens, 1.0, vocab_mask=torch.arange(40) < 38)
    assert torch.isneginf(got[1]) and torch.isneginf(got[3]) and torch.isfinite(got[[0, 2, 4]]).all()
    plain = token_log_probs(linear(hidden, weight, out_dtype=torch.float32), tokens, 1.0)
    assert torch.equal(linear_token_log_probs(hidden, weight, tokens, 1.0), plain)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_masked_gradient_matches_fp64_reference(temperature):
    hidden = torch.randn(9, 32, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(70, 32, dtype=torch.float32, requires_grad=True)
    tokens = torch.randint(0, 60, (9,))
    mask = torch.arange(70) < 60
    grad = torch.randn(9)
    linear_token_log_probs(hidden, weight, tokens, temperature, 4, vocab_mask=mask).backward(grad)
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    z = (h @ w.t()).masked_fill(~mask, float("-inf")) / temperature
    (torch.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0] * grad.double()).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w.grad, rtol=1e-4, atol=1e-5)
    assert torch.equal(weight.grad[60:], torch.zeros_like(weight.grad[60:]))


def test_bad_masks_are_refused():
    hidden, weight, tokens = torch.randn(2, 8), torch.randn(10, 8), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="bool tensor"):
        linear_token_log_probs(hidden, weight, tokens, 1.0, vocab_mask=torch.ones(10))
    with pytest.raises(ValueError, match="shape"):
        linear_token_log_probs(hidden, weight, tokens, 1.0, vocab_mask=torch.ones(9, dtype=torch.bool))


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_masked_triton_interpreted(import_interpreted, temperature):
    """The Triton row kernel and its backward on -inf logits (interpreter, CPU tensors)."""
    pytest.importorskip("triton")
    tk = import_interpreted("vexact_vllm.kernels.sampling.logprob_triton")
    vocab, valid = 200, 150
    hidden = torch.randn(6, 32, requires_grad=True)
    weight = torch.randn(vocab, 32, requires_grad=True)
    tokens = torch.randint(0, valid, (6,))
    mask = torch.arange(vocab) < valid
    tau = logit_rules.temperature_column(temperature, 6, hidden.device)
    logits = linear(hidden.detach(), weight.detach(), out_dtype=torch.float32)
    logits[:, valid:] = float("-inf")
    expected = tk.log_softmax_triton(logits, tau).gather(1, tokens[:, None])[:, 0]
    got = tk.linear_token_log_probs_triton(hidden, weight, tokens, tau, 4, ~mask)
    assert torch.equal(got, expected) and torch.isfinite(got).all()
    assert torch.equal(tk.token_log_probs_triton(logits, tokens, tau), expected)
    got.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    assert torch.equal(weight.grad[valid:], torch.zeros_like(weight.grad[valid:]))
    reference = torch.log_softmax(logits.double() / tau.double(), -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
