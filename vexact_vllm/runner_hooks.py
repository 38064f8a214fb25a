"""Puts the vexact sampler into vLLM's V1 model runner (the CPU runner is a V1 runner).

The V1 runner builds its `Sampler` before the model exists and offers no hook to replace it (the V2
runner does: `ModelState.custom_sampler`). So the first time a vexact model is loaded in a worker,
`install_v1_sampler_hook()` wraps `GPUModelRunner._sample` once: when the runner's model is a
vexact model, its sampler becomes a `VexactSampler` before the step samples. Vexact sampling draws
nothing from vLLM's per-request `torch.Generator`s (its noise is keyed by seed and position), so the
runner's generators are dropped before each step; this also keeps the V1 runner from rewinding them
after a partial prefill, which CPU generators cannot do. Runners serving any other model are left
exactly as they are.
"""

from __future__ import annotations

import functools

_installed = False


def _is_vexact(model) -> bool:
    return bool(getattr(model, "is_vexact_model", False))


def install_v1_sampler_hook() -> None:
    global _installed
    if _installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .sampler import VexactSampler

    original = GPUModelRunner._sample

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if not isinstance(self.sampler, VexactSampler) and _is_vexact(self.get_model()):
            self.sampler = VexactSampler(self)
        if isinstance(self.sampler, VexactSampler):
            self.input_batch.generators.clear()
        return original(self, logits, spec_decode_metadata)

    GPUModelRunner._sample = _sample
    _installed = True
