"""causal_conv1d (torch path): accuracy against a float64 conv, transformers' conventions, decode ==
chunked prefill == training bit for bit over random schedules, gradients, refusals."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (importlib import mode)

from gated_delta_reference import (  # noqa: E402
    check_conv_schedules,
    conv_inputs,
    conv_reference,
    first_difference,
    packed_cu,
)

from vexact_vllm.kernels import causal_conv1d  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LENGTHS = [5, 1, 9, 2, 14]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,bias", [(4, False), (4, True), (2, True)])
def test_accuracy_against_float64(dtype, width, bias):
    x, w, b, cu = conv_inputs(LENGTHS, 37, width, dtype, bias)
    y = causal_conv1d(x, w, b, cu)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), conv_reference(x, w, b, cu), rtol=TOL[dtype], atol=TOL[dtype])


def test_matches_transformers_conv():
    """transformers' Qwen3-Next conv (torch fallback, [B, C, L] layout, weight [C, W]) in fp32."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, w, b, cu = conv_inputs([11], 24, 4, torch.float32, bias=False)
    theirs = (
        modeling.causal_conv1d_fn.__wrapped__ if hasattr(modeling.causal_conv1d_fn, "__wrapped__") else None
    )
    theirs = theirs or modeling.causal_conv1d_fn
    want = theirs(x.T[None], w, None, activation="silu")[0].T
    torch.testing.assert_close(causal_conv1d(x, w, b, cu), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [4, 2])
def test_decode_prefill_and_training_agree_bitwise(dtype, width):
    x, w, b, cu = conv_inputs(LENGTHS, 37, width, dtype)
    check_conv_schedules(causal_conv1d, x, w, b, cu)


def test_batch_invariance():
    x, w, b, cu = conv_inputs(LENGTHS, 37, 4, torch.bfloat16)
    full = causal_conv1d(x, w, b, cu)
    for n in range(len(LENGTHS)):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        alone = causal_conv1d(x[rows], w, b, packed_cu([LENGTHS[n]]))
        assert torch.equal(alone, full[rows]), f"sequence {n}: {first_difference(alone, full[rows])}"


@pytest.mark.parametrize("bias", [False, True])
def test_gradients_match_float64_autograd(bias):
    x, w, b, cu = conv_inputs(LENGTHS, 19, 4, torch.float32, bias)
    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    (causal_conv1d(leaves[0], leaves[1], leaves[2] if bias else None, cu) * dy).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in leaves]
    (conv_reference(ref[0], ref[1], ref[2] if bias else None, cu) * dy.double()).sum().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)


def test_refusals():
    x, w, b, cu = conv_inputs([3, 2], 8, 4, torch.float32)
    state = torch.zeros(2, 3, 8)
    slots, has = torch.tensor([0, 1]), torch.tensor([False, False])
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, w[:4], b, cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x, w, b, packed_cu([3, 3]))
    with pytest.raises(ValueError, match="all three or none"):
        causal_conv1d(x, w, b, cu, state)
    with pytest.raises(ValueError, match="distinct"):
        causal_conv1d(x, w, b, cu, state, torch.tensor([1, 1]), has)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(x, w, b, cu, torch.zeros(2, 2, 8), slots, has)
    with pytest.raises(ValueError, match="inference only"):
        causal_conv1d(x.requires_grad_(), w, b, cu, state, slots, has)
