"""Gradient checkpointing on every family: the recomputation runs the same kernels on the same
inputs, so log-probs and every gradient are torch.equal with it on and off (and the layers really
run twice); fp32 parameters under a bf16 autocast (the parameter-cast path) refuse it."""

from __future__ import annotations

import pytest
import torch

from vexact_vllm.model_patches import PackedBatch
from vexact_vllm.model_patches.families import FAMILIES


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    logp = model.packed_log_probs(batch, temperature=0.7)
    (logp * torch.linspace(0.5, 1.5, logp.numel())).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", [f.model_type for f in FAMILIES if f.tiny is not None])
def test_log_probs_and_gradients_equal_with_and_without(load_model, arch, monkeypatch):
    from vexact_vllm.model_patches import layers

    model = load_model(arch, torch.bfloat16, True).train()
    gen = torch.Generator().manual_seed(3)
    batch = PackedBatch.from_sequences([torch.randint(0, 384, (n,), generator=gen).tolist() for n in (9, 31, 4)])
    calls = []
    forward = layers.DecoderLayer.forward
    monkeypatch.setattr(layers.DecoderLayer, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    n_layers = len(model.model.layers)
    off = _run(model, batch)
    assert len(calls) == n_layers
    model.gradient_checkpointing_enable()
    assert model.model.gradient_checkpointing
    on = _run(model, batch)
    assert len(calls) == 3 * n_layers  # the forward, then the recomputation in the backward
    assert torch.equal(off[0], on[0])
    assert off[1].keys() == on[1].keys() and len(off[1]) > 5
    for name, grad in off[1].items():
        assert torch.equal(grad, on[1][name]), name
    model.gradient_checkpointing_disable()
    assert not model.model.gradient_checkpointing


def test_refused_with_fp32_parameters_under_bf16_autocast(load_model):
    model = load_model("qwen3", torch.float32, True).train()
    model.gradient_checkpointing_enable()
    batch = PackedBatch.from_sequences([[5, 6, 7, 8]])
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="gradient checkpointing"):
        model.packed_log_probs(batch)
