"""MoE top-k routing (`kernels/moe/routing.py`): accuracy against float64, the fixed tie-break and slot
order, normalisation, batch invariance (torch.equal), gradients, refusals."""

import pytest
import torch

from vexact_vllm.kernels import log_softmax
from vexact_vllm.kernels.moe.routing import route

SHAPES = [(1, 4, 1), (5, 8, 2), (17, 128, 8), (33, 60, 3), (123, 16, 16), (129, 5, 5)]  # (T, E, k)


def reference_routing(logits, top_k, norm):
    """float64 (weights, ids) of the same definition: softmax, stable descending sort, optional norm."""
    probs = torch.softmax(logits.double(), dim=-1)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def reference_routing_grad(logits, ids, g, norm):
    """float64 d/d logits of sum(weights * g) for the given ids (the definition's weights)."""
    ld = logits.detach().double().requires_grad_()
    probs = torch.softmax(ld, dim=-1).gather(1, ids)
    ref = probs / probs.sum(-1, keepdim=True) if norm else probs
    (ref * g.double()).sum().backward()
    return ld.grad


def _logits(n_tokens, n_experts):
    return torch.randn(n_tokens, n_experts) * 3


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("n_tokens,n_experts,top_k", SHAPES)
def test_matches_float64_reference(n_tokens, n_experts, top_k, norm):
    logits = _logits(n_tokens, n_experts)
    weights, ids = route(logits, top_k, norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (n_tokens, top_k)
    assert ids.is_contiguous() and weights.is_contiguous()
    ref_w, ref_ids = reference_routing(logits, top_k, norm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n_tokens,n_experts,top_k", SHAPES)
def test_slot_order_descending_and_distinct(n_tokens, n_experts, top_k):
    weights, ids = route(_logits(n_tokens, n_experts), top_k, False)
    assert (weights[:, :-1] >= weights[:, 1:]).all()
    assert all(len(set(row.tolist())) == top_k for row in ids)
    assert int(ids.min()) >= 0 and int(ids.max()) < n_experts


def test_ties_go_to_the_lower_id():
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0],  # three-way tie at the top
            [2.0, 2.0, 2.0, 2.0, 2.0],  # all equal
            [0.0, 5.0, 1.0, 1.0, 1.0],  # tie across the k boundary
            [-1.0, 4.0, 4.0, 9.0, 4.0],  # tie below a clear winner
        ]
    )
    for top_k, want in (
        (1, [[1], [0], [1], [3]]),
        (2, [[1, 2], [0, 1], [1, 2], [3, 1]]),
        (3, [[1, 2, 4], [0, 1, 2], [1, 2, 3], [3, 1, 2]]),
    ):
        weights, ids = route(logits, top_k, False)
        assert ids.tolist() == want, top_k
        probs = torch.exp(log_softmax(logits, 1.0))
        assert torch.equal(weights, probs.gather(1, ids))
    # tied experts get the same weight, bit for bit
    weights, _ = route(logits, 3, True)
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] and weights[1, 0] == weights[1, 2]
    # a tie the other way round in the batch changes nothing: still the lower id first
    flipped = logits.flip(-1)
    _, ids = route(flipped, 2, False)
    assert ids[1].tolist() == [0, 1] and ids[0].tolist() == [0, 2]


@pytest.mark.parametrize("n_tokens,n_experts,top_k", SHAPES)
def test_norm_is_division_by_slot_order_sum(n_tokens, n_experts, top_k):
    logits = _logits(n_tokens, n_experts)
    raw, ids = route(logits, top_k, False)
    normed, ids_n = route(logits, top_k, True)
    assert torch.equal(ids, ids_n)
    assert torch.equal(raw, torch.exp(log_softmax(logits, 1.0)).gather(1, ids))  # the documented probs
    total = raw[:, 0]
    for j in range(1, top_k):
        total = total + raw[:, j]
    assert torch.equal(normed, raw / total[:, None])
    torch.testing.assert_close(
        normed.double().sum(-1), torch.ones(n_tokens, dtype=torch.float64), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("n_experts,top_k", [(8, 2), (128, 8), (60, 3)])
def test_row_alone_equals_row_in_batch(threads, n_experts, top_k, norm):
    logits = _logits(257, n_experts)
    with threads(2):
        weights, ids = route(logits, top_k, norm)
        for i in (0, 1, 127, 128, 256):
            w_i, ids_i = route(logits[i : i + 1], top_k, norm)
            assert torch.equal(w_i, weights[i : i + 1]) and torch.equal(ids_i, ids[i : i + 1]), i
        for start, size in ((3, 5), (100, 123), (0, 129)):
            w_p, ids_p = route(logits[start : start + size], top_k, norm)
            assert torch.equal(w_p, weights[start : start + size]) and torch.equal(
                ids_p, ids[start : start + size]
            )
        perm = torch.randperm(257)
        w_perm, ids_perm = route(logits[perm], top_k, norm)
        assert torch.equal(w_perm, weights[perm]) and torch.equal(ids_perm, ids[perm])
    with threads(1):
        w_1, ids_1 = route(logits, top_k, norm)
        assert torch.equal(w_1, weights) and torch.equal(ids_1, ids)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("n_tokens,n_experts,top_k", [(5, 8, 2), (17, 60, 3), (33, 16, 16)])
def test_gradient_matches_float64_reference(n_tokens, n_experts, top_k, norm):
    logits = _logits(n_tokens, n_experts).requires_grad_()
    g = torch.randn(n_tokens, top_k)
    weights, ids = route(logits, top_k, norm)
    (weights * g).sum().backward()
    torch.testing.assert_close(logits.grad.double(), reference_routing_grad(logits, ids, g, norm), rtol=1e-5, atol=1e-6)
    first = logits.grad.clone()
    logits.grad = None  # deterministic: a second run gives the same bits
    route(logits, top_k, norm)[0].mul(g).sum().backward()
    assert torch.equal(logits.grad, first)


def test_empty_batch():
    weights, ids = route(torch.zeros(0, 8), 2, True)
    assert (
        weights.shape == ids.shape == (0, 2) and weights.dtype == torch.float32 and ids.dtype == torch.int64
    )


@pytest.mark.parametrize(
    "logits,top_k,norm",
    [
        (torch.randn(3, 8).bfloat16(), 2, True),
        (torch.randn(3, 8).half(), 2, True),
        (torch.randn(3, 8).double(), 2, True),
        (torch.randn(8), 2, True),
        (torch.randn(2, 3, 8), 2, True),
        (torch.randn(8, 3).t(), 2, True),
        (torch.randn(3, 0), 1, True),
        (torch.randn(3, 8), 0, True),
        (torch.randn(3, 8), 9, True),
        (torch.randn(3, 8), -1, True),
        (torch.randn(3, 8), 2.0, True),
        (torch.randn(3, 8), True, True),
        (torch.randn(3, 8), 2, 1),
        (torch.randn(3, 8), 2, None),
    ],
)
def test_bad_input_raises(logits, top_k, norm):
    with pytest.raises(ValueError):
        route(logits, top_k, norm)


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes(seed):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    n_tokens, n_experts = draw(1, 300), draw(1, 160)
    top_k, norm = draw(1, n_experts), bool(seed % 2)
    logits = torch.randn(n_tokens, n_experts, generator=gen) * 3
    weights, ids = route(logits, top_k, norm)
    ref_w, ref_ids = reference_routing(logits, top_k, norm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_w, rtol=2e-6, atol=1e-7)
    i = draw(0, n_tokens - 1)
    w_i, ids_i = route(logits[i : i + 1], top_k, norm)
    assert torch.equal(w_i, weights[i : i + 1]) and torch.equal(ids_i, ids[i : i + 1])
