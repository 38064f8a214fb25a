import pytest
import torch

from vexact_vllm.kernels import add_rms_norm, rms_norm

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
EPS = 1e-6


def _reference(x, w, eps):
    x = x.double()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [127, 1024])
def test_row_alone_equals_row_in_batch(threads, dtype, hidden):
    x = torch.randn(129, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    with threads(2):
        full = rms_norm(x, w, EPS)
        for m in (1, 5, 64, 127):
            assert torch.equal(rms_norm(x[:m], w, EPS), full[:m])
        assert torch.equal(rms_norm(x[77], w, EPS), full[77])
        assert torch.equal(rms_norm(x.view(3, 43, hidden), w, EPS), full.view(3, 43, hidden))
    with threads(1):
        assert torch.equal(rms_norm(x, w, EPS), full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm(threads, dtype):
    x = torch.randn(65, 256).to(dtype)
    r = torch.randn(65, 256).to(dtype)
    w = torch.randn(256).to(dtype)
    out, new_r = add_rms_norm(x, r, w, EPS)
    assert new_r.dtype == dtype and torch.equal(new_r, (x.float() + r.float()).to(dtype))
    assert torch.equal(out, rms_norm(new_r, w, EPS))
    with threads(1):
        out1, new_r1 = add_rms_norm(x[3:4], r[3:4], w, EPS)
    assert torch.equal(out1, out[3:4]) and torch.equal(new_r1, new_r[3:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accuracy(dtype):
    x = torch.randn(33, 300).to(dtype)
    w = torch.rand(300).to(dtype) + 0.5
    torch.testing.assert_close(
        rms_norm(x, w, EPS).double(), _reference(x, w, EPS), rtol=TOL[dtype], atol=TOL[dtype]
    )


def test_fp32_weight_with_bf16_input():
    x = torch.randn(4, 64).bfloat16()
    w = torch.rand(64) + 0.5
    y = rms_norm(x, w, EPS)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _reference(x, w, EPS), rtol=2e-2, atol=2e-2)


def test_gradients_match_float64_reference():
    x = torch.randn(7, 96, requires_grad=True)
    w = (torch.rand(96) + 0.5).requires_grad_()
    g = torch.randn(7, 96)
    (rms_norm(x, w, EPS) * g).sum().backward()
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    (_reference(xd, wd, EPS) * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-4, atol=1e-5)


def test_add_rms_norm_gradients():
    x = torch.randn(5, 32, requires_grad=True)
    r = torch.randn(5, 32, requires_grad=True)
    w = (torch.rand(32) + 0.5).requires_grad_()
    out, new_r = add_rms_norm(x, r, w, EPS)
    (out.sum() + new_r.square().sum()).backward()
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
    s = xd + rd
    (_reference(s, wd, EPS).sum() + s.square().sum()).backward()
    for got, want in ((x.grad, xd.grad), (r.grad, rd.grad), (w.grad, wd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "x,w",
    [
        (torch.randn(2, 8).half(), torch.randn(8).half()),
        (torch.ones(2, 8, dtype=torch.int32), torch.ones(8)),
        (torch.randn(2, 8), torch.randn(7)),
        (torch.randn(2, 8), torch.randn(2, 8)),
        (torch.randn(8, 2).t(), torch.randn(2)),
    ],
)
def test_bad_input_raises(x, w):
    with pytest.raises(ValueError):
        rms_norm(x, w, EPS)


def test_add_rms_norm_bad_residual():
    with pytest.raises(ValueError):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).bfloat16(), torch.randn(8), EPS)
    with pytest.raises(ValueError):
        add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), EPS)
