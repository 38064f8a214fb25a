"""`--model-impl vexact`: resolve the supported Hugging Face architectures to vexact model classes.

vLLM resolves a model class through `ModelRegistry.inspect_model_cls` / `resolve_model_cls`. The
vexact classes are registered lazily under their own names (`VexactQwen3ForCausalLM`, ...), and the
two lookups are wrapped on the registry instance: with `model_impl == "vexact"` the checkpoint's
architecture is mapped to its vexact class (or refused, naming the supported ones); with any other
model_impl the original lookups run untouched. Each vexact architecture also gets vLLM's
per-architecture config hooks (`MODELS_CONFIG_MAP`, engine_checks.py), which refuse unsupported
checkpoints and engine options while vLLM builds its configuration.
"""

from __future__ import annotations

from vexact_vllm.model_patches.config import SUPPORTED_ARCHITECTURES

MODEL_IMPL = "vexact"
VEXACT_ARCHITECTURES = {arch: f"Vexact{arch}" for arch in SUPPORTED_ARCHITECTURES}


class UnsupportedArchitectureError(ValueError):
    pass


def vexact_architectures(architectures: list[str]) -> list[str]:
    mapped = [VEXACT_ARCHITECTURES[a] for a in architectures if a in VEXACT_ARCHITECTURES]
    if not mapped:
        raise UnsupportedArchitectureError(
            f"--model-impl vexact does not support architecture {', '.join(architectures) or '(none)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Use another --model-impl for this model "
            "(its rollouts will not be bitwise equal to the trainer)."
        )
    return mapped


def _wrap_lookup(registry, method_name: str) -> None:
    original = getattr(registry, method_name)
    if getattr(original, "_vexact", False):
        return

    def lookup(architectures, model_config, *args, **kwargs):
        if getattr(model_config, "model_impl", None) == MODEL_IMPL:
            if isinstance(architectures, str):
                architectures = [architectures]
            architectures = vexact_architectures(list(architectures))
        return original(architectures, model_config, *args, **kwargs)

    lookup._vexact = True
    setattr(registry, method_name, lookup)


def register_models() -> None:
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .engine_checks import VexactModelConfig

    for vexact_name in VEXACT_ARCHITECTURES.values():
        if vexact_name not in ModelRegistry.models:
            ModelRegistry.register_model(vexact_name, f"vexact_vllm.models:{vexact_name}")
        MODELS_CONFIG_MAP[vexact_name] = VexactModelConfig
    for name in ("inspect_model_cls", "resolve_model_cls"):
        _wrap_lookup(ModelRegistry, name)
