"""gated_delta_rule (torch path): accuracy against a float64 reference of the formulas, transformers'
Qwen3-Next conventions, decode == prefill == chunked prefill == training bit for bit over random
schedules, gradients against float64 autograd, refusals."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (importlib import mode)

from gated_delta_reference import (  # noqa: E402
    check_continuation,
    check_gdn_schedules,
    first_difference,
    gdn_inputs,
    gdn_reference,
    packed_cu,
)

from vexact_vllm.kernels import gated_delta_rule, gated_delta_rule_cached  # noqa: E402

LENGTHS = [7, 1, 12, 3, 18]
# (HK, HV, DK, DV): GQA-like ratios 2 and 3, odd head dims
SHAPES = [(2, 4, 16, 8), (1, 3, 24, 40)]
# dtype -> (atol of o, rtol of o): bf16 outputs are rounded once
TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (3e-3, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_accuracy_against_float64(dtype, shape):
    inputs = gdn_inputs(LENGTHS, *shape, dtype=dtype)
    o, final = gated_delta_rule(**inputs)
    assert o.dtype == dtype and final.dtype == torch.float32
    want_o, want_final = gdn_reference(**inputs)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(o.double(), want_o, atol=atol, rtol=rtol)
    torch.testing.assert_close(final.double(), want_final, atol=2e-6, rtol=1e-5)
    h0 = torch.randn(final.shape, generator=torch.Generator().manual_seed(3)) * 0.5
    o, final = gated_delta_rule(**inputs, initial_state=h0)
    want_o, want_final = gdn_reference(**inputs, initial_state=h0)
    torch.testing.assert_close(o.double(), want_o, atol=atol, rtol=rtol)
    torch.testing.assert_close(final.double(), want_final, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("chunked", [False, True], ids=["recurrent", "chunked"])
def test_matches_transformers_qwen3_next(chunked):
    """transformers' torch_{recurrent,chunk}_gated_delta_rule in fp32, given q/k repeated over the v
    heads, g and beta as its GatedDeltaNet computes them, and l2 norm in the kernel; its state is the
    transpose of ours."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    theirs = modeling.torch_chunk_gated_delta_rule if chunked else modeling.torch_recurrent_gated_delta_rule
    hk, hv = 2, 4
    inputs = gdn_inputs([70], hk, hv, 16, 8)
    o, final = gated_delta_rule(**inputs)
    g = -inputs["A_log"].exp() * F.softplus(inputs["a"] + inputs["dt_bias"])
    beta = inputs["b"].sigmoid()
    q, k = (inputs[n].repeat_interleave(hv // hk, dim=1)[None] for n in ("q", "k"))
    want_o, want_state = theirs(
        q, k, inputs["v"][None], g[None], beta[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(o, want_o[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(final[0], want_state[0].transpose(-1, -2), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_prefill_and_training_agree_bitwise(dtype, shape):
    inputs = gdn_inputs(LENGTHS, *shape, dtype=dtype, seed=1)
    check_gdn_schedules(gated_delta_rule, gated_delta_rule_cached, inputs)
    check_continuation(gated_delta_rule, inputs)


def test_batch_invariance():
    inputs = gdn_inputs(LENGTHS, 2, 4, 16, 8, dtype=torch.bfloat16)
    o, final = gated_delta_rule(**inputs)
    cu = inputs["cu_seqlens"].tolist()
    for n in range(len(LENGTHS)):
        rows = slice(cu[n], cu[n + 1])
        alone = {**inputs, **{m: inputs[m][rows] for m in "qkvab"}, "cu_seqlens": packed_cu([LENGTHS[n]])}
        o_n, final_n = gated_delta_rule(**alone)
        assert torch.equal(o_n, o[rows]), f"sequence {n}: {first_difference(o_n, o[rows])}"
        assert torch.equal(final_n[0], final[n])


def test_gradients_match_float64_autograd():
    inputs = gdn_inputs([9, 1, 14], 2, 4, 16, 8, seed=2)
    gen = torch.Generator().manual_seed(4)
    h0 = torch.randn(3, 4, 8, 16, generator=gen) * 0.5
    names = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
    leaves = {n: inputs[n].clone().requires_grad_() for n in names}
    leaves["initial_state"] = h0.clone().requires_grad_()
    do = torch.randn(inputs["v"].shape, generator=gen)
    d_final = torch.randn(h0.shape, generator=gen)
    o, final = gated_delta_rule(**leaves, cu_seqlens=inputs["cu_seqlens"])
    ((o * do).sum() + (final * d_final).sum()).backward()
    ref = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    want_o, want_final = gdn_reference(**ref, cu_seqlens=inputs["cu_seqlens"])
    ((want_o * do.double()).sum() + (want_final * d_final.double()).sum()).backward()
    for name, leaf in leaves.items():
        want = ref[name].grad
        torch.testing.assert_close(leaf.grad.double(), want, atol=2e-5 * want.abs().max().item(), rtol=1e-4,
                                   msg=lambda m, name=name: f"d {name}: {m}")  # fmt: skip


def test_refusals():
    inputs = gdn_inputs([3, 2], 2, 4, 16, 8)
    cache = torch.zeros(2, 4, 8, 16)
    slots, has = torch.tensor([0, 1]), torch.tensor([False, True])
    rows = {m: inputs[m] for m in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "cu_seqlens")}
    with pytest.raises(ValueError, match="multiple of HK"):
        gated_delta_rule(
            **{**rows, "v": inputs["v"][:, :3], "a": inputs["a"][:, :3], "b": inputs["b"][:, :3]}
        )
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_rule(**{**rows, "cu_seqlens": packed_cu([3, 3])})
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule(**rows, initial_state=torch.zeros(2, 4, 16, 8))
    with pytest.raises(ValueError, match="state_cache"):
        gated_delta_rule_cached(**rows, state_cache=cache.double(), slots=slots, has_state=has)
    with pytest.raises(ValueError, match="distinct"):
        gated_delta_rule_cached(**rows, state_cache=cache, slots=torch.tensor([1, 1]), has_state=has)
    with pytest.raises(ValueError, match="inference only"):
        gated_delta_rule_cached(**{**rows, "q": inputs["q"].requires_grad_()}, state_cache=cache, slots=slots,
                                has_state=has)  # fmt: skip
