"""The training-side switch for RL trainers: import this module (or call `enable()`) in every
trainer process and the trainer builds and scores with the shared model.

Nothing turns it on by itself: installing vexact-vllm changes no trainer (a stock-vLLM verl run, or
a vLLM rollout worker that imports verl, is left alone). Turn it on explicitly:
- verl: `actor_rollout_ref.model.external_lib=vexact_vllm.model_patches.enable` (verl imports the
  module in its workers; importing it calls `enable()`);
- by hand: `from vexact_vllm.model_patches.enable import enable; enable()`.

`enable()`, `disable()`, `is_enabled()` and the `enabled()` context manager (which restores the
previous state). What it does (each part lives in its own module and is idempotent):
- transformers: `AutoModelForCausalLM` builds the vexact training classes for Qwen3, Qwen2 and
  Llama configs (`training.enable_training`), which is how verl's FSDP engine builds models;
- verl: the actor's log-prob paths go through the shared fused linear log-prob (`verl_hooks`);
- VeOmni: its modeling and kernel registries return the shared model and kernels (`veomni_hooks`).
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager

from .training import disable_training, enable_training, is_training_enabled


def _hooks() -> list:
    """The trainer hook modules whose library is installed (verl_hooks, veomni_hooks)."""
    hooks = []
    if importlib.util.find_spec("verl") is not None:
        from . import verl_hooks

        hooks.append(verl_hooks)
    if importlib.util.find_spec("veomni") is not None:
        from . import veomni_hooks

        hooks.append(veomni_hooks)
    return hooks


def enable() -> None:
    enable_training()
    for hooks in _hooks():
        hooks.install()


def disable() -> None:
    for hooks in reversed(_hooks()):
        hooks.uninstall()
    disable_training()


def is_enabled() -> bool:
    return is_training_enabled() and all(hooks.is_installed() for hooks in _hooks())


@contextmanager
def enabled():
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()


enable()  # importing the module is the switch (verl's external_lib imports it)
