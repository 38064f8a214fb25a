"""The top-k log-probs and the token rank (kernels/sampling/logprob_topk.py): ties to the lower id, the same
ids whatever the batch or block, vLLM's rank (the count of >=)."""

import pytest
import torch

from vexact_vllm.kernels import TokenScores, log_softmax, score_tokens, token_ranks, top_k_ids
from vexact_vllm.kernels.sampling import logprob_topk

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VOCABS = (5, 123, 127, 129, 257, 3001)


def _reference_ids(lp: torch.Tensor, k: int) -> torch.Tensor:
    """A stable sort of each row in float64, descending: equal values keep the id order."""
    return torch.sort(lp.double(), dim=-1, descending=True, stable=True).indices[:, :k]


def _tied_log_probs(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Log-probs with many exact ties: logits on a coarse grid, so equal logits give equal bits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-6, 3, (rows, vocab), generator=g).float() / 2
    return log_softmax(logits, 1.0)


def _key_order_ids(lp: torch.Tensor, k: int) -> torch.Tensor:
    """A full sort of each row's distinct int64 keys (module docstring of logprob_topk), descending."""
    ids = torch.arange(lp.shape[1], device=lp.device)
    return torch.sort(logprob_topk.order_keys(lp, ids, lp.shape[1]), dim=-1, descending=True).indices[:, :k]


def _mixed_log_probs(rows: int, vocab: int, k: int, seed: int) -> torch.Tensor:
    """Log-probs of random logits (ties rare), with planted rows: a tie at the k-th place (the k-th
    value copied to lower and higher ids), -0.0 beside +0.0, NaNs of either sign, +-inf, a whole row
    of one value."""
    g = torch.Generator().manual_seed(seed)
    lp = log_softmax(torch.randn(rows, vocab, generator=g) * 3, 1.0)
    for r in torch.randperm(rows, generator=g)[: rows // 2].tolist():
        kind = r % 6
        kth = torch.sort(lp[r], descending=True).values[k - 1]
        spots = torch.randint(0, vocab, (3,), generator=g)
        if kind == 0:
            lp[r, spots] = kth
        elif kind == 1:
            lp[r, spots[:1]], lp[r, spots[1:]] = 0.0, -0.0
        elif kind == 2:
            lp[r, spots[:1]] = float("nan")
        elif kind == 3:
            lp[r, spots[:1]] = -float("nan")  # sign bit set: below -inf in the key order
        elif kind == 4:
            lp[r, spots[:1]], lp[r, spots[1:]] = float("inf"), float("-inf")
        else:
            lp[r] = -1.5
    return lp


@pytest.mark.parametrize("seed", range(4))
def test_top_k_is_the_key_order_with_planted_ties_and_nans(seed):
    """Rows decided by torch.topk's set and rows that need the keys (ties at the k-th place, NaNs)
    give the full key sort's first k ids, alone or in the batch."""
    g = torch.Generator().manual_seed(100 + seed)
    vocab = int(torch.randint(5, 4000, (1,), generator=g))
    k = int(torch.randint(1, min(vocab, 24) + 1, (1,), generator=g))
    lp = _mixed_log_probs(40, vocab, k, seed)
    ids = top_k_ids(lp, k)
    assert torch.equal(ids, _key_order_ids(lp, k))
    assert torch.equal(top_k_ids(lp[7:9], k), ids[7:9])


@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_is_the_stable_order(vocab):
    lp = _tied_log_probs(17, vocab)
    for k in sorted({0, 1, 3, min(20, vocab), vocab}):
        ids = top_k_ids(lp, k)
        assert ids.dtype == torch.int64 and tuple(ids.shape) == (17, k)
        assert torch.equal(ids, _reference_ids(lp, k)), k


def test_ties_go_to_the_lower_id():
    lp = torch.tensor([
        [-1.0, -2.0, -1.0, -0.5, -2.0],
        [-0.0, 0.0, -3.0, 0.0, -0.0],  # -0.0 and +0.0 are one value
        [float("-inf"), -1.0, float("-inf"), float("-inf"), -2.0],  # k past the finite ones: lower ids first
    ])  # fmt: skip
    assert top_k_ids(lp, 4).tolist() == [[3, 0, 2, 1], [0, 1, 3, 4], [1, 4, 0, 2]]


def test_nan_orders_by_its_sign():
    """A NaN orders above +inf, one with its sign bit set below -inf (the bits decide, not CUDA's
    canonical NaN: the CUDA test compares with the CPU on such rows)."""
    nan = float("nan")
    lp = torch.tensor([[-1.0, -nan, float("-inf"), nan, float("inf")], [-nan, -nan, -2.0, -0.0, 0.0]])
    assert top_k_ids(lp, 5).tolist() == [[3, 4, 0, 2, 1], [3, 4, 2, 0, 1]]
    assert top_k_ids(lp, 2).tolist() == [[3, 4], [3, 4]]


def test_a_row_alone_in_any_batch_or_block(monkeypatch):
    lp = _tied_log_probs(129, 3001, seed=1)
    full = top_k_ids(lp, 7)
    for lo, hi in ((0, 1), (5, 6), (3, 20), (100, 129)):
        assert torch.equal(top_k_ids(lp[lo:hi], 7), full[lo:hi])
    assert torch.equal(top_k_ids(lp.flip(0), 7), full.flip(0))  # other rows beside it, other order
    monkeypatch.setattr(logprob_topk, "BLOCK_ELEMENTS", 2 * 3001 + 5)  # blocks of 2 rows
    assert torch.equal(top_k_ids(lp, 7), full)
    tokens = torch.randint(0, 3001, (129,))
    assert torch.equal(token_ranks(lp, tokens), (lp >= lp.gather(1, tokens[:, None])).sum(-1))


def test_rank_counts_every_log_prob_at_least_the_tokens():
    lp = torch.tensor([[-1.0, -2.0, -1.0, -0.5, -2.0], [-0.0, 0.0, -3.0, 0.0, -0.0]])
    assert token_ranks(lp, torch.tensor([0, 2])).tolist() == [3, 5]  # a tie counts: rank 3, not 2
    assert token_ranks(lp, torch.tensor([3, 4])).tolist() == [1, 4]
    assert token_ranks(lp, torch.tensor([3, 4], dtype=torch.int32)).dtype == torch.int64


@pytest.mark.parametrize("k", [0, 1, 5])
def test_score_tokens_is_vllms_layout(k):
    lp = _tied_log_probs(9, 257, seed=2)
    tokens = torch.randint(0, 257, (9,))
    scores = score_tokens(lp, tokens, k)
    assert isinstance(scores, TokenScores)
    assert tuple(scores.ids.shape) == (9, 1 + k) and scores.ids.dtype == torch.int64
    assert torch.equal(scores.ids[:, 0], tokens) and torch.equal(scores.ids[:, 1:], top_k_ids(lp, k))
    assert torch.equal(scores.log_probs, lp.gather(1, scores.ids))
    assert torch.equal(scores.ranks, token_ranks(lp, tokens))


def test_bad_input_raises():
    lp = torch.zeros(3, 10)
    with pytest.raises(ValueError, match="k must be"):
        top_k_ids(lp, 11)
    with pytest.raises(ValueError, match="k must be"):
        top_k_ids(lp, -1)
    with pytest.raises(ValueError, match="dtype"):
        top_k_ids(lp.double(), 2)
    with pytest.raises(ValueError, match="2-D"):
        top_k_ids(lp[0], 2)
    with pytest.raises(ValueError, match="shape"):
        token_ranks(lp, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype"):
        token_ranks(lp, torch.zeros(3))


@pytest.mark.cuda
@requires_cuda
def test_cuda_equals_cpu_and_rows_alone():
    """At Qwen3's vocabulary, with ties: CUDA's ids and ranks are the CPU's, and a row's are the same
    alone as in a batch of 300 (torch.topk leaves the order of ties unspecified)."""
    vocab = 151936
    lp = _tied_log_probs(300, vocab, seed=3)
    tokens = torch.randint(0, vocab, (300,))
    cpu = score_tokens(lp, tokens, 20)
    gpu = score_tokens(lp.cuda(), tokens.cuda(), 20)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())
    for m in (1, 7, 256):
        part = score_tokens(lp[-m:].cuda(), tokens[-m:].cuda(), 20)
        for a, b in zip(part, gpu):
            assert torch.equal(a, b[-m:])


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("k", [1, 5, 20])
def test_cuda_top_k_is_the_key_order_at_qwen3_vocab(k):
    """At Qwen3's vocabulary, random rows (torch.topk's set decides) among planted ties and NaNs (the
    keys decide): the CUDA ids are the full key sort's, alone and in the batch."""
    lp = _mixed_log_probs(96, 151936, k, seed=k).cuda()
    ids = top_k_ids(lp, k)
    assert torch.equal(ids, _key_order_ids(lp, k))
    assert torch.equal(ids.cpu(), top_k_ids(lp.cpu(), k))
    for lo, hi in ((0, 1), (30, 31), (50, 96)):
        assert torch.equal(top_k_ids(lp[lo:hi], k), ids[lo:hi])
