import math

import pytest
import torch

from vexact_vllm.kernels import (
    VOCAB_BLOCK,
    gumbel_argmax,
    linear,
    linear_token_log_probs,
    log_softmax,
    token_log_probs,
)
from vexact_vllm.kernels.sampling.gumbel import gumbel_noise

VOCABS = (1000, VOCAB_BLOCK, 3001)


def _reference(logits, temperature):
    tau = torch.as_tensor(temperature, dtype=torch.float64).reshape(-1, 1)
    tau = torch.where(tau == 0, torch.ones_like(tau), tau.clamp_min(0.01))
    return torch.log_softmax(logits.double() / tau, dim=-1)


@pytest.mark.parametrize("vocab", VOCABS)
def test_row_alone_equals_row_in_batch(threads, vocab):
    logits = torch.randn(129, vocab) * 5
    temps = torch.rand(129) + 0.3
    with threads(2):
        full = log_softmax(logits, temps)
        for m in (1, 2, 5, 17, 127):
            assert torch.equal(log_softmax(logits[:m], temps[:m]), full[:m])
        assert torch.equal(log_softmax(logits[100:101], temps[100:101]), full[100:101])
    with threads(1):
        assert torch.equal(log_softmax(logits, temps), full)


def test_temperature_semantics():
    logits = torch.randn(6, 500) * 3
    ones = log_softmax(logits, torch.ones(6))
    assert torch.equal(log_softmax(logits, 1.0), ones)
    assert torch.equal(log_softmax(logits, 0.0), ones)  # greedy: log-probs at tau = 1
    assert torch.equal(log_softmax(logits, 0.7), log_softmax(logits, torch.full((6,), 0.7)))
    # true fp32 division, never a multiply by the reciprocal
    assert torch.equal(log_softmax(logits, 0.7), log_softmax(logits / torch.tensor(0.7), 1.0))
    # vLLM raises temperatures in (0, 0.01) to 0.01 before sampling: the one definition does too
    for tiny in (0.005, 1e-6, 0.0099):
        assert torch.equal(log_softmax(logits, tiny), log_softmax(logits, 0.01))
    assert not torch.equal(log_softmax(logits, 0.011), log_softmax(logits, 0.01))
    mixed = log_softmax(logits, torch.tensor([0.0, 1.0, 0.5, 2.0, 0.0, 0.9]))
    for i, t in enumerate((0.0, 1.0, 0.5, 2.0, 0.0, 0.9)):
        assert torch.equal(mixed[i : i + 1], log_softmax(logits[i : i + 1], t))


@pytest.mark.parametrize("vocab", VOCABS)
def test_accuracy(vocab):
    logits = torch.randn(17, vocab) * 4
    temps = torch.tensor([0.0, 0.5, 1.0, 1.7] * 4 + [0.003])
    torch.testing.assert_close(
        log_softmax(logits, temps).double(), _reference(logits, temps), rtol=1e-5, atol=1e-5
    )


def test_token_log_probs_is_log_softmax_gathered():
    logits = torch.randn(33, 3001) * 4
    tokens = torch.randint(0, 3001, (33,))
    temps = torch.rand(33) + 0.5
    expected = log_softmax(logits, temps).gather(1, tokens[:, None])[:, 0]
    assert torch.equal(token_log_probs(logits, tokens, temps), expected)
    assert torch.equal(token_log_probs(logits[4:5], tokens[4:5], temps[4:5]), expected[4:5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_token_log_probs_equals_unfused(dtype):
    hidden = torch.randn(70, 48).to(dtype)
    weight = (torch.randn(1500, 48) / 7).to(dtype)
    tokens = torch.randint(0, 1500, (70,))
    temps = torch.rand(70) + 0.5
    expected = token_log_probs(linear(hidden, weight, out_dtype=torch.float32), tokens, temps)
    for chunk_rows in (1, 7, 256):
        got = linear_token_log_probs(hidden, weight, tokens, temps, chunk_rows=chunk_rows)
        assert got.dtype == torch.float32 and torch.equal(got, expected), chunk_rows
    assert torch.equal(
        linear_token_log_probs(hidden[9:10], weight, tokens[9:10], temps[9:10]), expected[9:10]
    )
    assert torch.equal(
        linear_token_log_probs(hidden, weight, tokens, 0.8),
        token_log_probs(linear(hidden, weight, out_dtype=torch.float32), tokens, 0.8),
    )


def test_linear_token_log_probs_gradients():
    hidden = torch.randn(13, 24, requires_grad=True)
    weight = (torch.randn(300, 24) / 5).requires_grad_()
    tokens = torch.randint(0, 300, (13,))
    temps = torch.rand(13) + 0.5
    g = torch.randn(13)
    (linear_token_log_probs(hidden, weight, tokens, temps, chunk_rows=4) * g).sum().backward()
    hd, wd = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = _reference(hd @ wd.t(), temps).gather(1, tokens[:, None])[:, 0]
    (ref * g.double()).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), hd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), wd.grad, rtol=1e-5, atol=1e-5)


def test_log_softmax_gradient():
    logits = (torch.randn(4, 1500) * 3).requires_grad_()
    g = torch.randn(4, 1500)
    (log_softmax(logits, 0.7) * g).sum().backward()
    ld = logits.detach().double().requires_grad_()
    (_reference(ld, 0.7) * g.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ld.grad, rtol=1e-5, atol=1e-5)


def _python_hash(seed, position, token):
    """The noise's hash in Python integers: splitmix64's finalizer on 63 bits for the row key, the
    32-bit lowbias32 finalizer per token id (logprob's docstring)."""
    mask, c1, c2 = (1 << 63) - 1, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

    def mix(x):
        x = ((x ^ (x >> 30)) * c1) % (1 << 64) & mask
        x = ((x ^ (x >> 27)) * c2) % (1 << 64) & mask
        return x ^ (x >> 31)

    def hash32(x):
        x = ((x ^ (x >> 16)) * 0x7FEB352D) % (1 << 32)
        x = ((x ^ (x >> 15)) * 0x846CA68B) % (1 << 32)
        return x ^ (x >> 16)

    key = mix(mix((seed & mask) ^ (0x9E3779B97F4A7C15 & mask)) ^ (position & mask)) % (1 << 32)
    return hash32(key ^ token)


def test_gumbel_noise_matches_python_hash():
    seeds = torch.tensor([0, 1, 123456789, -5, 2**62 + 3])
    positions = torch.tensor([0, 7, 100000, 3, 2**40])
    noise = gumbel_noise(seeds, positions, 151936)
    for i in range(5):
        for v in (0, 1, 17, 49, 65535, 65536, 151935):
            h = _python_hash(int(seeds[i]), int(positions[i]), v)
            u = ((h >> 9) + 0.5) / 2**23
            expected = -torch.log(-torch.log(torch.tensor(u, dtype=torch.float32)))
            assert torch.equal(noise[i, v], expected)


def test_gumbel_noise_is_standard_gumbel_and_uncorrelated():
    """Per row over a vocabulary, and across neighbouring seeds, positions and ids: the moments of a
    standard Gumbel (mean = Euler's gamma, variance pi^2 / 6) and no correlation."""
    seeds = torch.tensor([11, 12, 11, -7])
    positions = torch.tensor([300, 300, 301, 2**33])
    noise = gumbel_noise(seeds, positions, 151936).double()
    for row in noise:
        assert abs(row.mean().item() - 0.5772157) < 0.01
        assert abs(row.var().item() - math.pi**2 / 6) < 0.03
    corr = torch.corrcoef(noise)
    assert (corr - torch.eye(4, dtype=corr.dtype)).abs().max() < 0.01  # seeds, positions
    lag = torch.corrcoef(torch.stack([noise[0, :-1], noise[0, 1:]]))[0, 1]
    assert abs(lag.item()) < 0.01  # neighbouring ids


def test_gumbel_argmax_row_alone_equals_row_in_batch(threads):
    log_probs = log_softmax(torch.randn(65, 3001), 1.0)
    seeds = torch.randint(0, 2**62, (65,))
    positions = torch.randint(0, 5000, (65,))
    with threads(2):
        full = gumbel_argmax(log_probs, seeds, positions)
        for i in (0, 31, 64):
            assert torch.equal(
                gumbel_argmax(log_probs[i : i + 1], seeds[i : i + 1], positions[i : i + 1]), full[i : i + 1]
            )
        perm = torch.randperm(65)
        assert torch.equal(gumbel_argmax(log_probs[perm], seeds[perm], positions[perm]), full[perm])
    with threads(1):
        assert torch.equal(gumbel_argmax(log_probs, seeds, positions), full)
    # new seed or position -> new noise
    assert not torch.equal(gumbel_argmax(log_probs, seeds + 1, positions), full)
    assert not torch.equal(gumbel_argmax(log_probs, seeds, positions + 1), full)


def test_gumbel_argmax_samples_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    log_probs = probs.log().expand(n, 4).contiguous()
    tokens = gumbel_argmax(log_probs, torch.arange(n), torch.full((n,), 7))
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.015)


def test_bad_input_raises():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError):
        log_softmax(logits.bfloat16(), 1.0)
    with pytest.raises(ValueError):
        log_softmax(logits, -1.0)
    with pytest.raises(ValueError):
        log_softmax(logits, torch.ones(4))
    with pytest.raises(ValueError):
        log_softmax(logits, torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError):
        token_log_probs(logits, torch.tensor([0, 1, 10]), 1.0)
    with pytest.raises(ValueError):
        token_log_probs(logits, torch.tensor([0.0, 1.0, 2.0]), 1.0)
    with pytest.raises(ValueError):
        linear_token_log_probs(
            torch.randn(3, 4), torch.randn(10, 4).bfloat16(), torch.zeros(3, dtype=torch.long), 1.0
        )
    with pytest.raises(ValueError):
        linear_token_log_probs(
            torch.randn(3, 4).half(), torch.randn(10, 4).half(), torch.zeros(3, dtype=torch.long), 1.0
        )
    with pytest.raises(ValueError):
        linear_token_log_probs(
            torch.randn(3, 4), torch.randn(10, 4), torch.zeros(3, dtype=torch.long), 1.0, chunk_rows=0
        )
    with pytest.raises(ValueError):
        gumbel_argmax(logits, torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError):
        gumbel_argmax(logits, torch.zeros(3), torch.zeros(3, dtype=torch.long))
