"""The runner-v2 sampler's per-row inputs and refusals (its full step runs on the GPU host:
`vexact-vllm check` and tests/e2e there)."""

from __future__ import annotations

from types import SimpleNamespace

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


def test_rows_follow_the_request_slots():
    sampler = _sampler([0.0, 0.7, 1.0, 1e-6], [11, 22, 33, 44])
    batch = SimpleNamespace(
        expanded_idx_mapping=torch.tensor([2, 0, 1, 3]),
        positions=torch.tensor([5, 6, 7, 40, 41, 9, 3]),
        logits_indices=torch.tensor([2, 4, 5, 6]),
    )
    tau, seeds, positions, greedy = sampler.rows(batch)
    assert torch.equal(greedy, torch.tensor([False, True, False, True]))
    assert torch.equal(tau, torch.tensor([1.0, 0.0, 0.7, 0.0]))  # greedy rows are scored at tau 1
    assert torch.equal(seeds, torch.tensor([33, 11, 22, 44]))
    # the key is the position of the token being sampled: one past the last input token (as V1's)
    assert torch.equal(positions, torch.tensor([8, 42, 10, 4]))
