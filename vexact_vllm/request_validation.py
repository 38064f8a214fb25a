"""Refuse unsupported sampling options at admission, with HTTP 400, before any engine step.

vLLM validates each request against the `validate_params` hook of the custom logits processors
configured for the engine. `registry.validate_model_config` adds `VexactRequestValidator` to the
`logits_processors` of every model config resolved with `--model-impl vexact` (and of no other), so
a request with, say, `top_p=0.5` is answered "400: sampling options top_p are not supported ..."
instead of reaching the sampler. It changes no logits: the vexact sampler never applies logits
processors (it refuses the options that would need them).
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor.interface import LogitsProcessor

from .sampler import refuse_unsupported

QUALNAME = "vexact_vllm.request_validation:VexactRequestValidator"


class VexactRequestValidator(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        refuse_unsupported(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass
