"""Training-side switch: make `AutoModelForCausalLM` build the shared model for the supported
model types. Symmetric and reversible: `enable_training()`, `disable_training()`,
`is_training_enabled()`, and the `training_enabled()` context manager."""

from __future__ import annotations

from contextlib import contextmanager

from transformers import AutoModelForCausalLM

from .hf_model import TRAINING_CLASSES

_enabled = False


def _mapping():
    return AutoModelForCausalLM._model_mapping._extra_content


def enable_training() -> None:
    """After this, AutoModelForCausalLM.from_pretrained / from_config on a Qwen3, Qwen2 or Llama
    config returns the vexact training class (a PreTrainedModel)."""
    global _enabled
    for cls in TRAINING_CLASSES.values():
        AutoModelForCausalLM.register(cls.config_class, cls, exist_ok=True)
        # Some transformers releases skip registrations keyed by their own config classes (their
        # guard against remote code); put the entry in the registry's own table for them.
        _mapping()[cls.config_class] = cls
    _enabled = True


def disable_training() -> None:
    global _enabled
    for cls in TRAINING_CLASSES.values():
        if _mapping().get(cls.config_class) is cls:
            del _mapping()[cls.config_class]
    _enabled = False


def is_training_enabled() -> bool:
    return _enabled


@contextmanager
def training_enabled():
    was = is_training_enabled()
    enable_training()
    try:
        yield
    finally:
        (enable_training if was else disable_training)()
