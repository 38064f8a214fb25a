"""Puts the vexact sampler into vLLM's V1 model runner (the CPU runner is a V1 runner), and sends
vexact models to runner V2 on vLLM 0.26.

The V1 runner builds its `Sampler` before the model exists and offers no hook to replace it (the V2
runner does: `ModelState.custom_sampler`). So `GPUModelRunner._sample` is wrapped (`wrap_sample`, a
row of vllm_patches.py, installed in every process by `register()`): when the runner's model is a
vexact model, its sampler becomes a `VexactSampler` before the step samples. Vexact sampling draws
nothing from vLLM's per-request `torch.Generator`s (its noise is keyed by seed and position), so the
runner's generators are dropped before each step; this also keeps the V1 runner from rewinding them
after a partial prefill, which CPU generators cannot do. Runners serving any other model are left
exactly as they are.

vLLM 0.26 gives runner V2 only to dense models and to an allow-list of MoE architectures
(`VllmConfig._is_default_v2_model_runner_model`); stock Qwen3-MoE runs on V1. The vexact MoE class
uses none of what V2 lacks for MoE (vLLM's FusedMoE, expert parallelism), so `wrap_default_v2_runner`
(a row of vllm_patches.py, vLLM 0.26 only: 0.32 has no such rule) makes V2 the default for every
`--model-impl vexact` generate model, as for the dense ones. `VLLM_USE_V2_MODEL_RUNNER` still wins,
and V2's own feature checks still run after it.
"""

from __future__ import annotations

import functools

from .registry import MODEL_IMPL, is_vexact_model


def wrap_sample(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        from .sampler import VexactSampler

        if not isinstance(self.sampler, VexactSampler) and is_vexact_model(self.get_model()):
            self.sampler = VexactSampler(self)
        if isinstance(self.sampler, VexactSampler):
            self.input_batch.generators.clear()
        return original(self, logits, spec_decode_metadata)

    return _sample


def wrap_default_v2_runner(original):
    @functools.wraps(original)
    def _is_default_v2_model_runner_model(self):
        config = self.model_config
        if config is not None and getattr(config, "model_impl", None) == MODEL_IMPL:
            return config.runner_type == "generate"
        return original(self)

    return _is_default_v2_model_runner_model
