"""The rules both samplers share (vexact_vllm/sampler/rules.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_request_seed():
    from vexact_vllm.sampler.rules import request_seed

    assert request_seed("a", 7) == 7
    assert request_seed("req-1", None) == request_seed("req-1", None)
    assert request_seed("req-1", None) != request_seed("req-2", None)


def test_draw_tokens_is_row_wise():
    """A mixed batch (greedy and sampled rows, a truncated row) draws for each row what the row
    draws alone: argmax for greedy rows, Gumbel-max keyed by (seed, position) for the others."""
    import numpy as np
    import torch

    from vexact_vllm.kernels import log_softmax
    from vexact_vllm.sampler.rules import draw_tokens

    gen = torch.Generator().manual_seed(0)
    log_probs = log_softmax(torch.randn(4, 97, generator=gen) * 3, torch.tensor([1.0, 0.7, 1.0, 1.3]))
    greedy = np.array([True, False, False, False])
    seeds, positions = torch.tensor([0, 5, 6, 7]), torch.tensor([3, 9, 9, 40])
    threshold = torch.tensor([float("-inf"), float("-inf"), -2.0, float("-inf")])
    batch = draw_tokens(log_probs, torch.from_numpy(greedy), greedy, seeds, positions, threshold)
    for i in range(4):
        row = slice(i, i + 1)
        alone = draw_tokens(log_probs[row], torch.from_numpy(greedy[row]), greedy[row], seeds[row],
                            positions[row], threshold[row])  # fmt: skip
        assert torch.equal(batch[row], alone), i
    assert batch[0] == log_probs[0].argmax()
    assert log_probs[2, batch[2]] >= -2.0  # the truncated row draws above its threshold


def test_no_truncation_launches_nothing():
    """A batch without top-k / top-p / min-p (the usual RL rollout) asks for no device rows."""
    import numpy as np
    import torch

    from vexact_vllm.sampler.rules import truncates, truncation

    def device_rows(name):
        raise AssertionError(f"asked for {name}")

    top_k, top_p, min_p = np.array([0, 50]), np.array([1.0, 1.0]), np.array([0.0, 0.0])
    assert not truncates(50, top_k, top_p, min_p)  # k == vocab keeps every token
    assert truncation(torch.zeros(2, 50), device_rows, top_k, top_p, min_p) is None
    assert truncates(50, np.array([0, 49]), top_p, min_p)
