"""vexact-vllm: vLLM rollouts bitwise identical to the training forward pass.

`register()` is vLLM's general-plugin entry point (`vllm.general_plugins: vexact`); vLLM calls it in
every process it starts. It is idempotent and cheap: it registers the vexact model classes lazily
(by name) and the attention backend, makes `--model-impl vexact` resolve to them, and adds the
admission check that refuses sampling options vexact models cannot serve (request_validation.py).
"""

__version__ = "0.1.0"


def register() -> None:
    from .registry import register_models

    register_models()
    from .request_validation import install

    install()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, "vexact_vllm.attention.VexactAttentionBackend")
