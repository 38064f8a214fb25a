"""The V1 runner's sampler (vexact_vllm/sampler/v1.py); its full step runs in tests/e2e."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm


class _DeviceOnly(__import__("torch").Tensor):
    """A tensor that refuses to be read on the host, as a GPU tensor would force a sync."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "numpy", "__int__", "__index__", "cpu"):
            raise AssertionError(f"the V1 sampler read the runner's seq_lens on the host ({func.__name__})")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_v1_sampler_keeps_positions_on_the_device():
    """vLLM 0.26's V1 runner keeps `seq_lens` on the GPU: reading them on the host (`.tolist()`)
    would make every step wait for the GPU (MoE rollouts on runner V1 at 0.63x stock). The positions
    keying the Gumbel noise are read on the device; the tokens are the ones the noise of those
    positions gives."""
    import numpy as np
    import torch
    from vllm import SamplingParams

    from vexact_vllm.kernels import gumbel_argmax, log_softmax
    from vexact_vllm.sampler.rules import request_seed
    from vexact_vllm.sampler.v1 import VexactSampler

    params = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.0, seed=9)]
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["a", "b"]),
        requests={"a": SimpleNamespace(sampling_params=params[0]), "b": SimpleNamespace(sampling_params=params[1])},
        seq_lens=torch.tensor([17, 40, 0], dtype=torch.int32).as_subclass(_DeviceOnly),
    )
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    meta = SimpleNamespace(max_num_logprobs=0)
    out = VexactSampler(runner).forward(logits, meta)
    temps = torch.tensor([0.8, 1.0])
    seeds = torch.tensor([request_seed("a", 5), request_seed("b", 9)])
    want = gumbel_argmax(log_softmax(logits, temps), seeds, torch.tensor([17, 40]), None)
    assert torch.equal(out.sampled_token_ids[:, 0].long(), want)
    assert np.array_equal(out.logprobs_tensors.logprob_token_ids[:, 0].numpy(), want.numpy())
