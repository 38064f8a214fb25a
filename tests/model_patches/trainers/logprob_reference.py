"""A float64 reference of the trainer's per-token log-probs and entropy, from plain torch ops, and the
bounds the gradient tests hold the vexact ops to (test_ppo_outputs, test_veomni_loss,
test_verl_actor_logprobs).

Reference, for hidden h [M, H], lm_head W [V, H], targets t [M] (< 0: ignored), requested
temperatures tau [M] and the allowed ids A (the vocabulary mask; all ids without one):
    z = h @ W[A]^T (fp64), s = z / eff(tau), log p = log_softmax(s), H = -sum p log p,
    eff(tau) = 1 where tau == 0, 0.01 where 0 < tau < 0.01, tau elsewhere (logit_rules.py),
and (log p[t], H) set to 0 on ignored rows. Restricting the softmax to A is what -inf logits do: a
masked id has p = 0, adds nothing and gets gradient exactly 0.

Bounds (fp64 reference; the ops compute in fp32 and return gradients in the inputs' dtype):
- forward, any input dtype: each log-prob and entropy within 1e-5 relative plus 4 fp32 ulps of its
  row's largest |scaled logit| (tau = 0.01 scales the logits 100x, and s - logsumexp keeps their
  ulps); measured ~1e-7 relative.
- fp32 inputs: gradients w.r.t. hidden and weight within a norm-wise relative error of 1e-5
  (measured <= 2e-6).
- bf16 inputs: each output's backward rounds its gradient to bf16 and autograd adds them in bf16;
  on CUDA the gradient GEMMs (dH = dZ @ W, dW = dZ^T @ H) also take dZ rounded to bf16 (cuBLAS in
  the input dtype, fp32 accumulation). With u = 2^-8 (bf16's unit roundoff), a and b the reference
  gradients through the log-probs and through the entropy, and P = |dZ| @ |W| (for dH) or
  |dZ|^T @ |H| (for dW) with dZ the reference's gradient of the logits (the GEMM's operands rounded:
  softmax gradients cancel, so this can be far above |a + b|): elementwise
  |g - (a + b)| <= u (|a| + |b| + |a + b| + P) + 1e-5 max |a + b|, and norm-wise relative error
  < 4e-3 (measured 1.5e-3 to 2.7e-3, the roundings' average: a 1% error in a backward exceeds it).
"""

from __future__ import annotations

import torch

from vexact_vllm.kernels.sampling.logit_rules import MIN_TEMPERATURE

FP32_REL = 1e-5
FP32_EPS = torch.finfo(torch.float32).eps  # 2^-23
BF16_ROUNDOFF = 2.0**-8  # bf16 unit roundoff: |round(x) - x| <= 2^-8 |x|
BF16_REL = 4e-3


def _allowed_or_all(allowed, vocab):
    return torch.ones(vocab, dtype=torch.bool) if allowed is None else allowed.cpu()


def scaled_logits(hidden, weight, tau, allowed=None):
    """fp64 s = (h @ W[A]^T) / eff(tau) [M, A]."""
    hidden, weight, tau = (
        t.detach().cpu().double() if not t.requires_grad else t for t in (hidden, weight, tau)
    )
    allowed = _allowed_or_all(allowed, weight.shape[0])
    eff = torch.where(tau == 0, torch.ones_like(tau), tau.clamp(min=MIN_TEMPERATURE))  # [M]
    return (hidden @ weight[allowed.nonzero()[:, 0]].t()) / eff[:, None]


def reference(hidden, weight, targets, tau, allowed=None):
    """fp64 (log p(target), entropy) [M] of the module docstring's formula; differentiable w.r.t.
    fp64 `hidden` and `weight`."""
    allowed = _allowed_or_all(allowed, weight.shape[0])
    return _reference_from_logits(hidden @ weight[allowed.nonzero()[:, 0]].t(), targets, tau, allowed)


def _reference_from_logits(z, targets, tau, allowed):
    """`reference` from the fp64 logits of the allowed ids, z [M, A]."""
    ids = allowed.nonzero()[:, 0]  # [A]
    tau = tau.detach().cpu().double()
    eff = torch.where(tau == 0, torch.ones_like(tau), tau.clamp(min=MIN_TEMPERATURE))  # [M]
    log_p = torch.log_softmax(z / eff[:, None], dim=-1)  # [M, A]
    entropy = -(log_p.exp() * log_p).sum(-1)  # [M]
    column = allowed.long().cumsum(0) - 1  # id -> its column among the allowed ids
    targets = targets.cpu()
    valid = targets >= 0
    safe = torch.where(valid, targets, ids[0])  # an ignored row reads any allowed id, then gets 0
    if not bool(allowed[safe].all()):
        raise ValueError("a target is a masked id (log-prob -inf): the reference has no gradient for it")
    target_log_p = log_p.gather(1, column[safe][:, None])[:, 0]
    zero = torch.zeros_like(entropy)
    return torch.where(valid, target_log_p, zero), torch.where(valid, entropy, zero)


def reference_gradients(hidden, weight, targets, tau, allowed, upstream, parts=(0, 1)):
    """fp64 (log-probs, entropy, dL/dhidden, dL/dweight) for L = sum_i <upstream[i], output i> over
    the outputs in `parts` (0: log-probs, 1: entropy)."""
    h, w = (t.detach().cpu().double().requires_grad_() for t in (hidden, weight))
    outputs = reference(h, w, targets, tau, allowed)
    torch.stack([(outputs[i] * upstream[i].detach().cpu().double()).sum() for i in parts]).sum().backward()
    return outputs[0].detach(), outputs[1].detach(), h.grad, w.grad


def gemm_operand_magnitudes(hidden, weight, targets, tau, allowed, upstream, parts=(0, 1)):
    """fp64 (|dZ| @ |W|, |dZ|^T @ |H|) [M, H] and [V, H]: what rounding dZ (the gradient of the
    logits z = h @ W^T, masked columns 0) before the gradient GEMMs can move each entry of dH and dW."""
    h, w = (t.detach().cpu().double() for t in (hidden, weight))
    z = (h @ w.t()).requires_grad_()  # [M, V]
    allowed = _allowed_or_all(allowed, w.shape[0])
    outputs = _reference_from_logits(z[:, allowed.nonzero()[:, 0]], targets, tau, allowed)
    torch.stack([(outputs[i] * upstream[i].detach().cpu().double()).sum() for i in parts]).sum().backward()
    grad_z = z.grad.abs()  # [M, V]
    return grad_z @ w.abs(), grad_z.t() @ h.abs()


def relative_error(got, want) -> float:
    """Norm-wise ||got - want|| / ||want|| in fp64."""
    return float((got.detach().cpu().double() - want).norm() / want.norm())


def assert_forward_close(got, hidden, weight, targets, tau, allowed, label):
    """`got` = (log-probs, entropy) within the forward bound of the fp64 reference."""
    want = reference(hidden.detach().cpu().double(), weight.detach().cpu().double(), targets, tau, allowed)
    scale = scaled_logits(hidden, weight, tau, allowed).abs().amax(-1)  # [M]
    for name, g, w in zip(("log-probs", "entropy"), got, want):
        bound = 1e-5 * w.abs() + 4 * FP32_EPS * (1 + scale)
        excess = float(((g.detach().cpu().double() - w).abs() / bound).max())
        assert excess <= 1.0, f"{name}: error {excess:.2f}x the fp32 bound ({label})"


def assert_gradients_close(grads, hidden, weight, targets, tau, allowed, upstream, label):
    """grads = (dL/dhidden, dL/dweight) of the op for L = <upstream[0], log-probs> + <upstream[1],
    entropy> (upstream[1] may be None: no entropy), within the module docstring's bound for the
    inputs' dtype; masked vocabulary rows get exactly 0."""
    parts = (0,) if upstream[1] is None else (0, 1)
    want = reference_gradients(hidden, weight, targets, tau, allowed, upstream, parts)[2:]
    if hidden.dtype == torch.bfloat16:
        split = [
            reference_gradients(hidden, weight, targets, tau, allowed, upstream, (i,))[2:] for i in parts
        ]
        products = gemm_operand_magnitudes(hidden, weight, targets, tau, allowed, upstream, parts)
    for i, (name, g) in enumerate(zip(("hidden", "weight"), grads)):
        err = relative_error(g, want[i])
        assert g.dtype == hidden.dtype, f"d/d{name}: {g.dtype} for {hidden.dtype} inputs ({label})"
        if hidden.dtype == torch.float32:
            assert err < FP32_REL, f"d/d{name}: relative error {err:.2e} (bound {FP32_REL}; {label})"
            continue
        magnitude = sum(s[i].abs() for s in split) + want[i].abs() + products[i]
        bound = BF16_ROUNDOFF * magnitude + 1e-5 * want[i].abs().max()
        excess = float(((g.detach().cpu().double() - want[i]).abs() / bound).max())
        assert excess <= 1.0 and err < BF16_REL, (
            f"d/d{name}: error {excess:.2f}x the rounding bound, norm-wise {err:.2e} (bound {BF16_REL}; {label})"
        )
    if allowed is not None:
        blocked = ~allowed.cpu()
        assert bool((grads[1].cpu()[blocked] == 0).all()), f"masked ids got a gradient ({label})"


def record_ppo_outputs(monkeypatch, module) -> list[dict]:
    """Wrap `module.token_log_probs_and_entropy` (where a training class calls the PPO op) so each
    call is recorded: its inputs (detached copies), the gradients the backward sends to its outputs
    ("upstream": what the trainer's loss asks of them) and the gradients it returns for hidden and
    weight (from hooks on views of both, so the weight's gradient is this call's alone, not the
    parameter's accumulated .grad). The op runs on the same tensors: the bits are unchanged."""
    original = module.token_log_probs_and_entropy
    calls: list[dict] = []

    def recorded(hidden, weight, targets, temperature, vocab_mask=None, with_entropy=True):
        call = {
            "hidden": hidden.detach().clone(), "weight": weight.detach().clone(), "targets": targets.clone(),
            "temperature": temperature, "vocab_mask": vocab_mask,
        }  # fmt: skip
        hidden, weight = hidden.view_as(hidden), weight.view_as(weight)
        for name, t in (("grad_hidden", hidden), ("grad_weight", weight)):
            t.register_hook(lambda g, name=name: call.__setitem__(name, g.detach().clone()))
        log_p, entropy = original(hidden, weight, targets, temperature, vocab_mask, with_entropy)
        for name, t in (("upstream_log_p", log_p), ("upstream_entropy", entropy)):
            if t is not None and t.requires_grad:
                t.register_hook(lambda g, name=name: call.__setitem__(name, g.detach().clone()))
        calls.append(call)
        return log_p, entropy

    monkeypatch.setattr(module, "token_log_probs_and_entropy", recorded)
    return calls


def assert_recorded_gradients(call, label):
    """A recorded call's gradients w.r.t. hidden and weight equal the fp64 reference's for the
    upstream gradients the call received (`assert_gradients_close`)."""
    rows = call["hidden"].shape[0]
    temperature = call["temperature"]
    tau = temperature.float().cpu() if isinstance(temperature, torch.Tensor) else torch.full((rows,), float(temperature))
    upstream = call.get("upstream_log_p", torch.zeros(rows)), call.get("upstream_entropy")
    grads = call["grad_hidden"], call["grad_weight"]
    assert_gradients_close(grads, call["hidden"], call["weight"], call["targets"], tau, call["vocab_mask"], upstream, label)
