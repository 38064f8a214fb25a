"""Sampling-option refusals and request seeds (the sampler itself runs in tests/e2e)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    "option",
    [
        {"top_k": 5},
        {"top_p": 0.9},
        {"min_p": 0.1},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.1},
        {"logit_bias": {1: 2.0}},
        {"bad_words": ["x"]},
        {"allowed_token_ids": [1, 2]},
        {"min_tokens": 2},
    ],
)
def test_unsupported_options_are_refused(option):
    from vllm import SamplingParams

    from vexact_vllm.request_validation import VexactRequestValidator

    with pytest.raises(ValueError, match=next(iter(option))):
        VexactRequestValidator.validate_params(SamplingParams(**option))


def test_plain_sampling_is_accepted():
    from vllm import SamplingParams

    from vexact_vllm.request_validation import VexactRequestValidator

    for params in (SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0), SamplingParams(top_k=-1)):
        VexactRequestValidator.validate_params(params)


def test_request_seed():
    from vexact_vllm.sampler import request_seed

    assert request_seed("a", 7) == 7
    assert request_seed("req-1", None) == request_seed("req-1", None)
    assert request_seed("req-1", None) != request_seed("req-2", None)
