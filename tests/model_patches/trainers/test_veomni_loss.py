"""vexact_causal_lm_loss, VeOmni's loss-wrapper contract on the one log-prob function: temperature
applied once (fp32 logits / fp32 temperature), VeOmni's label conventions, gradients."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("veomni")

from vexact_vllm.kernels import linear_token_log_probs  # noqa: E402
from vexact_vllm.model_patches.trainers.veomni_classes import vexact_causal_lm_loss  # noqa: E402


def _inputs(rows=37, hidden=64, vocab=1500, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, rows, hidden, generator=g).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=g) * 0.2).to(torch.bfloat16)
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


def test_loss_path_and_gradients():
    h, w, labels = _inputs()
    h.requires_grad_(True)
    w.requires_grad_(True)
    loss, logits, aux = vexact_causal_lm_loss(labels=labels, hidden_states=h, weights=w)
    assert logits is None and aux is None and loss.dim() == 0
    loss.backward()
    for g in (h.grad, w.grad):
        assert bool(torch.isfinite(g).all()) and float(g.float().abs().sum()) > 0


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
