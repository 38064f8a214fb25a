"""Triton RMSNorm: the interpreter on CPU tensors (tiny shapes), the compiled kernels on CUDA."""

import importlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import

from vexact_vllm.kernels import dispatch, rms_norm  # noqa: E402

MODULE = "vexact_vllm.kernels.norms.rms_norm_triton"
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
EPS = 1e-6
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
rms_norm_module = importlib.import_module("vexact_vllm.kernels.norms.rms_norm")



@pytest.fixture(scope="module")
def tk(import_interpreted):
    return import_interpreted(MODULE)


@pytest.fixture(params=[False, True], ids=["one-block", "chunked"])
def chunked(request, tk, monkeypatch):
    """Run as is, then with a tiny _MAX_BLOCK so that a row of 130 loops over 3 chunks of 64."""
    if request.param:
        monkeypatch.setattr(tk, "_MAX_BLOCK", 64)
    return request.param


def _reference(x, w, eps):
    x = x.double()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def _check_invariance(mod, x, r, w):
    full = mod.rms_norm_triton(x, w, EPS)
    out, new_r = mod.add_rms_norm_triton(x, r, w, EPS)
    for m in (1, 5):
        assert torch.equal(mod.rms_norm_triton(x[:m], w, EPS), full[:m])
        out_m, new_r_m = mod.add_rms_norm_triton(x[:m], r[:m], w, EPS)
        assert torch.equal(out_m, out[:m]) and torch.equal(new_r_m, new_r[:m])
    for i in (0, x.shape[0] - 1):
        assert torch.equal(mod.rms_norm_triton(x[i], w, EPS), full[i])
        out_i, new_r_i = mod.add_rms_norm_triton(x[i], r[i], w, EPS)
        assert torch.equal(out_i, out[i]) and torch.equal(new_r_i, new_r[i])
    assert torch.equal(mod.rms_norm_triton(new_r, w, EPS), out)  # the fused norm is rms_norm of r
    return full, out, new_r


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [24, 40, 130])
def test_accuracy_and_invariance(tk, dtype, hidden):
    x = torch.randn(17, hidden).to(dtype)
    r = torch.randn(17, hidden).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    full, out, new_r = _check_invariance(tk, x, r, w)
    assert full.dtype == dtype and new_r.dtype == dtype
    torch.testing.assert_close(full.double(), _reference(x, w, EPS), rtol=TOL[dtype], atol=TOL[dtype])
    s = x.double() + r.double()
    torch.testing.assert_close(new_r.double(), s, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(out.double(), _reference(s, w, EPS), rtol=TOL[dtype], atol=TOL[dtype])
    if dtype == torch.float32:  # bf16 rounding in the interpreter is not torch's (the GPU's is)
        assert torch.equal(new_r, x + r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_rows(tk, monkeypatch, dtype):
    x = torch.randn(17, 130).to(dtype)
    r = torch.randn(17, 130).to(dtype)
    w = (torch.rand(130) + 0.5).to(dtype)
    one_block = tk.rms_norm_triton(x, w, EPS)
    monkeypatch.setattr(tk, "_MAX_BLOCK", 64)
    full, _, _ = _check_invariance(tk, x, r, w)
    torch.testing.assert_close(full.double(), _reference(x, w, EPS), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(full.double(), one_block.double(), rtol=TOL[dtype], atol=TOL[dtype])


def test_fp32_weight_bf16_input_and_leading_dims(tk):
    x = torch.randn(3, 5, 40).bfloat16()
    w = torch.rand(40) + 0.5
    y = tk.rms_norm_triton(x, w, EPS)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    torch.testing.assert_close(y.double(), _reference(x, w, EPS), rtol=2e-2, atol=2e-2)
    assert torch.equal(tk.rms_norm_triton(x.reshape(15, 40), w, EPS), y.reshape(15, 40))
    wide = torch.randn(6, 100)[:, :40]  # row stride 100, unit last stride
    assert torch.equal(tk.rms_norm_triton(wide, w, EPS), tk.rms_norm_triton(wide.contiguous(), w, EPS))
    assert tk.rms_norm_triton(torch.randn(0, 40), w, EPS).shape == (0, 40)


def test_strided_heads_read_in_place(tk, chunked):
    """Per-head q/k norm: [T, heads, D] views of a fused q|k|v row, read without a copy, same bits."""
    qkv = torch.randn(5, 4 * 130 + 2 * 2 * 130).bfloat16()  # q: 4 heads, k and v: 2 heads each
    q = qkv[:, : 4 * 130].view(5, 4, 130)  # strides (TOTAL, 130, 1): not viewable as 2-D
    k = qkv[:, 4 * 130 : 6 * 130].view(5, 2, 130)
    w = torch.rand(130) + 0.5
    for view in (q, k):
        y = tk.rms_norm_triton(view, w, EPS)
        assert y.shape == view.shape and y.is_contiguous()
        assert torch.equal(y, tk.rms_norm_triton(view.contiguous().reshape(-1, 130), w, EPS).view_as(view))
    assert not torch.equal(tk.rms_norm_triton(q, w, EPS)[:, 1], tk.rms_norm_triton(q, w, EPS)[:, 0])


def test_gradients_match_float64_reference(tk, chunked):
    x = torch.randn(19, 130, requires_grad=True)  # two backward programs, the second one partial
    w = (torch.rand(130) + 0.5).requires_grad_()
    g = torch.randn(19, 130)
    (tk.rms_norm_triton(x, w, EPS) * g).sum().backward()
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    (_reference(xd, wd, EPS) * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-4, atol=1e-5)


def test_add_rms_norm_gradients(tk, chunked):
    x = torch.randn(5, 130, requires_grad=True)
    r = torch.randn(5, 130, requires_grad=True)
    w = (torch.rand(130) + 0.5).requires_grad_()
    g = torch.randn(5, 130)
    out, new_r = tk.add_rms_norm_triton(x, r, w, EPS)
    ((out * g).sum() + new_r.square().sum()).backward()
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
    s = xd + rd
    ((_reference(s, wd, EPS) * g.double()).sum() + s.square().sum()).backward()
    for got, want in ((x.grad, xd.grad), (r.grad, rd.grad), (w.grad, wd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    x.grad = r.grad = w.grad = None
    out, _ = tk.add_rms_norm_triton(x, r, w, EPS)  # new residual unused: its gradient is zero
    (out * g).sum().backward()
    xd.grad = rd.grad = wd.grad = None
    (_reference(xd + rd, wd, EPS) * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-4, atol=1e-5)


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
def test_bad_input_raises(tk, x, w):
    with pytest.raises(ValueError):
        tk.rms_norm_triton(x, w, EPS)


def test_add_rms_norm_bad_residual(tk):
    with pytest.raises(ValueError):
        tk.add_rms_norm_triton(torch.randn(2, 8), torch.randn(2, 8).bfloat16(), torch.randn(8), EPS)
    with pytest.raises(ValueError):
        tk.add_rms_norm_triton(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), EPS)


def test_importing_the_kernels_does_not_import_triton():
    code = "import sys, vexact_vllm.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert set(rms_norm_module._IMPLS) == {"torch", "triton"}
    assert set(rms_norm_module._ADD_IMPLS) == {"torch", "triton"}


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels, real sizes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [2048, 4096, 5120])
def test_cuda_row_alone_equals_row_in_batch(dtype, hidden):
    mod = importlib.import_module(MODULE)
    x = torch.randn(300, hidden, device="cuda").to(dtype)
    r = torch.randn(300, hidden, device="cuda").to(dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    full, out, new_r = _check_invariance(mod, x, r, w)
    for m in (2, 64, 257):
        assert torch.equal(mod.rms_norm_triton(x[:m], w, EPS), full[:m])
        assert torch.equal(mod.rms_norm_triton(x[300 - m :], w, EPS), full[300 - m :])
    assert torch.equal(new_r, (x.float() + r.float()).to(dtype))
    torch.testing.assert_close(full.double(), _reference(x, w, EPS), rtol=TOL[dtype], atol=TOL[dtype])
    with pytest.MonkeyPatch.context() as mp:  # the public op on the Triton backend is this kernel
        mp.setattr(dispatch, "_CUDA_BACKEND", "triton")
        assert torch.equal(rms_norm(x, w, EPS), full)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hidden", [2048, 4096])
def test_cuda_gradients_deterministic_and_accurate(hidden):
    mod = importlib.import_module(MODULE)
    x = torch.randn(1000, hidden, device="cuda", requires_grad=True)
    r = torch.randn(1000, hidden, device="cuda", requires_grad=True)
    w = (torch.rand(hidden, device="cuda") + 0.5).requires_grad_()
    g = torch.randn(1000, hidden, device="cuda")
    grads = []
    for _ in range(2):
        x.grad = r.grad = w.grad = None
        out, new_r = mod.add_rms_norm_triton(x, r, w, EPS)
        ((out * g).sum() + new_r.square().sum()).backward()
        grads.append((x.grad.clone(), r.grad.clone(), w.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
    s = xd + rd
    ((_reference(s, wd, EPS) * g.double()).sum() + s.square().sum()).backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-4, atol=1e-3)


@pytest.mark.cuda
@requires_cuda
def test_cuda_strided_heads_equal_contiguous():
    mod = importlib.import_module(MODULE)
    qkv = torch.randn(300, 4096, device="cuda").bfloat16()  # q 16 heads | k 8 | v 8, head_dim 128
    w = (torch.rand(128, device="cuda") + 0.5).bfloat16()
    for lo, heads in ((0, 16), (2048, 8)):
        view = qkv[:, lo : lo + heads * 128].view(300, heads, 128)
        y = mod.rms_norm_triton(view, w, EPS)
        assert torch.equal(y, mod.rms_norm_triton(view.contiguous().reshape(-1, 128), w, EPS).view_as(view))
        assert torch.equal(y[:7], mod.rms_norm_triton(view[:7], w, EPS))
