"""Sampling-option refusals at admission (request_validation.py); the samplers: tests/vexact_vllm/sampler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vexact_vllm import MODEL_IMPL

pytestmark = pytest.mark.vllm

VEXACT = SimpleNamespace(model_impl=MODEL_IMPL)
STOCK = SimpleNamespace(model_impl="auto")


@pytest.mark.parametrize(
    "option",
    [
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.1},
        {"logit_bias": {1: 2.0}},
        {"bad_words": ["x"]},
        {"allowed_token_ids": [1, 2]},
        {"min_tokens": 2},
        {"structured_outputs": "json"},
    ],
)
def test_unsupported_options_are_refused(option):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vexact_vllm.request_validation import validate_request

    if "structured_outputs" in option:  # guided decoding (the OpenAI server's response_format too)
        option = {"structured_outputs": StructuredOutputsParams(json={"type": "object"})}
    with pytest.raises(ValueError, match=next(iter(option))):
        validate_request(SamplingParams(**option), VEXACT, use_v2_model_runner=False)
    validate_request(SamplingParams(**option), STOCK, use_v2_model_runner=True)  # other models: untouched


def test_plain_sampling_is_accepted():
    from vllm import SamplingParams

    from vexact_vllm.request_validation import validate_request

    accepted = (
        SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0), SamplingParams(top_k=-1),
        SamplingParams(top_k=20, top_p=0.95, min_p=0.05),  # truncated sampling: Qwen3's generation defaults
    )  # fmt: skip
    for params in accepted:
        validate_request(params, VEXACT, use_v2_model_runner=True)


def test_prompt_logprobs_accepted_on_both_runners_and_prompt_token_ids_refused():
    """prompt_logprobs (k = 0 and top-k) are the trainer's on both runners (sampler/logprobs.py,
    sampler/prompt_logprobs.py); vLLM scores prompt_logprob_token_ids with its own log-softmax."""
    from vllm import SamplingParams

    from vexact_vllm.request_validation import validate_request

    for v2 in (False, True):
        for k in (0, 5, -1):
            validate_request(SamplingParams(prompt_logprobs=k), VEXACT, use_v2_model_runner=v2)
        with pytest.raises(ValueError, match="prompt_logprob_start"):
            validate_request(SamplingParams(prompt_logprobs=0, prompt_logprob_start=2), VEXACT, use_v2_model_runner=v2)


def test_install_wraps_the_frontend_check_once():
    from vllm.v1.engine.input_processor import InputProcessor

    import vexact_vllm
    from vexact_vllm import vllm_patches

    vexact_vllm.register()
    wrapped = InputProcessor._validate_params
    assert getattr(wrapped, "_vexact", False)
    vllm_patches.install()
    assert InputProcessor._validate_params is wrapped


def test_multimodal_data_is_refused_for_vexact_models_only():
    """vLLM asks the renderer for the multimodal processor as soon as a prompt carries images, video or
    audio; for a vexact model that is the refusal with what to do, for any other model vLLM's own answer."""
    from vexact_vllm.request_validation import RequestRefusedError, wrap_get_mm_processor

    processor = object()
    get = wrap_get_mm_processor(lambda self: processor)
    with pytest.raises(RequestRefusedError, match="Send text prompts only"):
        get(SimpleNamespace(model_config=VEXACT))
    assert get(SimpleNamespace(model_config=STOCK)) is processor
