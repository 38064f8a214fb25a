"""The runner-v2 sampler's per-row inputs and refusals (its full step runs on the GPU host:
`vexact-vllm check` and tests/e2e there)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm


def _sampler(temperatures, seeds):
    from vexact_vllm.sampler_v2 import VexactSamplerV2

    base = SimpleNamespace(
        sampling_states=SimpleNamespace(
            temperature=SimpleNamespace(gpu=torch.tensor(temperatures, dtype=torch.float32)),
            seeds=SimpleNamespace(gpu=torch.tensor(seeds, dtype=torch.int64)),
        )
    )
    return VexactSamplerV2.from_base(base)


def _batch():
    return SimpleNamespace(
        expanded_idx_mapping=torch.tensor([2, 0, 1, 3]),
        positions=torch.tensor([5, 6, 7, 40, 41, 9, 3]),
        logits_indices=torch.tensor([2, 4, 5, 6]),
    )


def test_rows_follow_the_request_slots():
    temperatures = [0.0, 0.7, 1.0, 1e-6]
    sampler = _sampler(temperatures, [11, 22, 33, 44])
    batch = _batch()
    host = np.array(temperatures, np.float32)[[2, 0, 1, 3]]
    tau, seeds, positions = sampler.rows(batch, host)
    # 1e-6 is greedy for vLLM (< GREEDY_EPS): zeroed, so that the kernels score it at 1, not 0.01
    assert torch.equal(tau, torch.tensor([1.0, 0.0, 0.7, 0.0]))
    assert torch.equal(seeds, torch.tensor([33, 11, 22, 44]))
    # the key is the position of the token being sampled: one past the last input token (as V1's)
    assert torch.equal(positions, torch.tensor([8, 42, 10, 4]))


def test_rows_launch_nothing_for_the_temperature_on_a_usual_batch():
    """No temperature in (0, GREEDY_EPS) (vLLM raises those to 0.01): the requested temperatures go
    to the log-prob kernels as they are, which score 0 at 1 themselves."""
    from vexact_vllm.kernels import log_softmax

    temperatures = [0.0, 0.7, 1.0, 0.01]
    sampler = _sampler(temperatures, [11, 22, 33, 44])
    tau, _, _ = sampler.rows(_batch(), np.array(temperatures, np.float32)[[2, 0, 1, 3]])
    assert torch.equal(tau, torch.tensor([1.0, 0.0, 0.7, 0.01]))
    logits = torch.randn(4, 300)
    ones = log_softmax(logits, 1.0)
    assert torch.equal(log_softmax(logits, tau)[1], ones[1])  # the greedy row: scored at 1
