"""Runner-v2 model state for vexact models: vLLM's default state, with the vexact sampler.

vLLM's model runner v2 asks the model for its state class (`get_model_state_cls`) and, after
loading, offers the state its freshly built sampler (`ModelState.custom_sampler`): that is where the
vexact sampler replaces vLLM's log-prob computation and sampling, without touching the runner.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from .sampler_v2 import VexactSamplerV2


class VexactModelState(DefaultModelState):
    def custom_sampler(self, sampler):
        if self.vllm_config.speculative_config is not None:  # the model refuses it at build time
            raise ValueError("speculative decoding is not supported with --model-impl vexact")
        from vllm.config.compilation import CUDAGraphMode

        graphs_on = self.vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
        return VexactSamplerV2.from_base(sampler, self.model, use_graphs=graphs_on), None
