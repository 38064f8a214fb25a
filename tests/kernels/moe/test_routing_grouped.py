"""DeepSeek-V3's routing (`kernels/moe/routing.py` `route_grouped`, `routing_triton.py`): sigmoid scores,
the choice-only correction bias, expert groups masked with -inf, top-k with the lower id on ties,
unbiased weights, norm_topk_prob, the routed scaling factor. Against a float64 definition and against
transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter; batch invariance (torch.equal); gradients;
refusals; the Triton kernel through the interpreter and on CUDA."""

import pytest
import torch

from vexact_vllm.kernels import route, route_grouped

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (T, E, k, n_group, topk_group): ungrouped (Moonlight), DeepSeek-V3's 8/4 groups, the tiny model's 4/2
CASES = [(7, 64, 6, 1, 1), (33, 256, 8, 8, 4), (17, 8, 2, 4, 2), (5, 16, 3, 4, 1), (12, 32, 4, 2, 2)]


def reference(logits, bias, top_k, n_group, topk_group, norm, scaling):
    """float64 (weights, ids): the module docstring's definition (transformers' up to ties)."""
    s = torch.sigmoid(logits.double())
    c = s + bias.double()
    t, e = c.shape
    if topk_group < n_group:
        top2 = c.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
        kept = torch.sort(top2, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros(t, n_group, dtype=torch.bool).scatter_(1, kept, True)
        c = c.masked_fill(~keep.repeat_interleave(e // n_group, 1), float("-inf"))
    ids = torch.sort(c, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = s.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, ids


def _inputs(t, e, gen=None):
    logits = torch.randn(t, e, generator=gen) * 2
    bias = torch.randn(e, generator=gen) * 0.3  # a trained correction bias: comparable to the scores
    return logits, bias


@pytest.mark.parametrize("norm,scaling", [(True, 2.5), (False, 1.0), (True, 1.0)])
@pytest.mark.parametrize("t,e,k,n_group,topk_group", CASES)
def test_matches_float64_reference(t, e, k, n_group, topk_group, norm, scaling):
    logits, bias = _inputs(t, e)
    weights, ids = route_grouped(logits, bias, k, n_group, topk_group, norm, scaling)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and weights.shape == ids.shape == (t, k)
    ref_w, ref_ids = reference(logits, bias, k, n_group, topk_group, norm, scaling)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_w, rtol=4e-6, atol=1e-7)


@pytest.mark.parametrize("t,e,k,n_group,topk_group", CASES)
def test_matches_transformers_deepseek_v3_router(t, e, k, n_group, topk_group):
    """transformers' router on the same hidden states and weights: the same experts (as a set: its
    top-k is unordered) with the same weights per expert, to rounding."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.3)
    hidden = torch.randn(t, 32)
    logits, hf_w, hf_ids = router(hidden)
    weights, ids = route_grouped(logits.float().contiguous(), router.e_score_correction_bias.float(), k, n_group,
                                 topk_group, True, 2.5)  # fmt: skip
    for row in range(t):
        ours = dict(zip(ids[row].tolist(), weights[row].tolist(), strict=True))
        theirs = dict(zip(hf_ids[row].tolist(), hf_w[row].tolist(), strict=True))
        assert set(ours) == set(theirs), row
        for expert, w in ours.items():
            assert abs(w - theirs[expert]) <= 1e-6 * max(1.0, abs(w)), (row, expert)


def test_v2_greedy_is_softmax_route_times_scaling():
    """DeepSeek-V2's `greedy` router (softmax, top-k, x routed_scaling_factor, no normalisation) is
    `route(logits, k, False)` scaled: the same experts and weights as transformers'."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, topk_method="greedy",
                              routed_scaling_factor=1.5)  # fmt: skip
    router = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
    logits, hf_w, hf_ids = router(torch.randn(9, 32))
    weights, ids = route(logits.float().contiguous(), 3, False)
    weights = weights * 1.5
    for row in range(9):
        theirs = dict(zip(hf_ids[row].tolist(), hf_w[row].tolist(), strict=True))
        assert set(ids[row].tolist()) == set(theirs)
        for expert, w in zip(ids[row].tolist(), weights[row].tolist(), strict=True):
            assert abs(w - theirs[expert]) <= 1e-6


def test_masked_groups_never_win_with_negative_scores():
    """With the bias pushing every choice score below 0, a group mask of 0.0 (VeXact's) would let a
    masked expert win; transformers' -inf does not: every chosen expert lies in a kept group."""
    logits = torch.randn(50, 32)
    bias = torch.full((32,), -3.0)
    bias[:8] = -1.0  # group 0 of 4 (8 experts a group) is always best
    weights, ids = route_grouped(logits, bias, 4, 4, 1, True, 1.0)
    assert bool((ids < 8).all())
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))


def test_ties_go_to_the_lower_group_and_expert():
    logits = torch.zeros(2, 8)  # every score 0.5
    bias = torch.zeros(8)
    weights, ids = route_grouped(logits, bias, 2, 4, 2, False, 1.0)
    assert ids.tolist() == [[0, 1], [0, 1]]
    bias = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.1, 0.0, 0.0, 0.0])  # groups 1 and 2 tie above group 0
    weights, ids = route_grouped(logits, bias, 3, 4, 2, False, 1.0)
    assert ids.tolist() == [[2, 4, 3]] * 2
    assert torch.equal(weights, torch.full((2, 3), 0.5))  # the unbiased scores


def test_norm_is_the_slot_order_sum_then_a_division():
    logits, bias = _inputs(20, 64)
    raw, ids = route_grouped(logits, bias, 6, 8, 3, False, 1.0)
    normed, ids2 = route_grouped(logits, bias, 6, 8, 3, True, 2.5)
    assert torch.equal(ids, ids2)
    total = raw[:, 0]
    for j in range(1, 6):
        total = total + raw[:, j]
    assert torch.equal(normed, raw / (total + 1e-20)[:, None] * 2.5)


@pytest.mark.parametrize("t,e,k,n_group,topk_group", CASES)
def test_row_alone_equals_row_in_batch(threads, t, e, k, n_group, topk_group):
    logits, bias = _inputs(max(t, 3), e)
    batch = route_grouped(logits, bias, k, n_group, topk_group, True, 2.5)
    for n in (1, 4):
        with threads(n):
            for row in (0, logits.shape[0] - 1):
                alone = route_grouped(logits[row : row + 1].clone(), bias, k, n_group, topk_group, True, 2.5)
                assert torch.equal(alone[0], batch[0][row : row + 1]) and torch.equal(alone[1], batch[1][row : row + 1])


@pytest.mark.parametrize("norm", [False, True])
def test_gradient_matches_float64(norm):
    logits, bias = _inputs(9, 32)
    leaf = logits.clone().requires_grad_()
    weights, ids = route_grouped(leaf, bias, 4, 4, 2, norm, 2.5)
    g = torch.randn(weights.shape)
    (weights * g).sum().backward()
    ref = logits.double().requires_grad_()
    s = torch.sigmoid(ref).gather(1, ids)
    w = s / (s.sum(-1, keepdim=True) + 1e-20) if norm else s
    (w * 2.5 * g.double()).sum().backward()
    torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)


def test_empty_batch():
    weights, ids = route_grouped(torch.zeros(0, 16), torch.zeros(16), 2, 4, 2, True, 1.0)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize(
    "e,k,n_group,topk_group,bias_dtype,match",
    [(16, 2, 3, 1, torch.float32, "equal groups"), (16, 2, 16, 1, torch.float32, "at least two"),
     (16, 5, 4, 1, torch.float32, "must hold at least top_k"), (16, 2, 4, 5, torch.float32, "must hold"),
     (16, 2, 4, 2, torch.bfloat16, "bias"), (16, 2, 0, 1, torch.float32, "positive int")],
)  # fmt: skip
def test_bad_input_raises(e, k, n_group, topk_group, bias_dtype, match):
    with pytest.raises(ValueError, match=match):
        route_grouped(torch.zeros(3, e), torch.zeros(e, dtype=bias_dtype), k, n_group, topk_group, True, 1.0)
    with pytest.raises(ValueError, match="scaling"):
        route_grouped(torch.zeros(3, 16), torch.zeros(16), 2, 4, 2, True, 0.0)


# ----------------------------------------------------------------------------- Triton


@pytest.fixture(scope="module")
def rt(import_interpreted):
    pytest.importorskip("triton")
    return import_interpreted("vexact_vllm.kernels.moe.routing_triton")


@pytest.mark.parametrize("norm,scaling", [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("t,e,k,n_group,topk_group", CASES)
def test_interpreted_matches_torch_ids_and_float64(rt, t, e, k, n_group, topk_group, norm, scaling):
    logits, bias = _inputs(t, e)
    weights, ids = rt.route_grouped_triton(logits, bias, k, n_group, topk_group, norm, scaling)
    assert torch.equal(ids, route_grouped(logits, bias, k, n_group, topk_group, norm, scaling)[1])
    ref_w, _ = reference(logits, bias, k, n_group, topk_group, norm, scaling)
    torch.testing.assert_close(weights.double(), ref_w, rtol=4e-6, atol=1e-7)
    alone = rt.route_grouped_triton(logits[-1:].clone(), bias, k, n_group, topk_group, norm, scaling)
    assert torch.equal(alone[0], weights[-1:]) and torch.equal(alone[1], ids[-1:])


def test_interpreted_ties_and_negative_masks(rt):
    weights, ids = rt.route_grouped_triton(torch.zeros(2, 8), torch.zeros(8), 2, 4, 2, False, 1.0)
    assert ids.tolist() == [[0, 1], [0, 1]]
    bias = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.1, 0.0, 0.0, 0.0])
    assert rt.route_grouped_triton(torch.zeros(2, 8), bias, 3, 4, 2, False, 1.0)[1].tolist() == [[2, 4, 3]] * 2
    bias = torch.full((32,), -3.0)
    bias[:8] = -1.0
    assert bool((rt.route_grouped_triton(torch.randn(20, 32), bias, 4, 4, 1, True, 1.0)[1] < 8).all())


@pytest.mark.parametrize("norm", [False, True])
def test_interpreted_gradient_matches_float64(rt, norm):
    logits, bias = _inputs(9, 32)
    leaf = logits.clone().requires_grad_()
    weights, ids = rt.route_grouped_triton(leaf, bias, 4, 4, 2, norm, 2.5)
    g = torch.randn(weights.shape)
    (weights * g).sum().backward()
    ref = logits.double().requires_grad_()
    s = torch.sigmoid(ref).gather(1, ids)
    w = s / (s.sum(-1, keepdim=True) + 1e-20) if norm else s
    (w * 2.5 * g.double()).sum().backward()
    torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("e,k,n_group,topk_group", [(64, 6, 1, 1), (256, 8, 8, 4), (384, 8, 1, 1)])
def test_cuda_route_grouped_is_batch_invariant_and_accurate(e, k, n_group, topk_group):
    logits, bias = (x.cuda() for x in _inputs(4096, e))
    weights, ids = route_grouped(logits, bias, k, n_group, topk_group, True, 2.5)
    ref_w, ref_ids = reference(logits.cpu(), bias.cpu(), k, n_group, topk_group, True, 2.5)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu().double(), ref_w, rtol=4e-6, atol=1e-7)
    for rows in (slice(0, 1), slice(100, 103), slice(4000, 4096)):
        part = route_grouped(logits[rows].clone(), bias, k, n_group, topk_group, True, 2.5)
        assert torch.equal(part[0], weights[rows]) and torch.equal(part[1], ids[rows])
    leaf = logits.clone().requires_grad_()
    trained = route_grouped(leaf, bias, k, n_group, topk_group, True, 2.5)
    assert torch.equal(trained[0], weights) and torch.equal(trained[1], ids)
