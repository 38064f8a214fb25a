"""The shared model definitions (one per family) and the training-side hooks.

Submodules are imported on first use, so `vexact_vllm.register()` (which reads only `.config`)
never pays for transformers' model classes.
"""

import importlib

_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": ".config",
    "DecoderConfig": ".config",
    "UnsupportedModelError": ".config",
    "PackedBatch": ".hf_model",
    "VexactForCausalLM": ".hf_model",
    "enable_training": ".training",
    "disable_training": ".training",
    "is_training_enabled": ".training",
    "training_enabled": ".training",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
