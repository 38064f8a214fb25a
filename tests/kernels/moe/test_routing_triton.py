"""Triton top-k routing (`kernels/moe/routing_triton.py`): the interpreter on CPU tensors, the compiled
kernel on CUDA. Against float64 (weights), the torch path (ids: the same definition), the lower-id
tie-break, batch invariance (torch.equal), gradients, and `route` picking it on CUDA."""

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import

from vexact_vllm.kernels import route  # noqa: E402

from .test_routing import reference_routing, reference_routing_grad  # noqa: E402  (the float64 definition)

MODULE = "vexact_vllm.kernels.moe.routing_triton"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def rt(import_interpreted):
    return import_interpreted(MODULE)


def _random_case(seed):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    n_tokens, n_experts = draw(1, 40), draw(1, 160)
    top_k, norm = draw(1, min(n_experts, 10)), bool(seed % 2)
    return torch.randn(n_tokens, n_experts, generator=gen) * 3, top_k, norm


@pytest.mark.parametrize("seed", range(10))
def test_interpreted_matches_float64_and_torch_ids(rt, seed):
    logits, top_k, norm = _random_case(seed)
    weights, ids = rt.route_triton(logits, top_k, norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    ref_w, ref_ids = reference_routing(logits, top_k, norm)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(ids, route(logits, top_k, norm)[1])  # the torch path's ids
    torch.testing.assert_close(weights.double(), ref_w, rtol=2e-6, atol=1e-7)
    if norm:  # the slot-order sum, then a true division
        raw, _ = rt.route_triton(logits, top_k, False)
        total = raw[:, 0]
        for j in range(1, top_k):
            total = total + raw[:, j]
        assert torch.equal(weights, raw / total[:, None])


def test_interpreted_ties_go_to_the_lower_id(rt):
    logits = torch.tensor(
        [[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 1.0, 1.0, 1.0], [-1.0, 4.0, 4.0, 9.0, 4.0]]
    )
    for top_k, want in (
        (1, [[1], [0], [1], [3]]),
        (2, [[1, 2], [0, 1], [1, 2], [3, 1]]),
        (3, [[1, 2, 4], [0, 1, 2], [1, 2, 3], [3, 1, 2]]),
    ):
        weights, ids = rt.route_triton(logits, top_k, False)
        assert ids.tolist() == want, top_k
    weights, _ = rt.route_triton(logits, 3, True)
    assert weights[0, 0] == weights[0, 1] == weights[0, 2]


@pytest.mark.parametrize("norm", [False, True])
def test_interpreted_row_alone_equals_row_in_batch(rt, norm):
    logits = torch.randn(37, 60) * 3
    weights, ids = rt.route_triton(logits, 4, norm)
    for i in (0, 17, 36):
        w_i, ids_i = rt.route_triton(logits[i : i + 1], 4, norm)
        assert torch.equal(w_i, weights[i : i + 1]) and torch.equal(ids_i, ids[i : i + 1])
    perm = torch.randperm(37)
    w_p, ids_p = rt.route_triton(logits[perm], 4, norm)
    assert torch.equal(w_p, weights[perm]) and torch.equal(ids_p, ids[perm])


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("n_tokens,n_experts,top_k", [(5, 8, 2), (9, 60, 3), (4, 16, 16)])
def test_interpreted_gradient_matches_float64(rt, n_tokens, n_experts, top_k, norm):
    logits = (torch.randn(n_tokens, n_experts) * 3).requires_grad_()
    g = torch.randn(n_tokens, top_k)
    weights, ids = rt.route_triton(logits, top_k, norm)
    assert weights.requires_grad and not ids.requires_grad
    no_grad_w, _ = rt.route_triton(logits.detach(), top_k, norm)
    assert torch.equal(weights.detach(), no_grad_w)  # storing p changes no bit of the weights
    (weights * g).sum().backward()
    torch.testing.assert_close(logits.grad.double(), reference_routing_grad(logits, ids, g, norm), rtol=1e-5, atol=1e-6)


def test_interpreted_empty_batch(rt):
    weights, ids = rt.route_triton(torch.zeros(0, 8), 2, True)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("n_experts,top_k", [(128, 8), (60, 4), (512, 10)])
def test_cuda_route_is_batch_invariant_and_accurate(n_experts, top_k):
    logits = torch.randn(3000, n_experts, device="cuda") * 3
    for norm in (False, True):
        weights, ids = route(logits, top_k, norm)
        ref_w, ref_ids = reference_routing(logits.cpu(), top_k, norm)
        assert torch.equal(ids.cpu(), ref_ids)
        torch.testing.assert_close(weights.double().cpu(), ref_w, rtol=2e-6, atol=1e-7)
        for start, size in ((0, 1), (5, 7), (100, 1000), (2999, 1)):
            w, i = route(logits[start : start + size].clone(), top_k, norm)
            assert torch.equal(w, weights[start : start + size]) and torch.equal(i, ids[start : start + size])


@pytest.mark.cuda
@requires_cuda
def test_cuda_training_variant_gives_the_same_weights():
    """With a gradient the kernel also stores p (another compiled variant): the weights keep their bits,
    so a PPO ratio of the rollout's own policy stays exactly 1."""
    logits = torch.randn(700, 128, device="cuda") * 3
    for norm in (False, True):
        w, ids = route(logits, 8, norm)
        w_grad, ids_grad = route(logits.clone().requires_grad_(), 8, norm)
        assert torch.equal(w_grad.detach(), w) and torch.equal(ids_grad, ids)
