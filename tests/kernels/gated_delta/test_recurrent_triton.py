"""Triton gated delta rule (design A, one recurrent kernel): the interpreter on CPU tensors (small
shapes), the compiled kernels on CUDA. Accuracy against the float64 reference, decode == prefill ==
chunked prefill == training bit for bit over random schedules, the reverse-recurrence backward
against float64 autograd."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import
sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (importlib import mode)

from gated_delta_reference import (  # noqa: E402
    check_continuation,
    check_gdn_schedules,
    gdn_inputs,
    gdn_reference,
    truncate_to_bf16,
)

MODULES = ("vexact_vllm.kernels.gated_delta.recurrent_triton", "vexact_vllm.kernels.gated_delta.recurrent_triton_bwd")
LENGTHS = [6, 1, 11, 3]
# (HK, HV, DK, DV): DK 24 pads the k block to 32; DV 40 takes two v tiles, the second masked
SHAPES = [(2, 4, 16, 8), (1, 2, 24, 40)]
TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (3e-3, 1e-2)}
NAMES = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def modules(interpreted_modules):
    return interpreted_modules(MODULES)


@pytest.fixture(scope="module")
def gdn(modules):
    return modules[0]


def _assert_accuracy(o, final, inputs, initial_state=None):
    rounding = truncate_to_bf16 if o.device.type == "cpu" else None  # the interpreter truncates to bf16
    cpu = {n: t.cpu() for n, t in inputs.items()}
    want_o, want_final = gdn_reference(**cpu, initial_state=initial_state, beta_rounding=rounding)
    atol, rtol = TOL[inputs["q"].dtype]
    torch.testing.assert_close(o.double().cpu(), want_o, atol=atol, rtol=rtol)
    torch.testing.assert_close(final.double().cpu(), want_final, atol=5e-6, rtol=1e-5)


def _check_gradients(forward, inputs, atol=2e-5, rtol=1e-4):
    """Gradients of every input and of the initial state against float64 autograd of the reference,
    with a loss reading the outputs and the final states."""
    device = inputs["v"].device
    n_seqs = inputs["cu_seqlens"].shape[0] - 1
    hv, dv, dk = inputs["v"].shape[1], inputs["v"].shape[2], inputs["q"].shape[2]
    gen = torch.Generator().manual_seed(4)
    leaves = {n: inputs[n].clone().requires_grad_() for n in NAMES}
    leaves["initial_state"] = (
        (torch.randn(n_seqs, hv, dv, dk, generator=gen) * 0.5).to(device).requires_grad_()
    )
    do = torch.randn(inputs["v"].shape, generator=gen).to(device)
    d_final = torch.randn(n_seqs, hv, dv, dk, generator=gen).to(device)
    o, final = forward(**leaves, cu_seqlens=inputs["cu_seqlens"])
    ((o.float() * do).sum() + (final * d_final).sum()).backward()
    ref = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    want_o, want_final = gdn_reference(**ref, cu_seqlens=inputs["cu_seqlens"].cpu())
    ((want_o * do.cpu().double()).sum() + (want_final * d_final.cpu().double()).sum()).backward()
    for name, leaf in leaves.items():
        want = ref[name].grad
        torch.testing.assert_close(leaf.grad.double().cpu(), want, atol=atol * want.abs().max().item(), rtol=rtol,
                                   msg=lambda m, name=name: f"d {name}: {m}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_prefill_and_training_agree_bitwise(gdn, dtype, shape):
    inputs = gdn_inputs(LENGTHS, *shape, dtype=dtype, seed=1)
    o, final = check_gdn_schedules(
        gdn.gated_delta_rule_triton, gdn.gated_delta_rule_cached_triton, inputs, seeds=(0, 1)
    )
    _assert_accuracy(o, final, inputs)
    check_continuation(gdn.gated_delta_rule_triton, inputs)


def test_initial_state_and_torch_path(gdn):
    """From given initial states: accurate, and equal to the torch path to rounding."""
    from vexact_vllm.kernels.gated_delta.recurrent import gated_delta_rule_torch

    inputs = gdn_inputs(LENGTHS, 2, 4, 16, 8)
    h0 = torch.randn(len(LENGTHS), 4, 8, 16, generator=torch.Generator().manual_seed(3)) * 0.5
    o, final = gdn.gated_delta_rule_triton(**inputs, initial_state=h0)
    _assert_accuracy(o, final, inputs, h0)
    o_torch, final_torch = gated_delta_rule_torch(**inputs, initial_state=h0)
    torch.testing.assert_close(o, o_torch, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(final, final_torch, atol=1e-6, rtol=1e-5)


def test_strided_inputs_read_in_place(gdn):
    """q, k, v as views of one fused post-conv row (vLLM's and transformers' split), same bits."""
    inputs = gdn_inputs(LENGTHS, 2, 4, 16, 8)
    n = inputs["q"].shape[0]
    fused = torch.cat([inputs["q"].reshape(n, -1), inputs["k"].reshape(n, -1), inputs["v"].reshape(n, -1)], 1)
    views = {
        "q": fused[:, :32].view(n, 2, 16),
        "k": fused[:, 32:64].view(n, 2, 16),
        "v": fused[:, 64:].view(n, 4, 8),
    }
    o, final = gdn.gated_delta_rule_triton(**{**inputs, **views})
    want_o, want_final = gdn.gated_delta_rule_triton(**inputs)
    assert torch.equal(o, want_o) and torch.equal(final, want_final)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gradients_match_float64_autograd(modules, shape, monkeypatch):
    gdn, bwd = modules
    monkeypatch.setattr(bwd, "CHUNK", 4)  # several checkpoints per sequence, a partial last chunk
    inputs = gdn_inputs([9, 1, 6], *shape, seed=2)
    _check_gradients(gdn.gated_delta_rule_triton, inputs)


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels)
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hv", [32, 48])
def test_cuda_bitwise_at_qwen3_next_shapes(hv):
    """Qwen3-Next / Qwen3.5 GDN heads: 16 k heads, 32 or 48 v heads, d_k = d_v = 128, bf16."""
    from vexact_vllm.kernels.gated_delta.recurrent_triton import (
        gated_delta_rule_cached_triton,
        gated_delta_rule_triton,
    )

    inputs = gdn_inputs([300, 1, 64, 65, 129, 17], 16, hv, 128, 128, dtype=torch.bfloat16, device="cuda")
    o, final = check_gdn_schedules(
        gated_delta_rule_triton, gated_delta_rule_cached_triton, inputs, seeds=(0, 1)
    )
    _assert_accuracy(o, final, inputs)
    check_continuation(gated_delta_rule_triton, inputs)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hk,hv", [(2, 4), (16, 32)], ids=str)
def test_cuda_gradients_match_float64_autograd(hk, hv):
    """The reverse-recurrence backward at d_k = d_v = 128 (several checkpoint chunks a sequence)."""
    from vexact_vllm.kernels.gated_delta.recurrent_triton import gated_delta_rule_triton

    inputs = gdn_inputs([40, 1, 70], hk, hv, 128, 128, device="cuda")
    _check_gradients(gated_delta_rule_triton, inputs, atol=1e-4, rtol=1e-3)
