"""Triton SiLU-and-mul: the interpreter on CPU tensors (tiny shapes), the compiled kernels on CUDA."""

import importlib

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import

from vexact_vllm.kernels import dispatch, silu_and_mul  # noqa: E402

MODULE = "vexact_vllm.kernels.gemm.activation_triton"
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")



@pytest.fixture(scope="module")
def tk(import_interpreted):
    return import_interpreted(MODULE)


def _reference(x):
    a, b = x.double().chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


def _check(mod, x):
    y = mod.silu_and_mul_triton(x)
    inter = x.shape[-1] // 2
    assert y.shape == (*x.shape[:-1], inter) and y.dtype == x.dtype
    tol = TOL[x.dtype]
    torch.testing.assert_close(y.double(), _reference(x), rtol=tol, atol=tol)
    for m in (1, 5):
        assert torch.equal(mod.silu_and_mul_triton(x[:m]), y[:m])
    for i in (0, x.shape[0] - 1):
        assert torch.equal(mod.silu_and_mul_triton(x[i]), y[i])
    return y


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [24, 40, 130])
def test_accuracy_and_invariance(tk, dtype, inter):
    _check(tk, (torch.randn(17, 2 * inter) * 4).to(dtype))


def test_several_column_blocks_and_leading_dims(tk, monkeypatch):
    monkeypatch.setattr(tk, "_BLOCK", 16)  # 130 columns -> 9 column blocks
    x = torch.randn(3, 4, 2 * 130) * 4
    y = tk.silu_and_mul_triton(x)
    torch.testing.assert_close(y.double(), _reference(x), rtol=1e-5, atol=1e-5)
    wide = torch.randn(5, 300)[:, :260]  # row stride 300, unit last stride
    assert torch.equal(tk.silu_and_mul_triton(wide), tk.silu_and_mul_triton(wide.contiguous()))
    assert tk.silu_and_mul_triton(torch.randn(0, 8)).shape == (0, 4)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's exp(120), as intended
def test_gradients_match_float64_reference(tk):
    x = torch.randn(3, 5, 2 * 24) * 4
    x[0, 0, :4] = torch.tensor([-120.0, 120.0, -90.0, 0.0])  # exp overflow must not give NaN
    x.requires_grad_()
    g = torch.randn(3, 5, 24)
    (tk.silu_and_mul_triton(x) * g).sum().backward()
    xd = x.detach().double().requires_grad_()
    (_reference(xd) * g.double()).sum().backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "x",
    [torch.randn(2, 8).half(), torch.ones(2, 8, dtype=torch.int64), torch.randn(2, 7), torch.randn(8, 4).t()],
)
def test_bad_input_raises(tk, x):
    with pytest.raises(ValueError):
        tk.silu_and_mul_triton(x)


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels, real sizes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [6144, 11008])
def test_cuda_accuracy_and_invariance(dtype, inter):
    mod = importlib.import_module(MODULE)
    x = (torch.randn(300, 2 * inter, device="cuda") * 4).to(dtype)
    y = _check(mod, x)
    for m in (2, 64, 257):
        assert torch.equal(mod.silu_and_mul_triton(x[:m]), y[:m])
        assert torch.equal(mod.silu_and_mul_triton(x[300 - m :]), y[300 - m :])
    with pytest.MonkeyPatch.context() as mp:  # the public op on the Triton backend is this kernel
        mp.setattr(dispatch, "_CUDA_BACKEND", "triton")
        assert torch.equal(silu_and_mul(x), y)


@pytest.mark.cuda
@requires_cuda
def test_cuda_gradients():
    mod = importlib.import_module(MODULE)
    x = torch.randn(300, 2 * 6144, device="cuda") * 4
    x[0, :4] = torch.tensor([-120.0, 120.0, -90.0, 0.0])
    x.requires_grad_()
    g = torch.randn(300, 6144, device="cuda")
    (mod.silu_and_mul_triton(x) * g).sum().backward()
    xd = x.detach().double().requires_grad_()
    (_reference(xd) * g.double()).sum().backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
