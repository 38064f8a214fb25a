"""Per-head linear maps (`kernels/gemm/head_linear.py`, MLA's absorption and up-projection): the torch
path and the Triton kernel under the interpreter on CPU (odd shapes, weights as strided views of a
larger parameter, as `kv_b_proj.weight` gives them), the compiled kernel on CUDA at DeepSeek's MLA
sizes. Invariance is `torch.equal`; accuracy and gradients against float64."""

import importlib
import sys

import pytest
import torch

from vexact_vllm.kernels import head_linear

MODULE = "vexact_vllm.kernels.gemm.head_linear_triton"
op = importlib.import_module("vexact_vllm.kernels.gemm.head_linear")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # fp32 accumulation; bf16: the output's rounding


def _kv_b(heads, nope, v, rank, dtype, device="cpu"):
    """A `kv_b_proj.weight` [H * (Dn + Dv), C] and its per-head views: W_UK^T [H, C, Dn] (transposed)
    and W_UV [H, Dv, C], as model_patches/mla.py takes them."""
    w = (torch.randn(heads * (nope + v), rank, device=device) / rank**0.5).to(dtype)
    per_head = w.view(heads, nope + v, rank)
    return w, per_head[:, :nope].transpose(1, 2), per_head[:, nope:]


def _reference(x, w):
    return torch.einsum("thk,hnk->thn", x.double(), w.double())


def _check(run, tokens, heads, nope, v, rank, dtype, rounds_to_nearest=True):
    """Accuracy, rows alone vs in any batch, views vs contiguous copies: both of MLA's maps.
    `rounds_to_nearest`: False under the Triton interpreter, whose fp32 -> bf16 cast truncates."""
    _, w_uk_t, w_uv = _kv_b(heads, nope, v, rank, dtype)
    for x_dim, w in ((nope, w_uk_t), (rank, w_uv)):
        x = torch.randn(tokens, heads, x_dim).to(dtype)
        full = run(x, w, dtype)
        assert full.shape == (tokens, heads, w.shape[1]) and full.dtype == dtype
        torch.testing.assert_close(full.double(), _reference(x, w), rtol=TOL[dtype], atol=TOL[dtype])
        assert torch.equal(run(x, w.contiguous(), dtype), full)  # the layout loads, never reorders
        for i in (0, tokens // 2, tokens - 1):
            assert torch.equal(run(x[i : i + 1], w, dtype), full[i : i + 1]), i
        for size in (3, 17):
            for start in range(0, tokens, size):
                assert torch.equal(run(x[start : start + size], w, dtype), full[start : start + size]), (size, start)
        wide = torch.zeros(tokens, heads + 1, x_dim + 8, dtype=dtype)  # x with strided tokens and heads
        wide[:, 1:, 5 : 5 + x_dim] = x
        assert torch.equal(run(wide[:, 1:, 5 : 5 + x_dim], w, dtype), full)
        if rounds_to_nearest:
            assert torch.equal(run(x, w, torch.float32).to(dtype), full)  # one accumulation, rounded once


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads,nope,v,rank", [(37, 3, 16, 24, 40), (5, 1, 24, 16, 72)])
def test_torch_path(dtype, tokens, heads, nope, v, rank):
    _check(lambda x, w, out: head_linear(x, w, out), tokens, heads, nope, v, rank, dtype)


@pytest.fixture(scope="module")
def interp(import_interpreted):
    return import_interpreted(MODULE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_interpreted(interp, monkeypatch, dtype):
    """16x16 tiles: the tiny problem spans several row and column tiles and K steps, with tails."""
    monkeypatch.setattr(interp, "BLOCK_M", 16)
    monkeypatch.setattr(interp, "BLOCK_N", 16)
    monkeypatch.setattr(interp, "HEAD_BLOCK_K", 16)
    _check(interp.head_linear_triton, 37, 2, 24, 16, 40, dtype, rounds_to_nearest=False)


def test_gradients_match_float64(interp, monkeypatch):
    """Both backends' gradients (x and the weight's view, which reaches the parameter) against float64."""
    monkeypatch.setitem(sys.modules, MODULE, interp)
    monkeypatch.setattr(interp, "BLOCK_M", 16)
    monkeypatch.setattr(interp, "BLOCK_N", 16)
    for backend in ("torch", "triton"):
        monkeypatch.setattr(op, "backend_for", lambda x, backend=backend: backend)
        param, w_uk_t, w_uv = _kv_b(3, 16, 24, 40, torch.float32)
        param.requires_grad_()
        per_head = param.view(3, 40, 40)
        w_uk_t, w_uv = per_head[:, :16].transpose(1, 2), per_head[:, 16:]
        x = torch.randn(9, 3, 16, requires_grad=True)
        g = torch.randn(9, 3, 24)
        (head_linear(head_linear(x, w_uk_t), w_uv) * g).sum().backward()
        xd, pd = x.detach().double().requires_grad_(), param.detach().double().requires_grad_()
        ph = pd.view(3, 40, 40)
        (_reference(_reference(xd, ph[:, :16].transpose(1, 2)), ph[:, 16:]) * g.double()).sum().backward()
        torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(param.grad.double(), pd.grad, rtol=1e-5, atol=1e-6)


def test_bad_input_raises():
    x, w = torch.randn(4, 2, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"\[H, N, K\]"):
        head_linear(x, torch.randn(3, 5, 8))
    with pytest.raises(ValueError, match=r"\[H, N, K\]"):
        head_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        head_linear(torch.randn(4, 2, 8).transpose(0, 2).contiguous().transpose(0, 2), w)
    with pytest.raises(ValueError, match="out_dtype"):
        head_linear(x, w, torch.float16)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_at_mla_sizes(heads):
    """Moonlight / V3 at TP=1: 128 + 512 absorption and 512 -> 128 up-projection, bf16, rows alone and
    in batches of any size against the whole batch, views against copies, accuracy against float64."""
    _check(lambda x, w, out: head_linear(x.cuda(), w.cuda(), out).cpu(), 300, heads, 128, 128, 512, torch.bfloat16)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_gradients_at_mla_sizes(heads):
    """The bf16 backward on CUDA (batched cuBLAS, fp32 accumulation) at 128 + 512 through both views of
    kv_b_proj: against float64 relative to each gradient's scale, and the same bits when run again."""
    torch.manual_seed(heads)
    param = (torch.randn(heads * 256, 512) * 0.05).to(torch.bfloat16).cuda()
    x = torch.randn(300, heads, 128).to(torch.bfloat16).cuda()
    g = torch.randn(300, heads, 128).to(torch.bfloat16).cuda()

    def grads(dtype):
        p, xs = param.to(dtype, copy=True).requires_grad_(), x.to(dtype, copy=True).requires_grad_()
        per_head = p.view(heads, 256, 512)
        w_uk_t, w_uv = per_head[:, :128].transpose(1, 2), per_head[:, 128:]
        if dtype == torch.float64:
            y = _reference(_reference(xs, w_uk_t), w_uv)
        else:
            y = head_linear(head_linear(xs, w_uk_t), w_uv)
        (y * g.to(y.dtype)).sum().backward()
        return xs.grad, p.grad

    got, again, want = grads(torch.bfloat16), grads(torch.bfloat16), grads(torch.float64)
    for a, b, w in zip(got, again, want):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
        assert (a.double() - w).abs().max() / w.abs().max() < 2e-2
