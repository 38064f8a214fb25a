"""The shared model definitions (one per family, at this level) and, in `trainers/`, the trainer side
(the switch, the transformers training class, verl and VeOmni hooks). The trainer side imports the
shared model, never the reverse.

Names are imported on first use, so `vexact_vllm.register()` (which reads only `.config`) never
pays for transformers' model classes.
"""

import importlib

_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": ".config",
    "DecoderConfig": ".config",
    "UnsupportedModelError": ".config",
    "PackedBatch": ".trainers.hf_causal_lm",
    "VexactForCausalLM": ".trainers.hf_causal_lm",
    "enable": ".trainers.switch",
    "disable": ".trainers.switch",
    "is_enabled": ".trainers.switch",
    "enabled": ".trainers.switch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
