"""The PPO outputs (`token_log_probs_and_entropy`: per-token log-probs and entropy, each with a
hand-written chunked backward) against autograd of a float64 reference built from plain torch ops.

Reference, for hidden h [M, H], lm_head W [V, H], targets t [M] (< 0: ignored), requested
temperatures tau [M] and the allowed ids A (the vocabulary mask; all ids without one):
    z = h @ W[A]^T (fp64), s = z / eff(tau), log p = log_softmax(s), H = -sum p log p,
    eff(tau) = 1 where tau == 0, 0.01 where 0 < tau < 0.01, tau elsewhere (logit_rules.py),
and (log p[t], H) set to 0 on ignored rows. Restricting the softmax to A is what -inf logits do: a
masked id has p = 0, adds nothing and gets gradient exactly 0. A random upstream gradient is
backpropagated through both outputs of the op and of the reference.

Tolerances (fp64 reference; errors measured on these cases in parentheses):
- forward (any input dtype; fp32 arithmetic): each log-prob and entropy within 1e-5 relative plus
  4 fp32 ulps of its row's largest |scaled logit| (tau = 0.01 scales the logits 100x, and
  s - logsumexp loses their ulps); measured ~1e-7 relative.
- fp32 inputs: the gradients w.r.t. hidden and weight within a norm-wise relative error of 1e-5
  (measured <= 2e-6).
- bf16 inputs: the op computes in fp32 and returns a bf16 gradient for each output, which autograd
  adds in bf16. With u = 2^-8 (bf16's unit roundoff), elementwise
  |g - (a + b)| <= u (|a| + |b| + |a + b|) + 1e-5 max |a + b|, where a and b are the reference
  gradients through the log-probs and through the entropy (three roundings, plus the fp32
  arithmetic); and norm-wise relative error < 4e-3 (2.0e-3 to 2.7e-3: the roundings' average).
Every draw comes from a `torch.Generator` seeded with the case's seed, printed in each message.
"""

from __future__ import annotations

import pytest
import torch

from vexact_vllm.kernels.logit_rules import MIN_TEMPERATURE
from vexact_vllm.model_patches.trainers import ppo_outputs
from vexact_vllm.model_patches.trainers.ppo_outputs import token_log_probs_and_entropy

HIDDEN = 48
VOCAB = 1500  # not a multiple of the torch path's 1024-long vocabulary block
FP32_REL = 1e-5
FP32_EPS = torch.finfo(torch.float32).eps  # 2^-23
BF16_ROUNDOFF = 2.0**-8  # bf16 unit roundoff: |round(x) - x| <= 2^-8 |x|
BF16_REL = 4e-3


def _scaled_logits(hidden, weight, tau, allowed):
    """fp64 s = (h @ W[A]^T) / eff(tau) [M, A]."""
    eff = torch.where(tau == 0, torch.ones_like(tau), tau.clamp(min=MIN_TEMPERATURE))  # [M]
    return (hidden @ weight[allowed.nonzero()[:, 0]].t()) / eff[:, None]


def reference(hidden, weight, targets, tau, allowed):
    """fp64 (log p(target), entropy) [M] of the module docstring's formula; differentiable."""
    ids = allowed.nonzero()[:, 0]  # [A]
    log_p = torch.log_softmax(_scaled_logits(hidden, weight, tau, allowed), dim=-1)  # [M, A]
    entropy = -(log_p.exp() * log_p).sum(-1)  # [M]
    column = allowed.long().cumsum(0) - 1  # id -> its column among the allowed ids
    valid = targets >= 0
    safe = torch.where(valid, targets, ids[0])  # an ignored row reads any allowed id, then gets 0
    target_log_p = log_p.gather(1, column[safe][:, None])[:, 0]
    zero = torch.zeros_like(entropy)
    return torch.where(valid, target_log_p, zero), torch.where(valid, entropy, zero)


def _case(seed, rows, vocab, dtype, masked, ignored=0):
    """(hidden, weight, targets, allowed, upstream grads of log-probs and entropy), seeded."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(vocab, HIDDEN, generator=g) * 0.3).to(dtype)  # logits of std ~2
    allowed = torch.ones(vocab, dtype=torch.bool)
    if masked:  # verl's rollout mask: the ids past the tokenizer, plus scattered banned ids
        allowed = torch.rand(vocab, generator=g) < 0.9
        allowed[-100:] = False
    ids = allowed.nonzero()[:, 0]
    targets = ids[torch.randint(0, len(ids), (rows,), generator=g)]
    targets[torch.randperm(rows, generator=g)[:ignored]] = -1
    upstream = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    return hidden, weight, targets, allowed, upstream


def _op_gradients(hidden, weight, targets, temperature, allowed, masked, upstream, device):
    """(log-probs, entropy, dL/dhidden, dL/dweight) of the op on `device`, back on the CPU, for
    L = sum(g_lp * lp + g_ent * ent)."""
    h, w = (t.to(device, copy=True).requires_grad_() for t in (hidden, weight))
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device)
    mask = allowed.to(device) if masked else None
    log_p, entropy = token_log_probs_and_entropy(h, w, targets.to(device), temperature, mask)
    g_lp, g_ent = (g.to(device) for g in upstream)
    ((log_p * g_lp).sum() + (entropy * g_ent).sum()).backward()
    return tuple(t.detach().cpu() for t in (log_p, entropy, h.grad, w.grad))


def _reference_gradients(hidden, weight, targets, tau, allowed, upstream, parts=(0, 1)):
    """fp64 (log-probs, entropy) and the gradients w.r.t. (hidden, weight) through the outputs in
    `parts` (0: log-probs, 1: entropy)."""
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    outputs = reference(h, w, targets, tau.double(), allowed)
    torch.stack([(outputs[i] * upstream[i].double()).sum() for i in parts]).sum().backward()
    return outputs[0].detach(), outputs[1].detach(), h.grad, w.grad


def _relative_error(got, want):
    return float((got.double() - want).norm() / want.norm())


def _check_forward(got, want, hidden, weight, tau, allowed, seed):
    """Each output within 1e-5 relative plus 4 fp32 ulps of the row's largest |scaled logit|."""
    scale = _scaled_logits(hidden.double(), weight.double(), tau.double(), allowed).abs().amax(-1)  # [M]
    for name, g, w in zip(("log-probs", "entropy"), got, want):
        bound = 1e-5 * w.abs() + 4 * FP32_EPS * (1 + scale)
        excess = float(((g.double() - w).abs() / bound).max())
        assert excess <= 1.0, f"{name}: error {excess:.2f}x the fp32 bound (seed {seed})"


def _check_fp32(seed, rows, vocab, temperature, masked, ignored=0, device="cpu"):
    hidden, weight, targets, allowed, upstream = _case(seed, rows, vocab, torch.float32, masked, ignored)
    tau = temperature if isinstance(temperature, torch.Tensor) else torch.full((rows,), float(temperature))
    *got, grad_h, grad_w = _op_gradients(
        hidden, weight, targets, temperature, allowed, masked, upstream, device
    )
    *want, ref_h, ref_w = _reference_gradients(hidden, weight, targets, tau, allowed, upstream)
    _check_forward(got, want, hidden, weight, tau, allowed, seed)
    for name, g, w in (("hidden", grad_h, ref_h), ("weight", grad_w, ref_w)):
        err = _relative_error(g, w)
        assert g.dtype == torch.float32 and err < FP32_REL, (
            f"d/d{name}: relative error {err:.2e} (seed {seed})"
        )
    assert bool((grad_w[~allowed] == 0).all()), f"masked ids got a gradient (seed {seed})"
    assert bool((grad_h[targets < 0] == 0).all()), f"ignored rows got a gradient (seed {seed})"


def _check_bf16(seed, rows, masked, device="cpu"):
    temperature = 0.7
    hidden, weight, targets, allowed, upstream = _case(seed, rows, VOCAB, torch.bfloat16, masked)
    tau = torch.full((rows,), temperature)
    *got, grad_h, grad_w = _op_gradients(
        hidden, weight, targets, temperature, allowed, masked, upstream, device
    )
    *want, ref_h, ref_w = _reference_gradients(hidden, weight, targets, tau, allowed, upstream)
    _check_forward(got, want, hidden, weight, tau, allowed, seed)
    via_log_p = _reference_gradients(hidden, weight, targets, tau, allowed, upstream, (0,))[2:]
    via_entropy = _reference_gradients(hidden, weight, targets, tau, allowed, upstream, (1,))[2:]
    for i, (name, g, w) in enumerate((("hidden", grad_h, ref_h), ("weight", grad_w, ref_w))):
        parts = via_log_p[i].abs() + via_entropy[i].abs() + w.abs()
        excess = float(((g.double() - w).abs() / (BF16_ROUNDOFF * parts + 1e-5 * w.abs().max())).max())
        err = _relative_error(g, w)
        assert g.dtype == torch.bfloat16 and excess <= 1.0 and err < BF16_REL, (
            f"d/d{name}: error {excess:.2f}x the rounding bound, norm-wise {err:.2e} (seed {seed})"
        )
    assert bool((grad_w[~allowed] == 0).all()), f"masked ids got a gradient (seed {seed})"


@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [1, 5, 127])
def test_fp32_gradients_match_fp64_autograd(rows, temperature, masked):
    _check_fp32(seed=rows, rows=rows, vocab=VOCAB, temperature=temperature, masked=masked)


def test_chunked_rows_row_temperatures_and_ignored_targets(monkeypatch):
    """Many entropy chunks (the last one partial), a vocabulary of 1031 ids, per-row temperatures
    through the rule (0 scores at 1, 0.005 at 0.01) and ignored targets (0 and no gradient)."""
    monkeypatch.setattr(ppo_outputs, "ENTROPY_CHUNK_ROWS", 16)
    rows = 127
    tau = torch.tensor([0.0, 0.005, 0.7, 1.0, 1.3]).repeat(26)[:rows]
    _check_fp32(seed=7, rows=rows, vocab=1031, temperature=tau, masked=True, ignored=9)


@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
@pytest.mark.parametrize("rows", [5, 127])
def test_bf16_gradients_within_three_roundings_of_fp64(rows, masked):
    _check_bf16(seed=100 + rows, rows=rows, masked=masked)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_cuda_gradients_match_fp64_autograd(masked):
    """The same bounds on the CUDA path (Triton log-prob and log-softmax kernels, CUDA GEMMs)."""
    for rows in (1, 5, 127):
        for temperature in (1.0, 0.7):
            _check_fp32(
                seed=rows, rows=rows, vocab=VOCAB, temperature=temperature, masked=masked, device="cuda"
            )
        _check_bf16(seed=100 + rows, rows=rows, masked=masked, device="cuda")
