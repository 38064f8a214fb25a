import pytest
import torch

from vexact_vllm.kernels import silu_and_mul

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _reference(x):
    a, b = x.double().chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_alone_equals_row_in_batch(threads, dtype):
    x = (torch.randn(257, 2 * 131) * 4).to(dtype)
    with threads(2):
        full = silu_and_mul(x)
        for m in (1, 2, 5, 17, 129):
            assert torch.equal(silu_and_mul(x[:m]), full[:m])
        for i in (0, 100, 256):
            assert torch.equal(silu_and_mul(x[i]), full[i])
    with threads(1):
        assert torch.equal(silu_and_mul(x), full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accuracy(dtype):
    x = (torch.randn(40, 2 * 100) * 5).to(dtype)
    y = silu_and_mul(x)
    assert y.shape == (40, 100) and y.dtype == dtype
    torch.testing.assert_close(y.double(), _reference(x), rtol=TOL[dtype], atol=TOL[dtype])


def test_gradients_match_float64_reference():
    x = torch.randn(3, 5, 2 * 24) * 4
    x[0, 0, :4] = torch.tensor([-120.0, 120.0, -90.0, 0.0])  # exp overflow must not give NaN
    x.requires_grad_()
    g = torch.randn(3, 5, 24)
    (silu_and_mul(x) * g).sum().backward()
    xd = x.detach().double().requires_grad_()
    (_reference(xd) * g.double()).sum().backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "x",
    [torch.randn(2, 8).half(), torch.ones(2, 8, dtype=torch.int64), torch.randn(2, 7), torch.randn(8, 4).t()],
)
def test_bad_input_raises(x):
    with pytest.raises(ValueError):
        silu_and_mul(x)
