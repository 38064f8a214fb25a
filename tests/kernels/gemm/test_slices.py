"""The K-sliced linear (`kernels/gemm/slices.py`): tensor parallelism emulated in one process. Each rank's
share of a row-parallel layer (`linear_partial` on its K shard), combined in rank order
(`combine_partials`), equals the trainer's `linear(..., k_slices=S)` bit for bit for every T dividing S;
a column shard equals the whole weight's columns. Torch path, and the Triton kernels under the
interpreter."""

import pytest
import torch

from vexact_vllm.kernels import linear
from vexact_vllm.kernels.gemm.linear import linear_partial
from vexact_vllm.kernels.gemm.slices import combine_partials, tree_sum


def _case(seed, dtype=torch.bfloat16, bias=True):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    m, n, k = draw(1, 33), draw(1, 40), 8 * draw(1, 24)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _tensor_parallel(x, w, b, out_dtype, k_slices, ranks):
    """The T ranks' partials (each on its contiguous K shard), gathered in rank order, combined."""
    step = x.shape[-1] // ranks
    parts = [linear_partial(x[..., r * step : (r + 1) * step], w[:, r * step : (r + 1) * step], k_slices // ranks)
             for r in range(ranks)]  # fmt: skip
    return combine_partials(parts, b, out_dtype)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k_slices", [2, 4, 8])
def test_ranks_reproduce_the_sliced_linear(seed, k_slices):
    dtype = torch.bfloat16 if seed % 2 else torch.float32
    x, w, b = _case(seed, dtype, bias=seed % 3 != 0)
    for out_dtype in (dtype, torch.float32):
        want = linear(x, w, b, out_dtype, k_slices=k_slices)
        for ranks in (1, 2, 4, 8):
            if k_slices % ranks == 0:
                assert torch.equal(_tensor_parallel(x, w, b, out_dtype, k_slices, ranks), want), (ranks, out_dtype)


def test_one_slice_is_the_plain_linear_and_slices_are_accurate():
    x, w, b = _case(7, torch.float32)
    assert torch.equal(linear(x, w, b, k_slices=1), linear(x, w, b))
    ref = x.double() @ w.double().t() + b.double()
    for k_slices in (2, 4, 8):
        torch.testing.assert_close(linear(x, w, b, k_slices=k_slices).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k_slices", [2, 8])
def test_sliced_linear_is_batch_invariant(k_slices, threads):
    x, w, b = _case(3)
    x = torch.cat([x] * 5)  # more rows
    with threads(2):
        whole = linear(x, w, b, k_slices=k_slices)
        for i in (0, 7, x.shape[0] - 1):
            assert torch.equal(linear(x[i : i + 1], w, b, k_slices=k_slices), whole[i : i + 1])
        perm = torch.randperm(x.shape[0])
        assert torch.equal(linear(x[perm], w, b, k_slices=k_slices), whole[perm])
    with threads(1):
        assert torch.equal(linear(x, w, b, k_slices=k_slices), whole)


def test_column_shards_are_the_whole_weights_columns():
    x, w, b = _case(11)
    whole = linear(x, w, b)
    half = w.shape[0] // 2
    for rows in (slice(0, half), slice(half, None)):
        assert torch.equal(linear(x, w[rows], b[rows], config_n=w.shape[0]), whole[:, rows])


def test_sliced_gradients_equal_the_plain_ones():
    x, w, b = _case(5, torch.float32)
    grads = []
    for k_slices in (1, 4):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        (linear(*leaves, k_slices=k_slices) * torch.linspace(-1, 1, w.shape[0])).sum().backward()
        grads.append([t.grad for t in leaves])
    for plain, sliced in zip(*grads):
        assert torch.equal(plain, sliced)


def test_tree_is_balanced_and_refusals():
    a, b_, c, d = (torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0))
    assert torch.equal(tree_sum([a, b_, c, d]), (a + b_) + (c + d))
    with pytest.raises(ValueError, match="power-of-two"):
        tree_sum([a, b_, c])
    x, w, _ = _case(2)
    for k_slices in (3, 16, 0, True):
        with pytest.raises(ValueError, match="k_slices"):
            linear(x, w, k_slices=k_slices)
    with pytest.raises(ValueError, match="not divisible"):
        linear(torch.randn(2, 12), torch.randn(3, 12), k_slices=8)


def test_interpreted_triton_ranks_and_column_shards(import_interpreted, monkeypatch):
    """The Triton path under the interpreter: slices as the kernel computes them, ranks combined;
    a column shard with config_n reduces like the whole weight (whose BLOCK_K differs from the
    shard's own default: N 2048 -> 64, N 1024 -> 128)."""
    pytest.importorskip("triton")
    gt = import_interpreted("vexact_vllm.kernels.gemm.linear_triton")
    monkeypatch.setitem(__import__("sys").modules, "vexact_vllm.kernels.gemm.linear_triton", gt)
    from vexact_vllm.kernels.gemm.linear import slice_partials

    x, w, b = _case(4)
    x2 = x.reshape(-1, x.shape[-1])
    whole = combine_partials([tree_sum(slice_partials(x2, w, 4, "triton"))], b, torch.bfloat16)
    step = x2.shape[1] // 2
    ranks = [tree_sum(slice_partials(x2[:, r * step : (r + 1) * step], w[:, r * step : (r + 1) * step], 2, "triton"))
             for r in range(2)]  # fmt: skip
    assert torch.equal(combine_partials(ranks, b, torch.bfloat16), whole)
    assert gt.gemm_config(2048, 256, torch.bfloat16).block_k != gt.gemm_config(1024, 256, torch.bfloat16).block_k
    xs = torch.randn(3, 256).bfloat16()
    ws = (torch.randn(2048, 256) / 16).bfloat16()
    full = gt.linear_triton(xs, ws, None, torch.float32)
    for r in range(2):
        rows = slice(r * 1024, (r + 1) * 1024)
        assert torch.equal(gt.linear_triton(xs, ws[rows], None, torch.float32, config_n=2048), full[:, rows])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(2048, 6144), (4096, 12288), (2048, 2048)])  # Qwen3 down / o shapes
def test_cuda_ranks_and_column_shards(n, k):
    x = torch.randn(300, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda").bfloat16()
    want = linear(x, w, b, k_slices=8)
    for ranks in (1, 2, 4, 8):
        assert torch.equal(_tensor_parallel(x, w, b, torch.bfloat16, 8, ranks), want), ranks
    assert torch.equal(linear(x[5:6], w, b, k_slices=8), want[5:6])  # batch-invariant
    whole = linear(x, w)  # the plain layer
    for ranks in (2, 4, 8):
        step = n // ranks
        for r in range(ranks):
            rows = slice(r * step, (r + 1) * step)
            assert torch.equal(linear(x, w[rows], config_n=n), whole[:, rows]), (ranks, r)
