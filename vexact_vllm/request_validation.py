"""Refuse unsupported sampling options at admission, with HTTP 400, before any engine step.

vLLM validates each request in its frontend (`InputProcessor._validate_params`, called for
`LLM.generate` and for every OpenAI-server request; a ValueError there is a 400). Its extension
point for extra checks is a custom logits processor's `validate_params`, but custom logits processors
are refused with vexact models (the vexact sampler replaces the sampler that runs them), so that one
method is wrapped instead (`wrap_validate_params`, a row of vllm_patches.py, installed in every
process by `register()`). The wrap acts only for model configs with `model_impl == MODEL_IMPL`
("vexact"); every other model gets vLLM's validation unchanged.

Images, video and audio are refused too: vexact architectures are served text only (the vision
tower of Qwen3.5's vision-language checkpoints is not part of the vexact model). vLLM reaches for the
model's multimodal processor as soon as a prompt carries such data; the vexact model has none, and
`wrap_get_mm_processor` (a row of vllm_patches.py, `BaseRenderer.get_mm_processor`) turns vLLM's
"not available for text-only models" into a refusal that says what to do.

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


MULTIMODAL_REFUSAL = (
    "images, video and audio are not supported with --model-impl vexact: vexact models are served text only "
    "(the vision tower of a vision-language checkpoint is not part of the vexact model, so its outputs would "
    "not be bitwise equal to the trainer's). Send text prompts only, or serve the checkpoint without "
    "--model-impl vexact for multimodal requests"
)


def wrap_get_mm_processor(original):
    """`BaseRenderer.get_mm_processor` (a row of vllm_patches.py): called for a prompt that carries
    multimodal data; for a vexact model, the refusal above."""

    @functools.wraps(original)
    def get_mm_processor(self):
        if getattr(self.model_config, "model_impl", None) == MODEL_IMPL:
            raise RequestRefusedError(MULTIMODAL_REFUSAL)
        return original(self)

    return get_mm_processor
