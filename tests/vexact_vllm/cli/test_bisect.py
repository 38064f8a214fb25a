"""The bisect names the first op that differs between replayed inference and training."""

from __future__ import annotations

import pytest
import torch

from vexact_vllm.cli.bisect import ReplayAttention, bisect_sequence, describe
from vexact_vllm.cli.score import load_trainer


def _sequence(n: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 384, (n,), generator=g).tolist()


def test_replay_equals_training_everywhere(tiny_model):
    model = load_trainer(tiny_model("qwen3"), torch.bfloat16)
    ids = _sequence(80)  # prompt 70 (3 prefill chunks, crosses the 64-key tile), 10 decode steps
    assert bisect_sequence(model, ids, prompt_len=70, chunk=32) is None
    assert "equals the training forward" in describe(None)


class _BrokenLayer2(ReplayAttention):
    def attend(self, layer_idx, q, k, v, scale):
        out = super().attend(layer_idx, q, k, v, scale)
        if layer_idx == 2 and self.start >= 20:  # a one-ulp error from position 20 on
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out


def test_first_divergence_is_named(tiny_model):
    model = load_trainer(tiny_model("qwen3"), torch.bfloat16)
    d = bisect_sequence(model, _sequence(40), prompt_len=30, chunk=20, replay_cls=_BrokenLayer2)
    assert d is not None
    assert (d.module, d.position) == ("model.layers.2.self_attn.attention", 20)
    assert d.inference != d.training
    assert "model.layers.2.self_attn.attention, position 20" in describe(d)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_replay_equals_training_on_cuda(tiny_model, arch):
    """The whole model on the Triton kernels: prefill chunks, then decode steps over a paged cache,
    against one packed training forward, every module at every position (torch.equal)."""
    model = load_trainer(tiny_model(arch), torch.bfloat16).cuda()
    ids = _sequence(300)
    assert bisect_sequence(model, ids, prompt_len=200, chunk=48, block_size=16) is None
