import pytest
import torch

from vexact_vllm.kernels import linear
from vexact_vllm.kernels.gemm import linear as gemm

M_VALUES = (1, 2, 5, 17, 64, 123, 127, 129, 257, 300)
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _reference(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(96, 80), (33, 129)])
def test_rows_invariant_to_batch_threads_and_chunking(threads, monkeypatch, dtype, n, k):
    x = torch.randn(300, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype)
    with threads(2):
        full = linear(x, w, b)
        for m in M_VALUES:
            assert torch.equal(linear(x[:m], w, b), full[:m]), m
        assert torch.equal(linear(x[123:124], w, b), full[123:124])
    with threads(1):
        assert torch.equal(linear(x, w, b), full)
        assert torch.equal(linear(x[:5], w, b), full[:5])
    for budget in (1, 1000, 1 << 24):  # row-at-a-time, column chunks, one product tensor
        monkeypatch.setattr(gemm, "_PRODUCT_BUDGET", budget)
        assert torch.equal(linear(x, w, b), full), budget


def test_leading_dims_and_out_dtype():
    x = torch.randn(3, 7, 64).bfloat16()
    w = torch.randn(40, 64).bfloat16()
    y32 = linear(x, w, out_dtype=torch.float32)
    assert y32.shape == (3, 7, 40) and y32.dtype == torch.float32
    assert torch.equal(linear(x.reshape(21, 64), w, out_dtype=torch.float32), y32.reshape(21, 40))
    assert torch.equal(linear(x, w), y32.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accuracy(dtype):
    x = torch.randn(37, 200).to(dtype)
    w = (torch.randn(50, 200) / 14).to(dtype)
    b = torch.randn(50).to(dtype)
    ref = _reference(x, w, b)
    y = linear(x, w, b, out_dtype=torch.float32)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)  # fp32 accumulation of exact inputs
    torch.testing.assert_close(linear(x, w, b).double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_gradients_match_float64_reference():
    x = torch.randn(2, 9, 48, requires_grad=True)
    w = torch.randn(31, 48, requires_grad=True)
    b = torch.randn(31, requires_grad=True)
    g = torch.randn(2, 9, 31)
    (linear(x, w, b) * g).sum().backward()
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    (_reference(xd, wd, bd) * g.double()).sum().backward()
    for got, want in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bf16_gradients_dtype():
    x = torch.randn(4, 16).bfloat16().requires_grad_()
    w = torch.randn(8, 16).bfloat16().requires_grad_()
    linear(x, w, out_dtype=torch.float32).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "x,w,b,out_dtype",
    [
        (torch.randn(2, 8).half(), torch.randn(4, 8).half(), None, None),
        (torch.ones(2, 8, dtype=torch.int64), torch.ones(4, 8, dtype=torch.int64), None, None),
        (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None, None),
        (torch.randn(2, 8), torch.randn(4, 9), None, None),
        (torch.randn(2, 8), torch.randn(4, 8, 1), None, None),
        (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5), None),
        (torch.randn(2, 8), torch.randn(4, 8), None, torch.float16),
        (torch.randn(8, 2).t(), torch.randn(4, 8), None, None),
    ],
)
def test_bad_input_raises(x, w, b, out_dtype):
    with pytest.raises(ValueError):
        linear(x, w, b, out_dtype=out_dtype)


def test_single_output_long_k(threads):
    """N = 1 (a value head) with K past torch's parallel-reduction grain: a row alone is one output."""
    x = torch.randn(4, 40000)
    w = torch.randn(1, 40000)
    with threads(2):
        full = linear(x, w)
        for i in range(4):
            assert torch.equal(linear(x[i : i + 1], w), full[i : i + 1])
