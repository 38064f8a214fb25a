"""The training-side switch for RL trainers: import this module (or call `enable()`) in every
trainer process and the trainer builds and scores with the shared model.

- verl: `actor_rollout_ref.model.external_lib=vexact_vllm.model_patches.enable`, or nothing at all:
  the `verl.plugins` entry point of this distribution imports this module when verl is imported
  (`VERL_USE_EXTERNAL_PLUGINS=none` turns that off).
- By hand: `from vexact_vllm.model_patches.enable import enable; enable()`.

What it does (each part lives in its own module and is idempotent):
- transformers: `AutoModelForCausalLM` builds the vexact training classes for Qwen3, Qwen2 and
  Llama configs (`training.enable_training`), which is how verl's FSDP engine builds models;
- verl: the actor's log-prob paths go through the shared fused linear log-prob (`verl_hooks`);
- VeOmni: its modeling and kernel registries return the shared model and kernels (`veomni_hooks`).
"""

from __future__ import annotations

import importlib.util

from .training import enable_training


def enable() -> None:
    enable_training()
    if importlib.util.find_spec("verl") is not None:
        from . import verl_hooks

        verl_hooks.install()
    if importlib.util.find_spec("veomni") is not None:
        from . import veomni_hooks

        veomni_hooks.install()


enable()
