"""Refuse unsupported sampling options at admission, with HTTP 400, before any engine step.

vLLM validates each request in its frontend (`InputProcessor._validate_params`, called for
`LLM.generate` and for every OpenAI-server request; a ValueError there is a 400). Its extension
point for extra checks is a custom logits processor's `validate_params`, but vLLM 0.26's model
runner v2 refuses to run with any custom logits processor configured (it falls back to the V1
runner), so that one method is wrapped instead (`wrap_validate_params`, a row of vllm_patches.py,
installed in every process by `register()`).
The wrap acts only for model configs with `model_impl == MODEL_IMPL` ("vexact"); every other model gets vLLM's
validation unchanged.

Refused: sampling options that change the distribution the trainer's log-probs describe
(penalties, logit bias, bad words, allowed token ids, min_tokens, structured outputs:
`sampler.rules.refuse_unsupported`; top-k, top-p and min-p are served), and prompt log-probs under runner v2, whose prompt log-probs are computed by
vLLM's own log-softmax, which no model hook replaces (the V1 runner computes them with the vexact
sampler's function).
"""

from __future__ import annotations

import functools

from vllm.exceptions import VLLMValidationError

from vexact_vllm import MODEL_IMPL

from .sampler.rules import refuse_unsupported


class RequestRefusedError(VLLMValidationError, ValueError):
    """vLLM's request-validation error (a 400 from the server); a ValueError in every vLLM version."""


def validate_request(params, model_config, use_v2_model_runner: bool) -> None:
    """Raise RequestRefusedError for a request the vexact path cannot serve bit for bit."""
    if getattr(model_config, "model_impl", None) != MODEL_IMPL or not hasattr(params, "temperature"):
        return  # not a vexact model, or not a SamplingParams (pooling)
    try:
        refuse_unsupported(params)
    except ValueError as e:
        raise RequestRefusedError(str(e)) from None
    if use_v2_model_runner and params.prompt_logprobs is not None:
        raise RequestRefusedError(
            "prompt_logprobs are not supported with --model-impl vexact on vLLM's model runner v2: "
            "vLLM computes them with its own log-softmax, not the trainer's; drop prompt_logprobs (score "
            "prompts with the trainer) or run with VLLM_USE_V2_MODEL_RUNNER=0"
        )


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


def install() -> None:
    """Install vLLM's patch table (this wrap is one row of it); `register()` does it in every process."""
    from .vllm_patches import install

    install()
