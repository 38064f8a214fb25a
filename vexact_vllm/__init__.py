"""vexact-vllm: vLLM rollouts bitwise identical to the training forward pass.

`register()` is vLLM's general-plugin entry point (`vllm.general_plugins: vexact`); vLLM calls it in
every process it starts. It is idempotent and cheap: it registers the vexact model classes lazily
(by name), their config hooks (engine_checks.py) and the attention backend, and installs vLLM's
patch table (vllm_patches.py: `--model-impl vexact` resolution, the admission check that refuses
sampling options vexact models cannot serve, the V1 runner's sampler, the post-condition that the
model vLLM built is ours). Every patch acts only for `--model-impl vexact`. In a process whose training
switch is on (verl's colocated workers), it registers the training classes for vLLM's own copies of
their configs as well (model_patches/trainers/transformers_hooks.py).
"""

import sys

from .model_impl import MODEL_IMPL

__version__ = "0.1.0"
__all__ = ["MODEL_IMPL", "__version__", "register"]


def register() -> None:
    from .registry import register_models
    from .vllm_patches import install

    register_models()
    install()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, "vexact_vllm.attention.VexactAttentionBackend")
    _train_on_vllm_configs()


def _train_on_vllm_configs() -> None:
    """A training switch enabled before vLLM loaded: install it again, now that vLLM's config copies exist."""
    hooks = sys.modules.get("vexact_vllm.model_patches.trainers.transformers_hooks")
    if hooks is not None and hooks.is_installed():
        import importlib

        importlib.import_module(hooks.VLLM_CONFIG_MODULE)
        hooks.install()
