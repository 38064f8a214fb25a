"""`--model-impl vexact`: resolve the supported Hugging Face architectures to vexact model classes.

vLLM resolves a model class through `ModelRegistry.inspect_model_cls` / `resolve_model_cls`. The
vexact class is registered lazily once per family of the family table (`VllmVexactQwen3ForCausalLM`,
..., naming `vexact_vllm.vllm_wrapper.VllmVexactForCausalLM`, or `VllmVexactHybridForCausalLM` for the
hybrid families), and the two lookups are wrapped
(`wrap_lookup`, rows of vllm_patches.py): with `model_impl == MODEL_IMPL` ("vexact") the
checkpoint's architecture is mapped to its vexact class (or refused, naming the supported ones);
with any other model_impl the original lookups run untouched. Each vexact architecture also gets
vLLM's per-architecture config hooks (`MODELS_CONFIG_MAP`, engine_checks.py), which refuse
unsupported checkpoints and engine options while vLLM builds its configuration.

Post-condition (`wrap_worker_load_model`, a row too): should some vLLM version resolve the model
class by a path these lookups do not see, the worker would serve vLLM's own class under
`--model-impl vexact`; so after the worker loads its model, the model must be a vexact model.
"""

from __future__ import annotations

import functools

from vexact_vllm.model_impl import MODEL_IMPL
from vexact_vllm.model_patches.config import SUPPORTED_ARCHITECTURES
from vexact_vllm.model_patches.families import FAMILIES

from .versions import SUPPORTED_TEXT

# Hugging Face architecture -> the name vLLM resolves it to under --model-impl vexact.
VEXACT_ARCHITECTURES = {f.architecture: f.vllm_name for f in FAMILIES}


class UnsupportedArchitectureError(ValueError):
    pass


class NotAVexactModelError(RuntimeError):
    """vLLM built a model that is not ours although `--model-impl vexact` was asked for."""


# What to do about an unsupported architecture, for a server (`vexact-vllm check` says it its own way).
SERVE_ADVICE = "Use another --model-impl for this model (its rollouts will not be bitwise equal to the trainer)."


def vexact_architectures(architectures: list[str]) -> list[str]:
    # A name already resolved to its vexact class (vLLM looks the resolved architecture up again, e.g.
    # when it sizes a hybrid model's cache blocks) stays itself.
    vexact = set(VEXACT_ARCHITECTURES.values())
    mapped = [a if a in vexact else VEXACT_ARCHITECTURES[a] for a in architectures if a in VEXACT_ARCHITECTURES or a in vexact]
    if not mapped:
        raise UnsupportedArchitectureError(
            f"--model-impl vexact does not support architecture {', '.join(architectures) or '(none)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}. {SERVE_ADVICE}"
        )
    return mapped


def is_vexact_model(model) -> bool:
    return getattr(model, "is_vexact_model", False) is True


def wrap_lookup(original):
    """`_ModelRegistry.inspect_model_cls` / `resolve_model_cls`: vexact architectures under vexact."""

    @functools.wraps(original)
    def lookup(self, architectures, model_config, *args, **kwargs):
        if getattr(model_config, "model_impl", None) == MODEL_IMPL:
            if isinstance(architectures, str):
                architectures = [architectures]
            architectures = vexact_architectures(list(architectures))
        return original(self, architectures, model_config, *args, **kwargs)

    return lookup


def check_built_model(model, model_impl) -> None:
    """Raise unless a `--model-impl vexact` engine was given a vexact model."""
    if model_impl != MODEL_IMPL or is_vexact_model(model):
        return
    import vllm

    cls = type(model)
    raise NotAVexactModelError(
        f"--model-impl vexact, but vLLM {vllm.__version__} built {cls.__module__}.{cls.__qualname__}, which "
        "is not a vexact model: this vLLM resolved the model class without the lookups vexact-vllm "
        "patches, and its rollouts would not be bitwise equal to the trainer. Use a vLLM version "
        f"vexact-vllm supports ({SUPPORTED_TEXT}) or report the version."
    )


def wrap_worker_load_model(original):
    """`Worker.load_model` (GPU, CPU and XPU workers, every runner and model loader): the post-condition."""

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        check_built_model(self.model_runner.get_model(), getattr(self.vllm_config.model_config, "model_impl", None))
        return result

    return load_model


def register_models(classes: bool = False) -> None:
    """Registrations (no patches): the vexact classes and their config hooks. By default by name, so
    registering imports no model code; vLLM then inspects the class in a fresh Python process (about
    15 s on two cores) unless its cache (VLLM_CACHE_ROOT/modelinfos) holds the inspection of this very
    vllm_wrapper.py. `classes`: the imported class itself, which vLLM inspects in this process; for a
    caller that runs the engine in its own process anyway (`vexact-vllm check` on CPU)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .engine_checks import VexactModelConfig

    for family in FAMILIES:
        model: object = f"vexact_vllm.vllm_wrapper:{family.vllm_class}"
        if classes:
            from . import vllm_wrapper

            model = getattr(vllm_wrapper, family.vllm_class)
        if classes or family.vllm_name not in ModelRegistry.models:
            ModelRegistry.register_model(family.vllm_name, model)
        MODELS_CONFIG_MAP[family.vllm_name] = VexactModelConfig
