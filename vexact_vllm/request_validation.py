"""Refuse unsupported sampling options at admission, with HTTP 400, before any engine step.

vLLM validates each request in its frontend (`InputProcessor._validate_params`, called for
`LLM.generate` and for every OpenAI-server request; a ValueError there is a 400). Its extension
point for extra checks is a custom logits processor's `validate_params`, but custom logits processors
are refused with vexact models (the vexact sampler replaces the sampler that runs them), so that one
method is wrapped instead (`wrap_validate_params`, a row of vllm_patches.py, installed in every
process by `register()`). The wrap acts only for model configs with `model_impl == MODEL_IMPL`
("vexact"); every other model gets vLLM's validation unchanged.

What is refused is decided by the allow-list of option_policy.py (`refuse_request_options`): every
`SamplingParams` field is honoured, vLLM-internal, or refused when set (the options that change the
distribution the trainer's log-probs describe, the ones vLLM applies inside the sampler the vexact
sampler replaces, the prompt-token-id scores vLLM computes with its own log-softmax); an
unclassified field set to a non-default value is refused too.
"""

from __future__ import annotations

import functools

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vexact_vllm.model_impl import MODEL_IMPL

from .option_policy import refuse_request_options


class RequestRefusedError(VLLMValidationError, ValueError):
    """vLLM's request-validation error (a 400 from the server); a ValueError in every vLLM version."""


def validate_request(params, model_config, use_v2_model_runner: bool) -> None:
    """Raise RequestRefusedError for a request the vexact path cannot serve bit for bit."""
    if getattr(model_config, "model_impl", None) != MODEL_IMPL or not isinstance(params, SamplingParams):
        return  # not a vexact model, or not a SamplingParams (pooling)
    try:
        refuse_request_options(params, use_v2_model_runner)
    except ValueError as e:
        raise RequestRefusedError(str(e)) from None


def _uses_v2_runner(processor) -> bool:
    if hasattr(processor, "use_v2_model_runner"):  # vLLM 0.26 caches it on the processor
        return bool(processor.use_v2_model_runner)
    return bool(processor.vllm_config.use_v2_model_runner)


def wrap_validate_params(original):
    """`InputProcessor._validate_params` (a row of vllm_patches.py): the vexact refusals first."""

    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        validate_request(params, self.model_config, _uses_v2_runner(self))
        return original(self, params, *args, **kwargs)

    return _validate_params
