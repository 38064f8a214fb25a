"""Triton causal conv1d: the interpreter on CPU tensors (small shapes), the compiled kernels on CUDA.
Accuracy against a float64 conv, decode == chunked prefill == training bit for bit, the backward
kernels' gradients against float64 autograd, deterministic."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import
sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (importlib import mode)

from gated_delta_reference import check_conv_schedules, conv_inputs, conv_reference, packed_cu  # noqa: E402

MODULE = "vexact_vllm.kernels.gated_delta.causal_conv1d_triton"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LENGTHS = [5, 1, 9, 2, 14]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def conv(import_interpreted):
    return import_interpreted(MODULE).causal_conv1d_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,bias", [(4, False), (3, True)])
def test_accuracy_and_schedules(conv, dtype, width, bias):
    x, w, b, cu = conv_inputs(LENGTHS, 300, width, dtype, bias)  # two channel blocks, the second partial
    full = check_conv_schedules(conv, x, w, b, cu, seeds=(0, 1))
    torch.testing.assert_close(full.double(), conv_reference(x, w, b, cu), rtol=TOL[dtype], atol=TOL[dtype])


def test_torch_path_agrees_to_rounding(conv):
    from vexact_vllm.kernels.gated_delta.causal_conv1d import causal_conv1d_torch

    x, w, b, cu = conv_inputs(LENGTHS, 40, 4, torch.float32)
    torch.testing.assert_close(conv(x, w, b, cu), causal_conv1d_torch(x, w, b, cu), rtol=1e-6, atol=1e-6)


def test_strided_rows_and_empty_sequences(conv):
    x, w, b, _ = conv_inputs([4, 6], 16, 4, torch.float32)
    wide = torch.randn(10, 40)
    wide[:, 8:24] = x
    cu = packed_cu([4, 0, 6])
    assert torch.equal(conv(wide[:, 8:24], w, b, cu), conv(x.contiguous(), w, b, cu))
    state = torch.zeros(3, 3, 16)
    y = conv(x[:0], w, b, packed_cu([0]), state, torch.tensor([1]), torch.tensor([False]))
    assert y.shape == (0, 16) and torch.equal(state, torch.zeros(3, 3, 16))


@pytest.mark.parametrize("bias", [False, True])
def test_gradients_match_float64_autograd(conv, bias):
    x, w, b, cu = conv_inputs(LENGTHS, 19, 4, torch.float32, bias)
    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    (conv(leaves[0], leaves[1], leaves[2] if bias else None, cu) * dy).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in leaves]
    (conv_reference(ref[0], ref[1], ref[2] if bias else None, cu) * dy.double()).sum().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)


def test_backward_blocks_deterministic_and_accurate(conv, monkeypatch):
    """Several token and channel blocks (the backward's partial sums of dw, db over token blocks of 8):
    two runs give the same bits, and the gradients match float64 autograd."""
    monkeypatch.setitem(conv.__globals__["conv_backward"].__globals__, "BLOCK_T", 8)
    dtype = torch.float32
    x, w, b, cu = conv_inputs([9, 2, 6, 1], 140, 4, dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        conv(*leaves, cu).backward(dy)
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b_) for a, b_ in zip(*grads)), "the backward is not deterministic"
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    conv_reference(*ref, cu).backward(dy.double())
    for got, want in zip(grads[0], ref):
        torch.testing.assert_close(got.double(), want.grad, rtol=1e-5, atol=1e-5 * want.grad.abs().max().item())


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_schedules_at_qwen3_next_width(dtype):
    """conv_dim of Qwen3-Next-80B-A3B's GDN layers: 2 * 16 * 128 (q, k) + 32 * 128 (v)."""
    from vexact_vllm.kernels.gated_delta.causal_conv1d_triton import causal_conv1d_triton

    x, w, b, cu = conv_inputs([300, 1, 77, 2, 129], 8192, 4, dtype, bias=False)
    x, w, cu = x.cuda(), w.cuda(), cu.cuda()
    full = check_conv_schedules(causal_conv1d_triton, x, w, None, cu, seeds=(0,))
    want = conv_reference(x.cpu(), w.cpu(), None, cu.cpu())
    torch.testing.assert_close(full.double().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.cuda
@requires_cuda
def test_cuda_backward_at_qwen35_width():
    """The backward kernels at Qwen3.5's conv width (2 * 16 * 128 + 48 * 128), bf16: deterministic, and
    against float64 autograd to bf16's rounding."""
    from vexact_vllm.kernels.gated_delta.causal_conv1d_triton import causal_conv1d_triton

    x, w, b, cu = conv_inputs([300, 1, 77, 129], 10240, 4, torch.bfloat16, bias=False)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    grads = []
    for _ in range(2):
        leaves = [t.cuda().requires_grad_() for t in (x, w)]
        causal_conv1d_triton(*leaves, None, cu.cuda()).backward(dy.cuda())
        grads.append([t.grad.cpu() for t in leaves])
    assert all(torch.equal(a, b_) for a, b_ in zip(*grads)), "the backward is not deterministic"
    ref = [t.double().requires_grad_() for t in (x, w)]
    conv_reference(*ref, None, cu).backward(dy.double())
    for got, want in zip(grads[0], ref):
        torch.testing.assert_close(got.double(), want.grad, rtol=3e-2, atol=3e-2 * want.grad.abs().max().item())


@pytest.mark.cuda
@requires_cuda
def test_cuda_replayed_graph_padding():
    """A decode graph replayed for fewer requests than it was captured with: padded requests (slot -1, no
    rows) and padding rows (random) past the last sequence's end. The real rows' bits and the slots are
    those of the call without padding; a padded request has none, so no other slot changes."""
    from vexact_vllm.kernels.gated_delta.causal_conv1d_triton import causal_conv1d_triton

    g = torch.Generator().manual_seed(3)
    x, w, _, _ = conv_inputs([1] * 12, 8192, 4, torch.bfloat16)
    state = torch.randn(40, 3, 8192, generator=g).to(torch.bfloat16)
    slots = torch.randperm(40, generator=g)[:12].to(torch.int32)
    has = torch.rand(12, generator=g) < 0.8
    x, w, state, slots, has = x.cuda(), w.cuda(), state.cuda(), slots.cuda(), has.cuda()
    want_state = state.clone()
    want = causal_conv1d_triton(x, w, None, packed_cu([1] * 12).cuda(), want_state, slots, has)
    padded = torch.cat([x, torch.randn(4, 8192, generator=g).to(x)])
    pad_slots = torch.cat([slots, torch.full((4,), -1, dtype=torch.int32, device="cuda")])
    pad_has = torch.cat([has, torch.zeros(4, dtype=torch.bool, device="cuda")])
    got = causal_conv1d_triton(padded, w, None, packed_cu([1] * 12 + [0] * 4).cuda(), state, pad_slots, pad_has)
    torch.cuda.synchronize()
    assert torch.equal(got[:12], want) and torch.equal(state, want_state)
