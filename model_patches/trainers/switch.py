"""The training-side switch: `enable()`, `disable()`, `is_enabled()` and the `enabled()` context
manager. On, every trainer library installed builds and scores with the shared model.

Nothing turns it on by itself: installing vexact-vllm changes no trainer (a stock-vLLM verl run, or
a vLLM rollout worker that imports verl, is left alone). Turn it on in every trainer process:
- verl: `actor_rollout_ref.model.external_lib=vexact_vllm.model_patches.enable` (verl imports that
  module in its workers; importing it calls `enable()`);
- by hand: `from vexact_vllm.model_patches import enable; enable()`.

`enable()` installs, in this order (each part idempotent, with the same install / uninstall /
is_installed API; `disable()` uninstalls them in reverse order):
1. transformers (`transformers_hooks`): `AutoModelForCausalLM` builds the vexact training classes;
2. verl, when installed (`verl_hooks`): the actor's log-prob paths go through the shared fused
   linear log-prob;
3. VeOmni, when installed (`veomni_hooks`): its modeling and kernel registries return the shared
   model and kernels.
A trainer library's hooks module is imported by `enable()` only; `disable()` and `is_enabled()`
never import one (hooks never imported were never installed).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from contextlib import contextmanager

from . import transformers_hooks

# trainer library -> the module of its hooks
TRAINER_HOOKS = {"verl": f"{__package__}.verl_hooks", "veomni": f"{__package__}.veomni_hooks"}


def _trainer_hooks(import_them: bool) -> list:
    """The hooks modules of the installed trainer libraries: all of them (imported here when
    `import_them`), else only those already imported."""
    hooks = []
    for library, module in TRAINER_HOOKS.items():
        if module in sys.modules:
            hooks.append(sys.modules[module])
        elif import_them and importlib.util.find_spec(library) is not None:
            hooks.append(importlib.import_module(module))
    return hooks


def enable() -> None:
    transformers_hooks.install()
    for hooks in _trainer_hooks(import_them=True):
        hooks.install()


def disable() -> None:
    for hooks in reversed(_trainer_hooks(import_them=False)):
        hooks.uninstall()
    transformers_hooks.uninstall()


def is_enabled() -> bool:
    """Every part installed: transformers', and each installed trainer library's."""
    if not transformers_hooks.is_installed():
        return False
    for library, module in TRAINER_HOOKS.items():
        if importlib.util.find_spec(library) is None:
            continue
        if module not in sys.modules or not sys.modules[module].is_installed():
            return False
    return True


@contextmanager
def enabled():
    """On within the block; the previous state afterwards (on again if the body turned it off)."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        (enable if was else disable)()
