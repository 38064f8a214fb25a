"""Truncated sampling thresholds (top-k, top-p, min-p): semantics against a float64 reference, batch
invariance with torch.equal, and the thresholded Gumbel-max draw (torch path and interpreted Triton)."""

import math

import pytest
import torch

from vexact_vllm.kernels import gumbel_argmax, log_softmax, truncation_threshold


def _log_probs(rows, vocab, scale=3.0):
    return log_softmax(torch.randn(rows, vocab) * scale, 1.0)


def _kept(log_probs, thr):
    return log_probs >= thr[:, None]


def _reference_top_p_count(lp_row: torch.Tensor, p: float) -> int:
    """Tokens a float64 top-p keeps: the shortest descending prefix whose mass reaches p."""
    probs = torch.sort(lp_row.double().exp(), descending=True).values
    probs = probs / probs.sum()
    before = torch.cumsum(probs, 0) - probs
    return int((before < p).sum())


@pytest.mark.parametrize("vocab", [7, 1000, 4099])
def test_top_k_keeps_the_k_largest(vocab):
    lp = _log_probs(9, vocab)
    k = torch.tensor([1, 2, 3, 5, 0, -1, vocab, vocab + 4, 6])
    thr = truncation_threshold(lp, top_k=k)
    for i in range(9):
        on = 0 < k[i] < vocab
        expected = int(k[i]) if on else vocab
        assert int(_kept(lp, thr)[i].sum()) == expected  # random fp32 values: no ties
        if on:
            assert torch.equal(torch.sort(lp[i], descending=True).values[int(k[i]) - 1], thr[i])
        else:
            assert thr[i] == float("-inf")


def test_top_k_keeps_every_tie_at_the_threshold():
    lp = torch.log_softmax(torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]]), -1)
    thr = truncation_threshold(lp, top_k=torch.tensor([2]))
    assert _kept(lp, thr)[0].tolist() == [True, True, True, True, False]


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_top_p_matches_a_float64_reference(p):
    lp = _log_probs(16, 3001, scale=2.0)
    thr = truncation_threshold(lp, top_p=torch.full((16,), p))
    counts = _kept(lp, thr).sum(-1)
    for i in range(16):
        ref = _reference_top_p_count(lp[i], p)
        # fp32 exp and the 2^-40 quantisation may move the boundary only where the mass is within
        # rounding of p: check the boundary token's prefix mass then.
        if int(counts[i]) != ref:
            probs = torch.sort(lp[i].double().exp(), descending=True).values
            mass = float(probs[: min(int(counts[i]), ref)].sum() / probs.sum())
            assert abs(mass - p) < 1e-6, (i, int(counts[i]), ref)
        assert int(counts[i]) >= 1


def test_top_p_renormalises_over_top_k_and_min_p():
    lp = _log_probs(8, 500)
    k = torch.full((8,), 10)
    both = truncation_threshold(lp, top_k=k, top_p=torch.full((8,), 0.5))
    for i in range(8):
        top10 = torch.sort(lp[i], descending=True).values[:10]
        assert int(_kept(lp, both)[i].sum()) == _reference_top_p_count(top10, 0.5)
    minp = torch.full((8,), 0.2)
    thr = truncation_threshold(lp, min_p=minp)
    probs = lp.double().exp()
    expect = probs >= 0.2 * probs.max(-1, keepdim=True).values
    # lp >= lp_max + log(min_p) is the fp32 form of p >= min_p * p_max: equal away from the boundary
    near = (probs / probs.max(-1, keepdim=True).values - 0.2).abs() < 1e-5
    assert torch.equal(_kept(lp, thr)[~near], expect[~near])


def test_options_off_give_minus_infinity_and_the_argmax_is_always_kept():
    lp = _log_probs(5, 300)
    off = truncation_threshold(lp, top_k=torch.zeros(5, dtype=torch.long), top_p=torch.ones(5), min_p=torch.zeros(5))
    assert torch.isneginf(off).all()
    tight = truncation_threshold(lp, top_k=torch.ones(5, dtype=torch.long), top_p=torch.full((5,), 1e-6),
                                 min_p=torch.ones(5))  # fmt: skip
    assert torch.equal(_kept(lp, tight).sum(-1), torch.ones(5, dtype=torch.long))
    assert torch.equal(_kept(lp, tight).float().argmax(-1), lp.argmax(-1))


def test_row_alone_equals_row_in_batch_for_mixed_options():
    gen = torch.Generator().manual_seed(3)
    n, vocab = 37, 2053
    lp = log_softmax(torch.randn(n, vocab, generator=gen) * 2, 1.0)
    k = torch.randint(0, 60, (n,), generator=gen)
    p = torch.where(torch.rand(n, generator=gen) < 0.3, 1.0, torch.rand(n, generator=gen) * 0.9 + 0.05)
    m = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, torch.rand(n, generator=gen) * 0.3)
    full = truncation_threshold(lp, top_k=k, top_p=p, min_p=m)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(36, 37)):
        assert torch.equal(truncation_threshold(lp[rows], top_k=k[rows], top_p=p[rows], min_p=m[rows]), full[rows])
    perm = torch.randperm(n, generator=gen)
    assert torch.equal(truncation_threshold(lp[perm], top_k=k[perm], top_p=p[perm], min_p=m[perm]), full[perm])
    # the host-known max_top_k gives the same bits as the one computed on the device
    assert torch.equal(truncation_threshold(lp, top_k=k, top_p=p, min_p=m, max_top_k=int(k.max())), full)


def test_refuses_bad_inputs():
    lp = _log_probs(3, 10)
    with pytest.raises(ValueError, match="top_k"):
        truncation_threshold(lp, top_k=torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="top_p"):
        truncation_threshold(lp, top_p=torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="log_probs"):
        truncation_threshold(lp.double())


def test_thresholded_gumbel_draws_only_kept_tokens_with_the_truncated_distribution():
    vocab, n = 50, 20000
    lp_row = log_softmax(torch.randn(1, vocab) * 1.5, 1.0)
    lp = lp_row.expand(n, vocab).contiguous()
    thr = truncation_threshold(lp, top_k=torch.full((n,), 5))
    tokens = gumbel_argmax(lp, torch.arange(n), torch.full((n,), 3), thr)
    kept = torch.nonzero(lp_row[0] >= thr[0]).reshape(-1)
    assert set(tokens.unique().tolist()) <= set(kept.tolist())
    probs = lp_row[0, kept].double().exp()
    probs = probs / probs.sum()
    freq = torch.stack([(tokens == t).double().mean() for t in kept])
    assert (freq - probs).abs().max() < 4 * math.sqrt(0.25 / n) + 1e-3
    # no threshold: the same seeds may draw outside the top 5
    free = gumbel_argmax(lp, torch.arange(n), torch.full((n,), 3))
    assert not set(free.unique().tolist()) <= set(kept.tolist())


def test_interpreted_triton_threshold_matches_torch(import_interpreted):
    pytest.importorskip("triton")
    gk = import_interpreted("vexact_vllm.kernels.sampling.gumbel_triton")
    lp = _log_probs(6, gk.GUMBEL_BLOCK + 37)
    seeds, positions = torch.arange(6) * 7919, torch.arange(6) + 100
    thr = truncation_threshold(lp, top_k=torch.tensor([1, 3, 0, 50, 7, 2]), top_p=torch.full((6,), 0.8))
    tokens = gk.gumbel_argmax_triton(lp, seeds, positions, thr)
    assert torch.equal(tokens, gumbel_argmax(lp, seeds, positions, thr))
    assert bool((lp.gather(1, tokens[:, None])[:, 0] >= thr).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_thresholded_draw_is_batch_invariant():
    gen = torch.Generator(device="cuda").manual_seed(5)
    n, vocab = 200, 151936
    lp = log_softmax(torch.randn(n, vocab, device="cuda", generator=gen) * 3, 1.0)
    k = torch.randint(0, 50, (n,), device="cuda", generator=gen)
    p = torch.rand(n, device="cuda", generator=gen) * 0.9 + 0.05
    thr = truncation_threshold(lp, top_k=k, top_p=p)
    seeds, positions = torch.arange(n, device="cuda") * 31, torch.arange(n, device="cuda")
    tokens = gumbel_argmax(lp, seeds, positions, thr)
    assert bool((lp.gather(1, tokens[:, None])[:, 0] >= thr).all())
    for rows in (slice(0, 1), slice(17, 18), slice(5, 70)):
        alone = truncation_threshold(lp[rows], top_k=k[rows], top_p=p[rows])
        assert torch.equal(alone, thr[rows])
        assert torch.equal(gumbel_argmax(lp[rows], seeds[rows], positions[rows], alone), tokens[rows])
