"""vexact_causal_lm_loss, VeOmni's loss-wrapper contract on the one log-prob function: temperature
applied once (fp32 logits / fp32 temperature), VeOmni's label conventions, and gradients equal to
those of a float64 plain-torch reference of the same loss (logprob_reference.py: formula, bounds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("veomni")
sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (importlib import mode)

from logprob_reference import assert_gradients_close, reference  # noqa: E402

from vexact_vllm.kernels import linear_token_log_probs  # noqa: E402
from vexact_vllm.model_patches.trainers.veomni_classes import vexact_causal_lm_loss  # noqa: E402


def _inputs(rows=37, hidden=64, vocab=1500, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, rows, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.2).to(dtype)
    labels = torch.randint(0, vocab, (1, rows), generator=g)
    return h, w, labels


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_log_probs_are_the_shared_function(temperature):
    h, w, labels = _inputs()
    shift = torch.roll(labels, -1, 1)
    _, _, aux = vexact_causal_lm_loss(
        labels=labels, shift_labels=shift, hidden_states=h, weights=w, return_log_probs=True, temperature=temperature
    )
    expected = linear_token_log_probs(h[0], w, shift[0], temperature)
    assert torch.equal(aux.log_probs, expected[None])
    assert aux.entropy.shape == labels.shape and bool((aux.entropy > 0).all())


def test_veomni_own_chunk_logprobs_differs_at_other_temperatures():
    """Why VeOmni's path is not used: it divides the bf16 logits by the temperature before its fp32
    cast (and uses another GEMM and log-softmax), so its bits are not the rollout's."""
    from veomni.ops.kernels.cross_entropy.chunk_logprobs import chunk_logprobs_function

    h, w, labels = _inputs()
    shift = torch.roll(labels, -1, 1)
    theirs, _ = chunk_logprobs_function(h, w, labels, shift_labels=shift, temperature=0.7)
    _, _, ours = vexact_causal_lm_loss(
        labels=labels, shift_labels=shift, hidden_states=h, weights=w, return_log_probs=True, temperature=0.7
    )
    assert not torch.equal(theirs, ours.log_probs)


def test_label_shift_and_ignore_index():
    h, w, labels = _inputs(rows=12)
    labels[0, 5] = -100
    _, _, aux = vexact_causal_lm_loss(labels=labels, hidden_states=h, weights=w, return_log_probs=True)
    assert aux.log_probs.shape == labels.shape
    assert aux.log_probs[0, 4] == 0 and aux.log_probs[0, -1] == 0  # target ignored / no next token
    expected = linear_token_log_probs(h[0, :3], w, labels[0, 1:4], 1.0)
    assert torch.equal(aux.log_probs[0, :3], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loss_path_and_gradients(dtype):
    """The loss (mean -log p over the valid targets, temperature 1) and its gradients w.r.t. the
    hidden states and the lm_head equal the fp64 reference's: norm-wise 1e-5 (fp32 inputs), within
    bf16 rounding (bf16 inputs)."""
    h, w, labels = _inputs(dtype=dtype)
    labels[0, 9] = -100
    h.requires_grad_(True)
    w.requires_grad_(True)
    loss, logits, aux = vexact_causal_lm_loss(labels=labels, hidden_states=h, weights=w)
    assert logits is None and aux is None and loss.dim() == 0
    loss.backward()
    for g in (h.grad, w.grad):
        assert bool(torch.isfinite(g).all()) and float(g.float().abs().sum()) > 0
    targets = torch.cat([labels[0, 1:], torch.tensor([-100])])  # VeOmni's shift: the last row has none
    targets = torch.where(targets == -100, -1, targets)
    valid = targets >= 0
    upstream = (torch.where(valid, -1.0 / int(valid.sum()), 0.0).double(), None)  # d loss / d log p
    tau = torch.ones(targets.shape[0])
    hidden = h.detach()[0]
    ref_loss = -reference(hidden.double(), w.detach().double(), targets, tau)[0].sum() / int(valid.sum())
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=0)
    assert_gradients_close((h.grad[0], w.grad), hidden, w.detach(), targets, tau, None, upstream, f"{dtype}, seed 0")


def test_log_prob_outputs_gradients():
    """verl's training path (return_log_probs=True, temperature 0.7, a vocabulary mask, an ignored
    label): gradients of <g_lp, log_probs> + <g_ent, entropy> for seeded random g equal the fp64
    reference's within bf16 rounding; the masked lm_head rows get none."""
    h, w, labels = _inputs(seed=1)
    shift = torch.roll(labels, -1, 1) % 1400  # targets inside the mask
    shift[0, 3] = -100
    mask = torch.arange(w.shape[0]) < 1400
    h.requires_grad_(True)
    w.requires_grad_(True)
    _, _, aux = vexact_causal_lm_loss(
        labels=labels, shift_labels=shift, hidden_states=h, weights=w, return_log_probs=True,
        temperature=0.7, vocab_mask=mask,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(shift.shape, generator=g), torch.randn(shift.shape, generator=g)
    ((aux.log_probs * upstream[0]).sum() + (aux.entropy * upstream[1]).sum()).backward()
    targets = torch.where(shift[0] == -100, -1, shift[0])
    tau = torch.full((targets.shape[0],), 0.7)
    upstream = upstream[0][0], upstream[1][0]
    assert_gradients_close((h.grad[0], w.grad), h.detach()[0], w.detach(), targets, tau, mask, upstream, "seed 1")


def test_vocab_mask_and_entropy_switch():
    h, w, labels = _inputs()
    shift = torch.roll(labels, -1, 1) % 1400  # targets inside the mask
    mask = torch.arange(w.shape[0]) < 1400
    _, _, aux = vexact_causal_lm_loss(
        labels=labels, shift_labels=shift, hidden_states=h, weights=w, return_log_probs=True,
        temperature=0.7, vocab_mask=mask, return_entropy=False,
    )
    assert aux.entropy is None
    assert torch.equal(aux.log_probs[0], linear_token_log_probs(h[0], w, shift[0], 0.7, vocab_mask=mask))


def test_distillation_is_refused():
    h, w, labels = _inputs(rows=4)
    with pytest.raises(ValueError, match="distillation"):
        vexact_causal_lm_loss(
            labels=labels, hidden_states=h, weights=w, return_log_probs=True, teacher_topk_ids=labels,
            teacher_topk_log_probs=labels.float(),
        )
