"""Sampling-option refusals and request seeds (the sampler itself runs in tests/e2e)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

VEXACT = SimpleNamespace(model_impl="vexact")
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


def test_prompt_logprobs_refused_on_runner_v2_only():
    from vllm import SamplingParams

    from vexact_vllm.request_validation import validate_request

    params = SamplingParams(prompt_logprobs=0)
    validate_request(params, VEXACT, use_v2_model_runner=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        validate_request(params, VEXACT, use_v2_model_runner=True)


def test_install_wraps_the_frontend_check_once():
    from vllm.v1.engine.input_processor import InputProcessor

    import vexact_vllm
    from vexact_vllm import request_validation

    vexact_vllm.register()
    wrapped = InputProcessor._validate_params
    assert getattr(wrapped, "_vexact", False)
    request_validation.install()
    assert InputProcessor._validate_params is wrapped


def test_request_seed():
    from vexact_vllm.sampler import request_seed

    assert request_seed("a", 7) == 7
    assert request_seed("req-1", None) == request_seed("req-1", None)
    assert request_seed("req-1", None) != request_seed("req-2", None)


class _DeviceOnly(__import__("torch").Tensor):
    """A tensor that refuses to be read on the host, as a GPU tensor would force a sync."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "numpy", "__int__", "__index__", "cpu"):
            raise AssertionError(f"the V1 sampler read the runner's seq_lens on the host ({func.__name__})")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_v1_sampler_keeps_positions_on_the_device():
    """vLLM 0.26's V1 runner keeps `seq_lens` on the GPU: `.tolist()` there made every step wait for
    the GPU (the MoE rollouts on runner V1 ran at 0.63x stock). The positions keying the Gumbel noise
    are read on the device; the tokens are the ones the noise of those positions gives."""
    import numpy as np
    import torch
    from vllm import SamplingParams

    from vexact_vllm.kernels import gumbel_argmax, log_softmax
    from vexact_vllm.sampler import VexactSampler, request_seed

    params = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.0, seed=9)]
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["a", "b"]),
        requests={"a": SimpleNamespace(sampling_params=params[0]), "b": SimpleNamespace(sampling_params=params[1])},
        seq_lens=torch.tensor([17, 40, 0], dtype=torch.int32).as_subclass(_DeviceOnly),
    )
    logits = torch.randn(2, 50)
    meta = SimpleNamespace(max_num_logprobs=0)
    out = VexactSampler(runner).forward(logits, meta)
    temps = torch.tensor([0.8, 1.0])
    seeds = torch.tensor([request_seed("a", 5), request_seed("b", 9)])
    want = gumbel_argmax(log_softmax(logits, temps), seeds, torch.tensor([17, 40]), None)
    assert torch.equal(out.sampled_token_ids[:, 0].long(), want)
    assert np.array_equal(out.logprobs_tensors.logprob_token_ids[:, 0].numpy(), want.numpy())
