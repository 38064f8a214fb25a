"""Fused MoE, torch path (`kernels/moe/experts.py`): accuracy against float64, batch invariance (torch.equal:
row alone, permutations, an expert receiving 1 or 100 tokens, padding), the per-expert composition of
the dense ops, gradients against float64 autograd, determinism, refusals."""

import pytest
import torch

from vexact_vllm.kernels import fused_moe, linear, silu_and_mul

# (T, H, E, I, k): odd sizes, k from 1 to 3, an expert count of 4..8
SHAPES = [(5, 24, 4, 10, 1), (17, 40, 6, 24, 2), (33, 72, 8, 20, 3), (123, 16, 5, 7, 2), (1, 33, 7, 9, 3)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _inputs(n_tokens, hidden, n_experts, inter, top_k, dtype=torch.float32):
    x = torch.randn(n_tokens, hidden).to(dtype)
    w_gate_up = (torch.randn(n_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w_down = (torch.randn(n_experts, hidden, inter) / inter**0.5).to(dtype)
    ids = torch.rand(n_tokens, n_experts).argsort(-1)[:, :top_k].contiguous()  # distinct experts per token
    weights = torch.softmax(torch.randn(n_tokens, top_k), -1)
    return x, w_gate_up, w_down, ids, weights


def _reference(x, w_gate_up, w_down, ids, weights):
    """float64, no intermediate rounding: sum_j w_tj * down_e(silu(gate_e x) * up_e x)."""
    inter = w_down.shape[2]
    gu = torch.einsum("th,tkih->tki", x.double(), w_gate_up.double()[ids])  # [T, k, 2I]
    a = torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]  # [T, k, I]
    y = torch.einsum("tki,tkhi->tkh", a, w_down.double()[ids])  # [T, k, H]
    return (weights.double()[..., None] * y).sum(1)  # [T, H]


def _one_token(x, w_gate_up, w_down, ids, weights, t):
    """Row t composed from the public dense ops alone, one slot at a time: the definition."""
    acc = None
    for j in range(ids.shape[1]):
        e = int(ids[t, j])
        a = silu_and_mul(linear(x[t : t + 1], w_gate_up[e]))
        v = weights[t, j] * linear(a, w_down[e], out_dtype=torch.float32)[0]
        acc = v if acc is None else acc + v
    return acc.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_accuracy(shape, dtype):
    inputs = _inputs(*shape, dtype=dtype)
    out = fused_moe(*inputs)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), _reference(*inputs), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_equals_composition_of_dense_ops(shape, dtype):
    inputs = _inputs(*shape, dtype=dtype)
    out = fused_moe(*inputs)
    for t in range(shape[0]):
        assert torch.equal(out[t], _one_token(*inputs, t)), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_alone_permutation_threads(threads, dtype):
    x, w_gate_up, w_down, ids, weights = _inputs(129, 40, 6, 24, 2, dtype)
    with threads(2):
        full = fused_moe(x, w_gate_up, w_down, ids, weights)
        for i in (0, 1, 64, 128):
            alone = fused_moe(x[i : i + 1], w_gate_up, w_down, ids[i : i + 1], weights[i : i + 1])
            assert torch.equal(alone, full[i : i + 1]), i
        for start, size in ((3, 5), (17, 100)):
            rows = slice(start, start + size)
            assert torch.equal(fused_moe(x[rows], w_gate_up, w_down, ids[rows], weights[rows]), full[rows])
        perm = torch.randperm(129)
        assert torch.equal(fused_moe(x[perm], w_gate_up, w_down, ids[perm], weights[perm]), full[perm])
    with threads(1):
        assert torch.equal(fused_moe(x, w_gate_up, w_down, ids, weights), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_load_does_not_change_bits(dtype):
    """Token 0 on experts (2, 0): alone; with 100 batch-mates also on expert 2 (it receives 101 tokens);
    with 100 batch-mates on other experts (it receives 1); placed last instead of first."""
    x, w_gate_up, w_down, _, _ = _inputs(101, 40, 6, 24, 2, dtype)
    ids0 = torch.tensor([[2, 0]])
    w0 = torch.tensor([[0.7, 0.3]])
    alone = fused_moe(x[:1], w_gate_up, w_down, ids0, w0)
    crowded_ids = torch.cat([ids0, torch.stack([torch.full((100,), 2), torch.randint(3, 6, (100,))], 1)])
    other_ids = torch.cat([ids0, torch.stack([torch.randint(3, 6, (100,)), torch.full((100,), 1)], 1)])
    mates_w = torch.softmax(torch.randn(100, 2), -1)
    for batch_ids in (crowded_ids, other_ids):
        out = fused_moe(x, w_gate_up, w_down, batch_ids.contiguous(), torch.cat([w0, mates_w]))
        assert torch.equal(out[:1], alone)
        last = fused_moe(
            x.roll(-1, 0), w_gate_up, w_down, batch_ids.roll(-1, 0), torch.cat([w0, mates_w]).roll(-1, 0)
        )
        assert torch.equal(last[-1:], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_rows_do_not_change_others(dtype):
    x, w_gate_up, w_down, ids, weights = _inputs(17, 40, 6, 24, 3, dtype)
    want = fused_moe(x, w_gate_up, w_down, ids, weights)
    pad = 9
    x_pad = torch.cat([x[:5], torch.zeros(pad, 40, dtype=dtype), x[5:], torch.randn(pad, 40).to(dtype)])
    ids_pad = torch.cat(
        [ids[:5], torch.zeros(pad, 3, dtype=ids.dtype), ids[5:], ids[:pad]]
    )  # pads on expert 0 too
    w_pad = torch.cat([weights[:5], torch.zeros(pad, 3), weights[5:], torch.zeros(pad, 3)])
    out = fused_moe(x_pad, w_gate_up, w_down, ids_pad, w_pad)
    assert torch.equal(torch.cat([out[:5], out[5 + pad : 17 + pad]]), want)
    assert torch.equal(out[5 : 5 + pad], torch.zeros(pad, 40, dtype=dtype))


def test_int32_ids_and_empty_batch():
    x, w_gate_up, w_down, ids, weights = _inputs(17, 40, 6, 24, 2)
    assert torch.equal(
        fused_moe(x, w_gate_up, w_down, ids.int(), weights), fused_moe(x, w_gate_up, w_down, ids, weights)
    )
    empty = fused_moe(x[:0], w_gate_up, w_down, ids[:0], weights[:0])
    assert empty.shape == (0, 40) and empty.dtype == x.dtype


def _grads(x, w_gate_up, w_down, ids, weights, g):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
    (fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3]).float() * g).sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_match_float64_reference(shape):
    x, w_gate_up, w_down, ids, weights = _inputs(*shape)
    g = torch.randn(shape[0], shape[1])
    got = _grads(x, w_gate_up, w_down, ids, weights, g)
    leaves = [t.detach().double().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
    (_reference(leaves[0], leaves[1], leaves[2], ids, leaves[3]) * g.double()).sum().backward()
    for name, a, b in zip(("x", "w_gate_up", "w_down", "weights"), got, leaves):
        torch.testing.assert_close(a.double(), b.grad, rtol=1e-5, atol=1e-5, msg=name)
    unrouted = sorted(set(range(shape[2])) - set(ids.flatten().tolist()))
    for e in unrouted:
        assert torch.equal(got[1][e], torch.zeros_like(got[1][e])) and torch.equal(
            got[2][e], torch.zeros_like(got[2][e])
        )


def test_unrouted_experts_get_zero_gradient():
    x, w_gate_up, w_down, _, weights = _inputs(9, 24, 8, 10, 2)
    ids = torch.randint(0, 3, (9, 2))  # experts 3..7 unrouted (a token may pick one expert twice)
    g = torch.randn(9, 24)
    got = _grads(x, w_gate_up, w_down, ids, weights, g)
    assert torch.equal(got[1][3:], torch.zeros_like(got[1][3:])) and torch.equal(
        got[2][3:], torch.zeros_like(got[2][3:])
    )
    assert got[1][:3].abs().amax((1, 2)).min() > 0 and got[2][:3].abs().amax((1, 2)).min() > 0
    leaves = [t.detach().double().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
    (_reference(leaves[0], leaves[1], leaves[2], ids, leaves[3]) * g.double()).sum().backward()
    for a, b in zip(got, leaves):
        torch.testing.assert_close(a.double(), b.grad, rtol=1e-5, atol=1e-5)


def test_bf16_gradients_dtype_accuracy_and_determinism():
    x, w_gate_up, w_down, ids, weights = _inputs(33, 40, 6, 24, 3, torch.bfloat16)
    g = torch.randn(33, 40)
    first = _grads(x, w_gate_up, w_down, ids, weights, g)
    assert [t.dtype for t in first] == [torch.bfloat16] * 3 + [torch.float32]
    second = _grads(x, w_gate_up, w_down, ids, weights, g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    leaves = [t.detach().double().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
    (_reference(leaves[0], leaves[1], leaves[2], ids, leaves[3]) * g.double()).sum().backward()
    for a, b in zip(first, leaves):
        scale = b.grad.abs().max()
        torch.testing.assert_close(a.double() / scale, b.grad / scale, rtol=0, atol=3e-2)


def test_backward_is_deterministic(threads):
    inputs = _inputs(123, 40, 6, 24, 3)
    g = torch.randn(123, 40)
    with threads(2):
        first = _grads(*inputs, g)
        second = _grads(*inputs, g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_partial_gradients():
    x, w_gate_up, w_down, ids, weights = _inputs(17, 40, 6, 24, 2)
    x.requires_grad_()
    fused_moe(x, w_gate_up, w_down, ids, weights).sum().backward()
    full = _grads(x, w_gate_up, w_down, ids, weights, torch.ones(17, 40))
    assert torch.equal(x.grad, full[0])
    weights.requires_grad_()
    fused_moe(x.detach(), w_gate_up, w_down, ids, weights).sum().backward()
    assert torch.equal(weights.grad, full[3])


def _bad_cases():
    x, w_gate_up, w_down, ids, weights = _inputs(4, 16, 3, 8, 2)
    cases = {
        "x half": (x.half(), w_gate_up.half(), w_down.half(), ids, weights),
        "dtype mismatch": (x.bfloat16(), w_gate_up, w_down, ids, weights),
        "x 3-D": (x[None], w_gate_up, w_down, ids, weights),
        "x strided last dim": (torch.randn(16, 4).t(), w_gate_up, w_down, ids, weights),
        "hidden mismatch": (x[:, :15].contiguous(), w_gate_up, w_down, ids, weights),
        "odd 2I": (x, w_gate_up[:, :7].contiguous(), w_down, ids, weights),
        "w_gate_up 2-D": (x, w_gate_up[0], w_down, ids, weights),
        "w_gate_up not contiguous": (
            x,
            w_gate_up.transpose(0, 1).contiguous().transpose(0, 1),
            w_down,
            ids,
            weights,
        ),
        "w_down shape": (x, w_gate_up, w_down[:, :, :7].contiguous(), ids, weights),
        "w_down experts": (x, w_gate_up, w_down[:2], ids, weights),
        "ids float": (x, w_gate_up, w_down, ids.float(), weights),
        "ids 1-D": (x, w_gate_up, w_down, ids[:, 0].contiguous(), weights),
        "ids rows": (x, w_gate_up, w_down, ids[:3], weights[:3]),
        "k mismatch": (x, w_gate_up, w_down, ids, weights[:, :1].contiguous()),
        "weights bf16": (x, w_gate_up, w_down, ids, weights.bfloat16()),
        "weights not contiguous": (x, w_gate_up, w_down, ids, weights.t().contiguous().t()),
        "ids not contiguous": (x, w_gate_up, w_down, ids.t().contiguous().t(), weights),
        "id = E": (x, w_gate_up, w_down, torch.where(ids == ids[0, 0], 3, ids), weights),
        "id < 0": (x, w_gate_up, w_down, torch.where(ids == ids[0, 0], -1, ids), weights),
        "k = 0": (x, w_gate_up, w_down, ids[:, :0].contiguous(), weights[:, :0].contiguous()),
    }
    return list(cases.values()), list(cases)


@pytest.mark.parametrize("args", _bad_cases()[0], ids=_bad_cases()[1])
def test_bad_input_raises(args):
    with pytest.raises(ValueError):
        fused_moe(*args)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    """Random sizes, ids (repeats allowed: the math does not need distinct experts) and dtype."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    n_tokens, hidden, n_experts, inter = draw(1, 60), draw(8, 80), draw(2, 9), draw(3, 40)
    top_k = draw(1, min(3, n_experts))
    dtype = (torch.float32, torch.bfloat16)[seed % 2]
    x, w_gate_up, w_down, _, weights = _inputs(n_tokens, hidden, n_experts, inter, top_k, dtype)
    ids = torch.randint(0, n_experts, (n_tokens, top_k), generator=gen)
    out = fused_moe(x, w_gate_up, w_down, ids, weights)
    torch.testing.assert_close(
        out.double(), _reference(x, w_gate_up, w_down, ids, weights), rtol=TOL[dtype], atol=TOL[dtype]
    )
    i = draw(0, n_tokens - 1)
    assert torch.equal(
        fused_moe(x[i : i + 1], w_gate_up, w_down, ids[i : i + 1], weights[i : i + 1]), out[i : i + 1]
    )
    perm = torch.randperm(n_tokens, generator=gen)
    assert torch.equal(fused_moe(x[perm], w_gate_up, w_down, ids[perm], weights[perm]), out[perm])
