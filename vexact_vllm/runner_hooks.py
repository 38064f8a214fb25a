"""Puts the vexact sampler into vLLM's V1 model runner (the CPU runner is a V1 runner).

The V1 runner builds its `Sampler` before the model exists and offers no hook to replace it (the V2
runner does: `ModelState.custom_sampler`). So `GPUModelRunner._sample` is wrapped (`wrap_sample`, a
row of vllm_patches.py, installed in every process by `register()`): when the runner's model is a
vexact model, its sampler becomes a `VexactSampler` before the step samples. Vexact sampling draws
nothing from vLLM's per-request `torch.Generator`s (its noise is keyed by seed and position), so the
runner's generators are dropped before each step; this also keeps the V1 runner from rewinding them
after a partial prefill, which CPU generators cannot do. Runners serving any other model are left
exactly as they are.
"""

from __future__ import annotations

import functools

from .registry import is_vexact_model


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
